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


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="sqlite:///langchain.db")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    model = ChatAgentMem(model="embedded", store=args.store, tenant="acme", max_tokens=args.max_tokens)
    config = {"configurable": {"session_id": "lc-demo"}}
    model.manager.delete("acme", "lc-demo")
    history = [SystemMessage("You are a concise assistant."), HumanMessage("Give me a tip for writing clear code.")]
    usages = []
    for follow_up in ["Give me another one.", "Summarise both tips in one sentence."]:
        reply = None
        print("assistant: ", end="")
        for chunk in model.stream(history, config=config):  # tokens as they are generated
            print(chunk.content, end="", flush=True)
            reply = chunk if reply is None else reply + chunk
        details = reply.usage_metadata["input_token_details"]
        print(f"\n  [{reply.usage_metadata['input_tokens']} input tokens: {details['cache_read']} reused from the "
              f"KV cache, {details['cache_creation']} read; {reply.usage_metadata['output_tokens']} generated]")
        usages.append(dict(reply.usage_metadata))
        history += [reply, HumanMessage(follow_up)]
    return usages


if __name__ == "__main__":
    main()
