"""Resume vs re-prefill: how fast a stored session comes back, against reading its transcript again.

For sessions of 1k, 4k and 8k tokens of real text (the Python docs) on the embedded model:

- re-prefill: read the token log again, then generate the first token of a reply;
- resume from SQLite and from Redis: ``store.get`` + ``decode_cache``, then the first token;
- the raw read of the same blob by each store's plain client (``sqlite3`` SELECT of the chunk
  rows, Redis MGET), the floor a resume cannot beat.

Each for the full cache and a 10×-smaller compacted cache, stored in ``--storage-dtype``
(default ``auto``: the cache's own dtype, as the default policy stores it). Times are medians
of repeated runs interleaved in one process. Writes ``benchmarks/results/resume.{md,json,png}``.
Run: ``python benchmarks/resume.py`` (from ``benchmarks/``; ``--plot-only`` redraws the plot from the saved JSON).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from pathlib import Path

import redis

from agentmem import Engine, SessionCache
from agentmem.compaction import compact
from agentmem.record import SessionRecord
from agentmem.storage import STORAGE_CHOICES, decode_cache, encode_cache, open_store, read_header
from agentmem.storage.local_redis import LocalRedis
from agentmem.storage.redis import _chunk_key, _meta_key
from common import RESULTS, command_line, machine, median_seconds, stdlib_text, write_results

NEW_MESSAGE = "\nQuestion: what does the text above say about exceptions?"


def compacted_10x(engine: Engine, cache: SessionCache) -> SessionCache:
    """The cache compacted 10x by Attention Matching (am-fast), the last 64 tokens kept raw."""
    return compact(engine, cache, ratio=10, keep_recent=64, method="am-fast")


def raw_readers(sqlite_path: Path, redis_url: str, tenant: str, session_id: str):
    """Plain-client reads of the stored blob bytes: the floor for each store."""
    db = sqlite3.connect(sqlite_path)
    client = redis.Redis.from_url(redis_url)

    def sqlite_read() -> bytes:
        return b"".join(row[0] for row in db.execute(
            "SELECT c.data FROM agentmem_chunks c JOIN agentmem_sessions s ON c.tenant = s.tenant AND "
            "c.session_id = s.session_id AND c.write_id = s.write_id WHERE s.tenant=? AND s.session_id=? "
            "ORDER BY c.seq", (tenant, session_id)))

    def redis_read() -> bytes:
        meta = client.hmget(_meta_key(tenant, session_id), "write_id", "chunks")
        keys = [_chunk_key(tenant, session_id, meta[0].decode(), i) for i in range(int(meta[1]))]
        return b"".join(client.mget(keys))

    return {"sqlite": sqlite_read, "redis": redis_read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--storage-dtype", default="auto", choices=STORAGE_CHOICES)
    parser.add_argument("--plot-only", action="store_true", help="redraw resume.png from resume.json and exit")
    args = parser.parse_args()
    if args.plot_only:
        return plot(json.loads((RESULTS / "resume.json").read_text())["rows"])

    engine = Engine.load("embedded")
    ids = engine.tokenizer(stdlib_text(), add_special_tokens=False)["input_ids"]
    new_ids = engine.tokenizer(NEW_MESSAGE, add_special_tokens=False)["input_ids"]
    workdir = Path(tempfile.mkdtemp(prefix="agentmem-resume-"))
    rows = []
    with LocalRedis(workdir / "redis") as server:
        stores = {"sqlite": open_store(f"sqlite:///{workdir / 'sessions.db'}"), "redis": open_store(server.url)}
        for length in args.lengths:
            log = ids[:length]
            start = time.perf_counter()
            full = engine.prefill(log)
            reprefill = time.perf_counter() - start
            start = time.perf_counter()
            next(engine.stream(engine.prefill(log), new_ids, max_new_tokens=8))
            reprefill_ttft = time.perf_counter() - start
            print(f"{length} tokens: re-prefill {reprefill:.2f} s, first token after {reprefill_ttft:.2f} s")
            for variant, cache in (("full", full), ("compacted 10x", compacted_10x(engine, full))):
                blob = encode_cache(cache, dtype=args.storage_dtype)
                session_id = f"s{length}-{variant.split()[0]}"
                record = SessionRecord(tenant="bench", session_id=session_id, model_fingerprint=engine.fingerprint,
                                       logical_length=cache.logical_length, blob=blob)
                for store in stores.values():
                    store.put("bench", session_id, record)
                readers = raw_readers(workdir / "sessions.db", server.url, "bench", session_id)
                for name, store in stores.items():
                    def resume() -> SessionCache:
                        got = store.get("bench", session_id)
                        return decode_cache(got.blob, fingerprint=engine.fingerprint, device=engine.device,
                                            dtype=engine.dtype)

                    def resume_and_first_token() -> None:
                        next(engine.stream(resume(), new_ids, max_new_tokens=8))

                    assert readers[name]() == blob
                    raw_s = median_seconds(readers[name], args.repeats)
                    resume_s = median_seconds(resume, args.repeats)
                    ttft_s = median_seconds(resume_and_first_token, args.repeats)
                    rows.append({
                        "tokens": length, "cache": variant, "store": name,
                        "MiB stored": len(blob) / 2**20,
                        "raw read s": raw_s, "resume s": resume_s, "resume / raw read": resume_s / raw_s,
                        "re-prefill s": reprefill, "speed-up vs re-prefill": reprefill / resume_s,
                        "first token s (resume)": ttft_s, "first token s (re-prefill)": reprefill_ttft,
                    })
                    print(f"  {variant:14s} {name:6s} {len(blob) / 2**20:7.1f} MiB  raw {raw_s * 1e3:7.1f} ms  "
                          f"resume {resume_s * 1e3:7.1f} ms ({resume_s / raw_s:.2f}x raw)  "
                          f"{reprefill / resume_s:6.0f}x faster than re-prefill")
        for store in stores.values():
            store.close()
    stored = read_header(blob)["storage_dtype"]
    md = write_results("resume", f"Resume from a store vs re-prefill (embedded SmolLM2-135M, {stored} blobs)", rows,
                       {"machine": machine(), "command": command_line()})
    plot(rows)
    print(md)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = sorted({r["tokens"] for r in rows})
    reprefill = [next(r["re-prefill s"] for r in rows if r["tokens"] == n) for n in lengths]
    ax.plot(lengths, reprefill, "k-o", label="re-prefill")
    for cache in ("full", "compacted 10x"):
        for store, style in (("sqlite", "-s"), ("redis", "--^")):
            ys = [next(r["resume s"] for r in rows if (r["tokens"], r["cache"], r["store"]) == (n, cache, store))
                  for n in lengths]
            ax.plot(lengths, ys, style, label=f"resume {cache}, {store}")
    ax.set_yscale("log")
    ax.set_xlabel("session length (tokens)")
    ax.set_ylabel("seconds (log)")
    ax.set_title("Resume from store vs re-prefill, SmolLM2-135M on CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "resume.png", dpi=120)


if __name__ == "__main__":
    main()
