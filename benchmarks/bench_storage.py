"""The storage KV tier across a restart: first-turn TTFT of chats whose histories a previous
engine stored (warm) against a run that computes them (cold), per backend.

    python -m benchmarks.bench_storage --model smollm2 --stores dir,redis --history 1024
    python -m benchmarks.bench_storage --model llama-3-8b-32k --stores dir \
        --history 4096,16384,32000 --chats 3 --drop-page-cache --policies auto,always --disk-gib 8

For each store and history length, in one process and one engine at a time: `none` (no storage
tier: the recompute baseline), `cold` (an empty store: every prompt computed and written
through; the engine then shuts down, finishing its writes) and one `warm` run per load policy (a
new engine on the same store; `always` fetches each prompt's full pages into the host tier and
loads them, `auto` lets the cost model choose load or recompute). Each prompt runs alone, one
output token, greedy; TTFT is the wall time from `add_request` to the first token, of which
`prefetch_wait_ms` (a mean per chat) is the wait for storage reads. A preset name (`llama-3-8b`,
...) builds that shape with random weights (on CUDA: bf16, FlashInfer, no CUDA graphs, which a
one-token TTFT does not use). `--drop-page-cache` evicts the directory store's files from the OS
page cache before each warm run, so the disk is read; otherwise they come from memory.
`--disk-gib` adds the disk's own sequential write and read rates under the store. `redis`
starts Debian's redis-server on a free port in a temporary directory unless `--redis-url` names
one.
"""

from __future__ import annotations

import argparse
import json
import os
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


def drop_page_cache(root: str) -> None:
    """Make the next read of every file under `root` come from the disk: flush, then ask the
    kernel to drop their cached pages (no root needed, unlike /proc/sys/vm/drop_caches)."""
    os.sync()
    for dirpath, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bandwidth(root: str, gib: float) -> dict[str, float]:
    """Sequential write (fsync'd) and read (page cache dropped) of one `gib` GiB file in
    `root`, in GB/s: what the disk under the store gives a plain reader, 16 MiB at a time."""
    path = os.path.join(root, "bandwidth.bin")
    chunk = os.urandom(16 << 20)
    n = max(1, int(gib * 64))
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(n):
            f.write(chunk)
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    drop_page_cache(root)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    read_s = time.perf_counter() - t
    os.remove(path)
    size = n * len(chunk)
    return dict(disk_write_gbps=round(size / write_s / 1e9, 2),
                disk_read_gbps=round(size / read_s / 1e9, 2))  # fmt: skip


def engine_options(args) -> tuple[str, dict]:
    """The model path and the Engine options of `--model` on `--device`."""
    from radixrt.model.presets import PRESETS, write_dummy_model_dir

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    opts: dict = dict(device=device, block_size=16)
    if device == "cpu":
        opts.update(dtype="float32", cpu_threads=args.threads)
    else:
        opts.update(dtype="bfloat16", attention_backend="flashinfer", enable_cuda_graph=False)
    if args.model == "smollm2":
        from radixrt.hf_dir.smollm2 import fetch_smollm2

        return fetch_smollm2(), opts
    if args.model == "tiny":
        from radixrt.model.tiny import ensure_tiny_model

        return ensure_tiny_model(), opts
    if args.model in PRESETS:  # real shapes, random weights
        opts["load_format"] = "dummy"
        return write_dummy_model_dir(os.path.join(tempfile.mkdtemp(), args.model), args.model), opts
    return args.model, opts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2, tiny, a preset (random weights: llama-3-8b, ...) or a model dir",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--stores", default="dir,redis")
    p.add_argument("--redis-url", default=None)
    p.add_argument(
        "--store-dir",
        default=None,
        help="where directory stores go (default: a temporary directory)",
    )
    p.add_argument(
        "--history", default="1024", help="tokens per chat history; a comma list runs each"
    )
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="before each warm run, drop the store's files from the OS page cache, "
        "so the disk is read (directory stores)",
    )
    p.add_argument(
        "--policies",
        default="auto",
        help="kv_storage_load_policy of the warm runs (comma list: auto, always)",
    )
    p.add_argument(
        "--disk-gib",
        type=float,
        default=0.0,
        help="also measure the disk under the directory store with a file this big",
    )
    args = p.parse_args(argv)  # fmt: skip
    torch.set_num_threads(args.threads)
    model, base = engine_options(args)
    policies = args.policies.split(",")

    def run(history: int, **extra) -> tuple[list[float], dict]:
        blocks = args.chats * (history // 16 + 2) + 8
        engine = Engine(model, **base, num_kv_blocks=blocks, num_host_kv_blocks=blocks,
                        kv_storage_write_pages=blocks, kv_storage_prefetch_timeout_s=600.0,
                        max_model_len=history + 64, **extra)  # fmt: skip
        vocab = engine.core.model_config.vocab_size
        ttfts(engine, [list(range(100, 164))])  # warm-up: shares no page with the chats
        before = engine.stats()
        times = ttfts(engine, histories(args.chats, history, vocab))
        stats = engine.stats()
        for k in ("prompt_tokens_computed", "storage_prefetch_wait_seconds",
                  "storage_recomputes_chosen", "storage_loads_chosen"):  # fmt: skip
            stats[k] = stats.get(k, 0) - before.get(k, 0)
        stats["wait_ms"] = stats["storage_prefetch_wait_seconds"] / args.chats * 1e3
        engine.shutdown()
        return times, stats

    def ms(times: list[float]) -> float:
        return round(statistics.median(times) * 1e3, 1)

    for store in args.stores.split(","):
        for history in [int(h) for h in args.history.split(",")]:
            with (
                tempfile.TemporaryDirectory(dir=args.store_dir) as tmp,
                redis_server(args.redis_url if store == "redis" else tmp) as spec,
            ):
                none, _ = run(history)
                cold, c = run(history, kv_storage=spec)
                row = dict(store=store, device=base["device"], model=args.model,
                           history=history, chats=args.chats, ttft_ms_none=ms(none),
                           ttft_ms_cold=ms(cold), prefetch_wait_ms_cold=round(c["wait_ms"], 1),
                           computed_tokens_cold=c["prompt_tokens_computed"],
                           write_drops_cold=c.get("storage_write_drops", 0))  # fmt: skip
                for policy in policies:
                    if store == "dir" and args.drop_page_cache:
                        drop_page_cache(tmp)
                    warm, s = run(history, kv_storage=spec, kv_storage_load_policy=policy)
                    row.update(
                        {
                            f"ttft_ms_warm_{policy}": ms(warm),
                            f"warm_{policy}_over_cold": round(ms(warm) / ms(cold), 3),
                            f"pages_read_{policy}": s["storage_hits"],
                            f"loads_{policy}": s["storage_loads_chosen"],
                            f"recomputes_{policy}": s["storage_recomputes_chosen"],
                            f"prefetch_wait_ms_{policy}": round(s["wait_ms"], 1),
                            f"computed_tokens_{policy}": s["prompt_tokens_computed"],
                        }
                    )
                    bw = s["storage_read_bytes"] / max(s["storage_prefetch_wait_seconds"], 1e-9)
                    row[f"read_gbps_while_waiting_{policy}"] = round(bw / 1e9, 2)
                if store == "dir" and args.disk_gib > 0:
                    row.update(disk_bandwidth(tmp, args.disk_gib))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
