"""agentmem as a LangChain chat model: session IDs from config, streaming, usage with cache reads.

LangChain sends the whole conversation each call; agentmem reads only what the session's KV
cache does not hold yet, and reports it: ``input_token_details.cache_read`` are tokens reused
from the cache, ``cache_creation`` the tokens actually read.

    python examples/langchain_chat.py
"""

from __future__ import annotations

import argparse

from langchain_core.messages import HumanMessage, SystemMessage

from agentmem.adapters.langchain import ChatAgentMem

PROMPTS = ["Give me a tip for writing clear code.", "Give me another one.", "Summarise both tips in one sentence."]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None, help="store URL (default: the shared one under $AGENTMEM_HOME)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    model = ChatAgentMem(model="embedded", store=args.store, max_tokens=args.max_tokens)  # the default tenant
    config = {"configurable": {"session_id": "langchain-example"}}
    if model.manager.delete(model.tenant, "langchain-example"):  # start the story from scratch
        print("(deleted the session langchain-example a previous run stored: the story starts afresh)")
    history = [SystemMessage("You are a concise assistant.")]
    usages = []
    for prompt in PROMPTS:
        history.append(HumanMessage(prompt))
        print(f"\nyou: {prompt}\nassistant: ", end="")
        reply = None
        for chunk in model.stream(history, config=config):  # tokens as they are generated
            print(chunk.content, end="", flush=True)
            reply = chunk if reply is None else reply + chunk
        details = reply.usage_metadata["input_token_details"]
        print(f"\n  [LangChain sent all {len(history)} messages ({reply.usage_metadata['input_tokens']} tokens); "
              f"{details['cache_read']} of them were already in the session's KV cache, only "
              f"{details['cache_creation']} were read; {reply.usage_metadata['output_tokens']} generated]")
        usages.append(dict(reply.usage_metadata))
        history.append(reply)
    return usages


if __name__ == "__main__":
    main()
