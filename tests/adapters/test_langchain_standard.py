"""langchain-tests' standard suites (pinned in pyproject) against ChatAgentMem on the embedded model.

Turned off, with the suite's own flags: tool calling, structured output and JSON mode in the
integration suite (implemented, and tested in test_langchain.py, but a 135M model does not
reliably write valid calls or JSON, so those tests would measure the model, not the adapter),
multimodal inputs (text-only models) and per-call model override (one engine per object).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from agentmem.adapters.langchain import ChatAgentMem

STORE = f"sqlite:///{Path(tempfile.mkdtemp(prefix='agentmem-lc-')) / 'sessions.db'}"
PARAMS = {"store": STORE, "session_id": "standard-suite"}


class _ChatAgentMemSuite:
    """What both suites construct: ChatAgentMem on a private SQLite store, one default session."""

    @property
    def chat_model_class(self) -> type[ChatAgentMem]:
        return ChatAgentMem

    @property
    def chat_model_params(self) -> dict:
        return PARAMS


class TestChatAgentMemUnit(_ChatAgentMemSuite, ChatModelUnitTests):
    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {"AGENTMEM_STORE": STORE, "AGENTMEM_MODEL": "embedded"}, {}, {"store": STORE, "model": "embedded"}


class TestChatAgentMemIntegration(_ChatAgentMemSuite, ChatModelIntegrationTests):
    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": 32}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input", "cache_creation_input"],
                "stream": ["cache_read_input", "cache_creation_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A second turn of one session: its first turn's tokens are read from the KV cache."""
        return self._second_turn("cache-read", stream)

    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        return self._second_turn("cache-creation", stream)

    def _second_turn(self, name: str, stream: bool) -> AIMessage:
        model = ChatAgentMem(**{**PARAMS, "session_id": f"{name}-{stream}", "max_tokens": 32})
        first = model.invoke([HumanMessage("Hello")])
        history = [HumanMessage("Hello"), first, HumanMessage("How are you?")]
        if not stream:
            message = model.invoke(history)
        else:
            message = None
            for chunk in model.stream(history):
                message = chunk if message is None else message + chunk
        details = message.usage_metadata["input_token_details"]
        assert details["cache_read"] == first.usage_metadata["total_tokens"]
        assert details["cache_creation"] > 0
        return message
