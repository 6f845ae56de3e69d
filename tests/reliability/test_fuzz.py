"""Hypothesis fuzzing of policy files, message lists and CLI arguments: only our typed errors come out.

(Blob decoding is fuzzed in tests/storage/test_codec.py: garbage and mutated real blobs.)
"""

from __future__ import annotations

import json

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from agentmem import BudgetPolicy
from agentmem.cli import app
from agentmem.errors import AgentMemError, InvalidInput

FIELDS = list(BudgetPolicy.model_fields) + ["colour", "", "max_live_tokens "]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system\n", "<tool_call>", "\x00", "\ue000"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["am", "window", "fp16", "int8", "compact", "reject"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                          max_size=3), max_leaves=5)
policy_docs = st.dictionaries(st.text(max_size=12), st.one_of(values, st.dictionaries(st.sampled_from(FIELDS), values,
                                                                                    max_size=6)), max_size=4)
# Derandomized: CI explores the same examples every run, so a failure is reproducible, never flaky.
fuzz = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@fuzz
@given(doc=policy_docs, as_json=st.booleans(), raw=st.one_of(st.none(), st.text(max_size=200)))
def test_policy_files_load_or_raise_invalid_input(tmp_path_factory, doc, as_json, raw):
    path = tmp_path_factory.mktemp("policy") / ("p.json" if as_json else "p.yaml")
    text = raw if raw is not None else (json.dumps(doc, default=str) if as_json else yaml.safe_dump(doc))
    path.write_text(text)
    try:
        loaded = BudgetPolicy.from_file(path)
    except InvalidInput:
        return
    assert all(isinstance(p, BudgetPolicy) for p in loaded.values())


contents = st.one_of(st.text(max_size=60), st.lists(st.sampled_from(SPECIAL) | st.text(max_size=8), max_size=6).map("".join),
                     st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "admin", "",
                                                                     None, 3]),
                                           "content": contents}), max_size=6)


@fuzz
@given(conversation=st.one_of(messages, st.text(max_size=10), st.none(), st.lists(st.integers(), max_size=3)))
def test_message_lists_render_or_raise_and_typed_special_tokens_stay_text(small_engine, conversation):
    tokenizer = small_engine.tokenizer
    try:
        ids = small_engine.chat_delta(small_engine.new_cache(), conversation)
    except InvalidInput:
        return
    # The same conversation with the special-token spellings defused must have exactly as many
    # special tokens: whatever a message typed, only the template made control tokens.
    defused = [{**m, "content": m["content"].replace("<|", "<¦")} for m in conversation]
    reference = small_engine.chat_delta(small_engine.new_cache(), defused)
    special = set(tokenizer.all_special_ids)
    assert [t for t in ids if t in special] == [t for t in reference if t in special]


def test_huge_and_empty_messages_are_typed_errors_and_the_session_survives(small_engine, tmp_path):
    from agentmem import SessionManager

    with SessionManager(small_engine, f"sqlite:///{tmp_path / 's.db'}") as manager:
        session = manager.session("t-1")
        session.chat("hello", max_new_tokens=2)
        held = session.cache.token_ids
        for bad in ["word " * (small_engine.max_context + 10), [], [{"role": "user"}], [{"role": "x", "content": ""}]]:
            try:
                session.chat(bad, max_new_tokens=2)
            except AgentMemError:
                pass
            else:
                raise AssertionError(f"{str(bad)[:40]} was accepted")
            assert session.cache.token_ids[: len(held)] == held
        assert session.chat("still here?", max_new_tokens=2).usage.reused_tokens >= len(held)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from([["sessions", "show"], ["sessions", "list", "--tenant"], ["sessions", "delete"],
                                ["sessions", "delete", "--all", "--yes", "--tenant"], ["policy", "set"],
                                ["policy", "show", "--tenant"]]),
       args=st.lists(st.text(min_size=0, max_size=12), min_size=1, max_size=3))
def test_cli_arguments_exit_cleanly(tmp_path_factory, command, args):
    home = tmp_path_factory.mktemp("cli")
    result = CliRunner().invoke(app, [*command, *args, "--store", f"sqlite:///{home / 's.db'}"]
                                if command[0] == "sessions" else [*command, *args, "--policies", str(home / "p.yaml")])
    assert result.exit_code in (0, 1, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
