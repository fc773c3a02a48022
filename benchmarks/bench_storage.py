"""The storage KV tier across a restart, on a CPU: first-turn TTFT of chats whose histories a
previous engine stored (warm) against a run that computes them (cold), per backend.

    python -m benchmarks.bench_storage --model smollm2 --stores dir,redis --history 1024

For each store, in one process and one engine at a time: `none` (no storage tier: the
recompute baseline), `cold` (an empty store: every prompt computed and written through; the
engine then shuts down, finishing its writes) and `warm` (a new engine on the same store: each
prompt's full pages are fetched into the host tier and loaded). Each prompt runs alone, one
output token, greedy; TTFT is the wall time from `add_request` to the first token, of which
`prefetch_wait_ms` (a mean per chat) is the wait for storage reads. `redis` starts Debian's
redis-server on a free port in a temporary directory unless `--redis-url` names one. The OS
page cache is not dropped: the directory's pages are read from memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager

import torch

from radixrt import Engine, SamplingParams

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def histories(n: int, length: int, vocab: int) -> list[list[int]]:
    """`n` distinct token histories of `length` tokens (no shared prefix)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]


def ttfts(engine: Engine, prompts: list[list[int]]) -> list[float]:
    out = []
    for i, ids in enumerate(prompts):
        t = time.perf_counter()
        engine.add_request(ids, FIRST_TOKEN, rid=f"p{i}")
        while engine.core.has_work:
            engine.step()
        out.append(time.perf_counter() - t)
    engine.check_integrity()
    return out


@contextmanager
def redis_server(url: str | None):
    """`url`, or a throwaway redis-server's URL."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", ""]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(500):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model dir")
    p.add_argument("--stores", default="dir,redis")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--history", type=int, default=1024, help="tokens per chat history")
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        from radixrt.hf_dir.smollm2 import fetch_smollm2

        model = fetch_smollm2()
    elif args.model == "tiny":
        from radixrt.model.tiny import ensure_tiny_model

        model = ensure_tiny_model()
    else:
        model = args.model
    blocks = args.chats * (args.history // 16 + 2) + 8
    opts = dict(device="cpu", dtype="float32", cpu_threads=args.threads, block_size=16,
                num_kv_blocks=blocks, num_host_kv_blocks=blocks,
                kv_storage_prefetch_timeout_s=600.0)  # fmt: skip

    def run(**extra) -> tuple[list[float], dict]:
        engine = Engine(model, **opts, **extra)
        vocab = engine.core.model_config.vocab_size
        ttfts(engine, [list(range(100, 164))])  # warm-up: shares no page with the chats
        before = engine.stats()
        times = ttfts(engine, histories(args.chats, args.history, vocab))
        stats = engine.stats()
        stats["computed"] = stats["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        wait = stats["storage_prefetch_wait_seconds"] - before["storage_prefetch_wait_seconds"]
        stats["wait_ms"] = wait / args.chats * 1e3
        engine.shutdown()
        return times, stats

    rows = []
    for store in args.stores.split(","):
        with (
            tempfile.TemporaryDirectory() as tmp,
            redis_server(args.redis_url if store == "redis" else tmp) as spec,
        ):
            none, _ = run()
            cold, c = run(kv_storage=spec)
            warm, s = run(kv_storage=spec)
        med = {k: statistics.median(v) * 1e3 for k, v in (("none", none), ("cold", cold),
                                                        ("warm", warm))}  # fmt: skip
        rows.append(dict(store=store, history=args.history, chats=args.chats,
                         ttft_ms_none=round(med["none"], 1), ttft_ms_cold=round(med["cold"], 1),
                         ttft_ms_warm=round(med["warm"], 1),
                         warm_over_cold=round(med["warm"] / med["cold"], 3),
                         pages_read=s["storage_hits"],
                         mb_read=round(s["storage_read_bytes"] / 1e6, 1),
                         prefetch_wait_ms_cold=round(c["wait_ms"], 1),
                         prefetch_wait_ms_warm=round(s["wait_ms"], 1),
                         computed_tokens_cold=c["computed"],
                         computed_tokens_warm=s["computed"]))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
