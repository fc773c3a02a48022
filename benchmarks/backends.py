"""Where bench_serving's runs execute: an in-process engine or a fresh `radixrt serve`.

Both are context managers with `run(workload, on_call_done) -> DriverResult`."""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable

from benchmarks.metrics import DriverResult
from benchmarks.workloads import Workload, make_workload


def engine_options(args: argparse.Namespace, cache: str, policy: str, kv: int | None) -> dict:
    opts = {
        "device": args.device,
        "dtype": args.dtype,
        "prefix_cache": "radix" if cache == "radix-host" else cache,
        "policy": policy,
        "block_size": args.block_size,
        "num_kv_blocks": kv,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_running_requests": args.max_running_requests,
        "load_format": args.load_format,
    }
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        opts["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "quantization", None) is not None:
        opts["quantization"] = args.quantization
        opts["fp8_activation_scale"] = args.fp8_activation_scale
    if cache == "radix-host":  # the host KV tier config of bench_serving
        opts["host_kv_gb"] = getattr(args, "host_kv_gb", 1.0)
    if getattr(args, "retention_max_share", None) is not None:
        opts["retention_max_share"] = args.retention_max_share
    if args.aging_tokens_per_step is not None:
        opts["aging_tokens_per_step"] = args.aging_tokens_per_step
    if args.disable_cuda_graph:
        opts["enable_cuda_graph"] = False
    if args.disable_overlap_schedule:
        opts["overlap_schedule"] = False
    if args.threads and args.device in ("cpu", "auto"):
        opts["cpu_threads"] = args.threads
    return opts


class EngineBackend:
    """One in-process engine for a block of runs (a context manager); each run starts with
    an empty prefix cache. Leaving releases the engine's memory."""

    def __init__(self, args: argparse.Namespace, model: str, opts: dict) -> None:
        self.model = model
        self.opts = {**opts, "freeze_gc": True}  # as the server's scheduler process does
        self.kw = driver_kwargs(args)
        self.engine = None

    def __enter__(self) -> EngineBackend:
        from radixrt.engine import Engine

        self.engine = Engine(self.model, **self.opts)
        self.run(warmup_workload(self.engine.model_config.vocab_size), lambda: None)
        return self

    def run(
        self, workload: Workload, on_done: Callable[[], None], cache_ttl_s: float = 0.0
    ) -> DriverResult:
        from benchmarks.engine_driver import run_engine

        result = run_engine(
            self.engine, workload, on_call_done=on_done, cache_ttl_s=cache_ttl_s, **self.kw
        )
        self.engine.cache.reset()
        assert self.engine.allocator.num_used == 0, "blocks in use after resetting the cache"
        return result

    def __exit__(self, *exc: object) -> None:
        self.engine.shutdown()
        self.engine = None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class ServerBackend:
    """A fresh `radixrt serve` per run, warmed up with a few requests first."""

    def __init__(self, args: argparse.Namespace, model: str, opts: dict) -> None:
        self.model = model
        self.kw = driver_kwargs(args)
        self.log = os.path.join(args.out, f"{args.tag}-server.log")
        self.startup_timeout_s = args.server_startup_timeout_s
        self.serve_args = []
        for key, value in opts.items():
            if key in ("enable_cuda_graph", "overlap_schedule"):  # only ever set to False
                self.serve_args.append("--disable-" + key.removeprefix("enable_").replace("_", "-"))
            elif value is not None:
                self.serve_args += ["--" + key.replace("_", "-"), str(value)]

    def __enter__(self) -> ServerBackend:
        return self

    def run(
        self, workload: Workload, on_done: Callable[[], None], cache_ttl_s: float = 0.0
    ) -> DriverResult:
        from benchmarks.http_driver import ServerProcess, run_server

        assert cache_ttl_s == 0, "retention hints run on the in-process engine only"
        with ServerProcess(self.model, self.serve_args, self.log, self.startup_timeout_s) as srv:
            run_server(srv.url, warmup_workload(workload.params["vocab_size"]))
            return run_server(srv.url, workload, on_call_done=on_done, **self.kw)

    def __exit__(self, *exc: object) -> None:
        pass


def driver_kwargs(args: argparse.Namespace) -> dict:
    return {
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "seed": args.seed,
        "timeout_s": args.run_timeout_s,
    }


def warmup_workload(vocab_size: int) -> Workload:
    return make_workload("random", "smoke", 4 / 32, seed=12345, vocab_size=vocab_size,
                         input_len=32, output_len=4)  # fmt: skip
