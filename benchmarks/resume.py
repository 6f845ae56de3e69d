"""Resume vs re-prefill: how fast a stored session comes back, against reading its transcript again.

For sessions of real text (the Python docs), full and compacted 10x (``am-fast``, the last 64
tokens raw), stored in ``--storage-dtype`` (default ``auto``: the cache's own dtype, as the
default policy stores it), per tier:

- ``host``: the record held in host memory, as the manager's host tier holds it (page-locked
  when the cache lives on a GPU); ``sqlite``, ``redis`` and ``postgres`` (a throwaway server,
  where PostgreSQL is installed): the durable stores;
- ``spill s``: encode the cache and write it to the tier as a new session; ``turn spill s``:
  encode and write it again after a turn of ``TURN_TOKENS`` new tokens, over the version spilled
  before the turn (the stores write only the chunks that changed; ``turn MiB written`` is what
  they wrote, from their ``bytes_written``; the host tier holds a new copy); ``resume s``: read it back (into the
  buffer a resume uses: ``read_buffer_for``) and decode it onto the device; ``raw read s``: the
  same bytes by the plain client (``sqlite3`` SELECT of the chunk rows, Redis MGET, psycopg
  SELECT; for ``host``, one copy of the bytes into device memory): the floor a resume cannot beat;
- time to first token of a new message after resume, against transformers re-reading the whole
  transcript plus the message (its sdpa forward on the same weights, last position's logits):
  what a caller without a stored cache pays.

Medians of ``--repeats`` runs interleaved in one process (the re-prefill once per length).
CPU default: the embedded SmolLM2-135M at 1k/4k/8k tokens. On a GPU: ``--shape llama-8b``
(random weights, bf16, 128 KiB of KV per token) at 1k/8k/32k. Writes
``benchmarks/results/resume.{md,json,png}`` (``resume-gpu.*`` on a GPU).
Run: ``python benchmarks/resume.py`` (from ``benchmarks/``; ``--plot-only`` redraws the plot from the saved JSON).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import redis
import torch

from agentmem import Engine, SessionCache
from agentmem.compaction import compact
from agentmem.errors import StoreUnavailable
from agentmem.host_memory import read_buffer_for
from agentmem.host_tier import HostTier
from agentmem.record import SessionRecord
from agentmem.storage import STORAGE_CHOICES, block_starts, decode_cache, encode_cache, open_store, read_header
from agentmem.storage.redis import _LAYOUT_FIELDS, _keys_of, _meta_key, _owners
from common import (RESULTS, SHAPES, command_line, machine, median_seconds, model_label, pyplot, random_shape_engine,
                    save_figure, stdlib_text, write_results)

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the throwaway servers of tests/servers
from servers.local_postgres import LocalPostgres  # noqa: E402
from servers.local_redis import LocalRedis  # noqa: E402

NEW_MESSAGE = "\nQuestion: what does the text above say about exceptions?"
TURN_TOKENS = 128  # a turn's new tokens between two spills of a session
TIERS = ("host", "sqlite", "redis", "postgres")
SQL_CHUNKS = ("SELECT c.data FROM agentmem_sessions s JOIN agentmem_manifests m ON m.tenant = s.tenant AND "
              "m.session_id = s.session_id AND m.write_id = s.write_id JOIN agentmem_chunks c ON c.tenant = m.tenant "
              "AND c.session_id = m.session_id AND c.write_id = m.chunk_write_id AND c.seq = m.seq "
              "WHERE s.tenant={p} AND s.session_id={p} ORDER BY m.seq")


def compacted_10x(engine: Engine, cache: SessionCache) -> SessionCache:
    """The cache compacted 10x by Attention Matching (am-fast), the last 64 tokens kept raw."""
    return compact(engine, cache, "am-fast", ratio=10, keep_recent=64)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` with the device's queued work included."""
    return median_seconds(lambda: (fn(), sync(device)), repeats)


def spill_seconds(device: torch.device, store, spill: Callable[[SessionCache, str, int], None], cache: SessionCache,
                  after_turn: SessionCache, repeats: int) -> tuple[float, float, float]:
    """Medians of: spilling ``cache`` as a new session; spilling ``after_turn`` over it; and the bytes that wrote.

    Each repeat spills under a fresh id (so the first write shares nothing) and deletes it after;
    both are compare-and-set writes, as the manager's spills are (only those share chunks).
    """
    full, turn, written = [], [], []
    for r in range(repeats):
        into_id = f"spill-{r}"
        full.append(seconds(device, lambda: spill(cache, into_id, 0), 1))
        before = store.bytes_written
        turn.append(seconds(device, lambda: spill(after_turn, into_id, 1), 1))
        written.append(store.bytes_written - before)
        store.delete("bench", into_id)
    return statistics.median(full), statistics.median(turn), statistics.median(written)


class HostTierStore:
    """The manager's host tier (:class:`HostTier`) behind the two store calls this benchmark makes.

    A spill's blob is already in host memory of the kind a resume reads (the encoder wrote it
    there), so holding it is all the tier does, as in the manager.
    """

    def __init__(self) -> None:
        self.tier = HostTier(budget_bytes=2**40, tenant_budget=lambda tenant: None)
        self.bytes_written = 0

    def put(self, tenant: str, session_id: str, record: SessionRecord, expected_version: int | None = None) -> None:
        assert self.tier.put(record, dirty=False)
        self.bytes_written += len(record.blob)  # a new copy of the whole blob, whatever changed

    def delete(self, tenant: str, session_id: str) -> None:
        self.tier.discard((tenant, session_id))

    def get(self, tenant: str, session_id: str, *, into=None) -> SessionRecord:
        return self.tier.get((tenant, session_id)).record

    def close(self) -> None:
        pass


def raw_reader(tier: str, store, url: str, device: torch.device) -> Callable[[str, str], object]:
    """The plain client's read of a stored blob: the floor for ``tier``."""
    if tier == "host":
        def host_read(tenant: str, sid: str) -> torch.Tensor:
            blob = store.get(tenant, sid).blob
            return torch.empty(len(blob), dtype=torch.uint8, device=device).copy_(torch.frombuffer(blob, dtype=torch.uint8))

        return host_read
    if tier == "sqlite":
        db = sqlite3.connect(url.removeprefix("sqlite:///"))
        return lambda tenant, sid: b"".join(row[0] for row in db.execute(SQL_CHUNKS.format(p="?"), (tenant, sid)))
    if tier == "postgres":
        import psycopg

        conn = psycopg.connect(url, autocommit=True)
        return lambda tenant, sid: b"".join(row[0] for row in conn.execute(SQL_CHUNKS.format(p="%s"), (tenant, sid)))
    client = redis.Redis.from_url(url)

    def redis_read(tenant: str, sid: str) -> bytes:
        layout = client.hmget(_meta_key(tenant, sid), *_LAYOUT_FIELDS)
        return b"".join(client.mget(_keys_of(tenant, sid, _owners(layout))))

    return redis_read


def open_tiers(names: list[str], workdir: Path, device: torch.device, stack: ExitStack) -> dict[str, tuple[object, str]]:
    """Each tier as ``(store, url)``; a tier whose server cannot start here is left out, with a note."""
    tiers = {}
    for name in names:
        try:
            if name == "host":
                tiers[name] = (HostTierStore(), "")
                continue
            if name == "sqlite":
                url = f"sqlite:///{workdir / 'sessions.db'}"
            elif name == "redis":
                url = stack.enter_context(LocalRedis(workdir / "redis")).url
            else:
                url = stack.enter_context(LocalPostgres()).create_database("bench")
            tiers[name] = (open_store(url), url)
        except StoreUnavailable as exc:
            print(f"tier {name} left out: {exc}")
    return tiers


@torch.inference_mode()
def transformers_first_token(model, ids: list[int], device: torch.device) -> int:
    """Re-read ``ids`` with transformers' own sdpa forward; the greedy next token."""
    model.set_attn_implementation("sdpa")
    try:
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1).logits
        return int(logits[0, -1].argmax())
    finally:
        from agentmem import attention

        model.set_attn_implementation(attention.ATTENTION_NAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=["embedded", *sorted(SHAPES)], default=None,
                        help="the embedded model (CPU default) or a random-weight shape (GPU default: llama-8b)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--storage-dtype", default="auto", choices=STORAGE_CHOICES)
    parser.add_argument("--plot-only", choices=("resume", "resume-gpu"), nargs="?", const="resume",
                        help="redraw results/NAME.png from results/NAME.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        saved = json.loads((RESULTS / f"{args.plot_only}.json").read_text())
        return plot(args.plot_only, saved["rows"], saved["model"])

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    shape = args.shape or ("llama-8b" if on_gpu else "embedded")
    lengths = args.lengths or ([1024, 8192, 32768] if on_gpu else [1024, 4096, 8000])
    if shape == "embedded":
        engine = Engine.load("embedded", device=device)
    else:
        engine = random_shape_engine(shape, device, torch.bfloat16 if on_gpu else torch.float32, max(lengths) + 256)
    text = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"]
    ids = (text * (max(lengths) // len(text) + 1))
    new_ids = engine.tokenizer(NEW_MESSAGE, add_special_tokens=False)["input_ids"]
    workdir = Path(tempfile.mkdtemp(prefix="agentmem-resume-"))
    rows = []
    with ExitStack() as stack:
        tiers = open_tiers(args.tiers, workdir, device, stack)
        transformers_first_token(engine.model, ids[:64], device)  # warm-up: the first forward pays set-up costs
        for length in lengths:
            log = ids[:length]
            reprefill = seconds(device, lambda: transformers_first_token(engine.model, log + new_ids, device), 1)
            print(f"{length} tokens: transformers re-reads them and answers in {reprefill:.2f} s", flush=True)
            full = engine.prefill(log)
            turn = ids[length : length + TURN_TOKENS]
            for variant, cache in (("full", full), ("compacted 10x", compacted_10x(engine, full))):
                after_turn = engine.prefill(turn, cache.clone())
                turn_size = len(encode_cache(after_turn, dtype=args.storage_dtype))
                session_id = f"s{length}-{variant.split()[0]}"
                record = SessionRecord(tenant="bench", session_id=session_id, model_fingerprint=engine.fingerprint,
                                       logical_length=cache.logical_length,
                                       blob=encode_cache(cache, dtype=args.storage_dtype, into=read_buffer_for(device)))
                for name, (store, url) in tiers.items():
                    def spill(grown: SessionCache, into_id: str, version: int) -> None:
                        blob = encode_cache(grown, dtype=args.storage_dtype, into=read_buffer_for(device))
                        store.put("bench", into_id, record.model_copy(
                            update={"blob": blob, "blob_cuts": block_starts(blob), "session_id": into_id}),
                            expected_version=version)

                    spill_s, turn_s, turn_bytes = spill_seconds(device, store, spill, cache, after_turn, args.repeats)
                    store.put("bench", session_id, record)

                    def resume() -> SessionCache:
                        got = store.get("bench", session_id, into=read_buffer_for(device))
                        return decode_cache(got.blob, fingerprint=engine.fingerprint, device=device, dtype=engine.dtype)

                    raw = raw_reader(name, store, url, device)
                    raw_s = seconds(device, lambda: raw("bench", session_id), args.repeats)
                    resume_s = seconds(device, resume, args.repeats)
                    ttft_s = seconds(device, lambda: next(engine.stream(resume(), new_ids, max_new_tokens=1)), args.repeats)
                    gb = len(record.blob) / 1e9
                    rows.append({
                        "tokens": length, "cache": variant, "tier": name, "MiB stored": len(record.blob) / 2**20,
                        "spill s": spill_s, "spill GB/s": gb / spill_s, "turn spill s": turn_s,
                        "MiB after turn": turn_size / 2**20, "turn MiB written": turn_bytes / 2**20,
                        "turn spill speed-up": spill_s / turn_s,
                        "raw read s": raw_s, "resume s": resume_s,
                        "resume GB/s": gb / resume_s, "resume / raw read": resume_s / raw_s,
                        "first token s (resume)": ttft_s, "first token s (re-prefill)": reprefill,
                        "speed-up vs re-prefill": reprefill / ttft_s,
                    })
                    print(f"  {variant:14s} {name:8s} {len(record.blob) / 2**20:8.1f} MiB  spill {spill_s:7.3f} s  "
                          f"after a turn {turn_s:7.3f} s ({turn_bytes / 2**20:.1f} MiB written)  "
                          f"raw {raw_s * 1e3:8.1f} ms  resume {resume_s * 1e3:8.1f} ms ({resume_s / raw_s:.2f}x raw)  "
                          f"first token {ttft_s:6.3f} s: {reprefill / ttft_s:5.1f}x faster than re-prefill", flush=True)
            # after each length: a run cut short (a machine lent by the minute) keeps what it measured
            save("resume-gpu" if on_gpu else "resume", rows, f"{engine.name} on {device.type}",
                 read_header(record.blob)["storage_dtype"])
        for store, _ in tiers.values():
            store.close()


def save(name: str, rows: list[dict], model: str, stored_dtype: str) -> None:
    """Write ``results/<name>.{md,json,png}`` from the rows measured so far."""
    md = write_results(name, f"Resume from each tier vs re-prefill ({model}, {stored_dtype} blobs)", rows,
                       {"model": model, "machine": machine(), "command": command_line()})
    plot(name, rows, model)
    print(md, flush=True)


def plot(name: str, rows: list[dict], model: str) -> None:
    """Time to first token after resume from each tier, against transformers re-reading the transcript.

    Both axes are logarithmic, with ticks at the measured lengths and at 1-2-5 steps of seconds, so
    every tick is labelled in plain numbers; one legend serves both panels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 6), sharey=True, layout="constrained")
    lengths = sorted({r["tokens"] for r in rows})
    reprefill = [next(r["first token s (re-prefill)"] for r in rows if r["tokens"] == n) for n in lengths]
    styles = {"host": "-D", "sqlite": "-s", "redis": "--^", "postgres": ":o"}
    for ax, cache in zip(axes, ("full", "compacted 10x")):
        ax.plot(lengths, reprefill, "k-o", label="re-prefill (transformers)")
        for tier, style in styles.items():
            points = [(n, r["first token s (resume)"]) for n in lengths for r in rows
                      if (r["tokens"], r["cache"], r["tier"]) == (n, cache, tier)]
            if points:
                ax.plot(*zip(*points), style, label=f"resume from {tier}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda seconds, _: f"{seconds:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("session length (tokens, log scale)")
        ax.set_title("full cache" if cache == "full" else f"{cache} (am-fast, last 64 tokens raw)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds to the first token (log scale)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=len(styles) + 1)
    engine, _, device = model.rpartition(" on ")
    fig.suptitle(f"Time to first token, resumed from a stored session vs re-reading the transcript\n"
                 f"{model_label(engine)} on {device}; sessions of {lengths[0]:,}–{lengths[-1]:,} tokens of Python docs")
    save_figure(fig, name)


if __name__ == "__main__":
    main()
