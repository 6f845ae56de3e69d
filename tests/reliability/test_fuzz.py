"""Hypothesis fuzzing of policy files, message lists and CLI arguments: only our typed errors come out.

(Blob decoding is fuzzed in tests/storage/test_codec.py: garbage and mutated real blobs.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
# Fields a policy may well hold (so that many documents load, and what loads is checked), mixed
# with anything at all under any name.
plausible = st.fixed_dictionaries({}, optional={
    "max_live_tokens": st.integers(64, 10**6), "keep_recent": st.integers(1, 63),
    "target_ratio": st.floats(1, 64), "target_tokens": st.none(),
    "fill_after_compaction": st.floats(0.05, 0.95), "method": st.sampled_from(["am", "am-fast", "window"]),
    "storage_dtype": st.sampled_from(["auto", "fp16", "int8"]), "ttl_seconds": st.none() | st.floats(1e-3, 1e9),
    "max_stored_bytes": st.none() | st.integers(1, 2**40), "on_over_budget": st.sampled_from(["compact", "reject"]),
})
tenants = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._@-", min_size=1, max_size=12)
policy_docs = st.dictionaries(tenants | st.text(max_size=12),
                              values | st.dictionaries(st.sampled_from(FIELDS), values, max_size=6) | plausible,
                              max_size=4)
# Derandomized: CI explores the same examples every run, so a failure is reproducible, never flaky.
fuzz = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def written(tmp_path_factory, doc: object, as_json: bool, raw: str | None = None) -> Path:
    """A policy file holding ``raw``, else ``doc`` as JSON or YAML."""
    path = tmp_path_factory.mktemp("policy") / ("p.json" if as_json else "p.yaml")
    path.write_text(raw if raw is not None else (json.dumps(doc, default=str) if as_json else yaml.safe_dump(doc)))
    return path


def assert_reads_back(loaded: dict[str, BudgetPolicy], path: Path) -> None:
    """Nothing is lost or changed on the way: the policies written back to a file load as the same policies."""
    again = path.with_name("again.yaml")
    again.write_text(yaml.safe_dump({tenant: policy.model_dump() for tenant, policy in loaded.items()}))
    assert BudgetPolicy.from_file(again) == loaded


@fuzz
@given(doc=policy_docs, as_json=st.booleans(), raw=st.one_of(st.none(), st.text(max_size=200)))
def test_policy_files_load_or_raise_invalid_input(tmp_path_factory, doc, as_json, raw):
    path = written(tmp_path_factory, doc, as_json, raw)
    try:
        loaded = BudgetPolicy.from_file(path)
    except InvalidInput:
        return
    text = path.read_text()
    assert set(loaded) == set(json.loads(text) if as_json else yaml.safe_load(text))  # every tenant, no other
    assert_reads_back(loaded, path)


@fuzz
@given(doc=st.dictionaries(tenants, plausible, max_size=4), as_json=st.booleans())
def test_a_policy_file_that_loads_holds_every_field_as_written(tmp_path_factory, doc, as_json):
    path = written(tmp_path_factory, doc, as_json)
    try:
        loaded = BudgetPolicy.from_file(path)
    except InvalidInput as exc:  # only a combination no policy may hold (keep_recent not below max_live_tokens)
        assert "keep_recent" in str(exc), exc
        return
    assert set(loaded) == set(doc)
    for tenant, fields in doc.items():
        assert loaded[tenant].name == tenant and loaded[tenant].model_dump(include=set(fields)) == fields
    assert_reads_back(loaded, path)


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


def test_huge_and_empty_messages_are_typed_errors_or_read_and_the_session_survives(small_engine, tmp_path):
    from agentmem import SessionManager

    huge = "word " * (small_engine.max_context + 10)
    rejecting = BudgetPolicy(max_live_tokens=4096, on_over_budget="reject")
    with SessionManager(small_engine, f"sqlite:///{tmp_path / 's.db'}", policies={"strict": rejecting}) as manager:
        session = manager.session("t-1")
        strict = manager.session("t-2", tenant="strict")  # cannot compact, so cannot read past the window
        for each in (session, strict):
            each.chat("hello", max_new_tokens=2)
        held = session.cache.token_ids
        with pytest.raises(AgentMemError):
            strict.chat(huge, max_new_tokens=2)
        assert strict.cache.token_ids == held
        for bad in [[], [{"role": "user"}], [{"role": "x", "content": ""}]]:
            try:
                session.chat(bad, max_new_tokens=2)
            except AgentMemError:
                pass
            else:
                raise AssertionError(f"{str(bad)[:40]} was accepted")
            assert session.cache.token_ids[: len(held)] == held
        assert session.chat("still here?", max_new_tokens=2).usage.reused_tokens >= len(held)
        # A session that compacts reads a message longer than the model's window, its positions in range.
        usage = session.chat(huge, max_new_tokens=2).usage
        assert usage.logical_tokens > small_engine.max_context > usage.position


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
