"""Differential runs: one seeded mixed workload against a reference server and against servers
with features on; every greedy answer must be the same.

A workload (`make_workload`) mixes, over a few shared prefixes of different lengths, short and
long prompts: greedy rows (some streamed, some grammar-constrained), greedy and sampled n > 1
groups, beam searches and sampled rows, each with a fate: run to the end, aborted through
POST /abort after a random delay, or dropped by the client (the socket closed) after one.
`run_workload` sends it from a thread pool through the native /generate route (token ids in and
out, so no tokenizer round trip hides a difference). `compare` checks every greedy answer
(plain, each n > 1 child, grammar-constrained; beam searches' outputs too) against the
reference's: equal when it ran to the end, a prefix of it when it was aborted.
`check_balanced` asserts the KV accounting of an idle server.

The LoRA mix (`LORA_ADAPTERS`): the same workload spread over two PEFT adapters and the base
model (`lora_path` per request), about a third of the prompts repeating an earlier one under
another adapter, so that a prefix-cache entry reused across adapters would change an answer.
Its reference (`LORA_REFERENCE_ARGS`, driven one request at a time) has no prefix cache: each
answer is that of the request alone; the server under test mixes adapters in batches and in
the cache under KV pressure (`lora_config`).

Used by tests/test_differential_soak.py (CI, small) and benchmarks/soak_differential.py
(longer). A new feature adds a row to `CONFIGS`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# The reference: no host tier, no speculation, a pool with room to spare.
REFERENCE_ARGS = ["--num-kv-blocks", "1024", "--block-size", "8"]
# Feature rows: name -> serve args. Small pools, so that eviction, write-back and preemption
# happen all the time under the workload.
PRESSURE = ["--num-kv-blocks", "48", "--block-size", "4", "--max-running-requests", "12"]
HOST = ["--host-kv-gb", "0.001"]  # ~130 host blocks of 4 tokens: the host tier evicts too
NGRAM = ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]
CONFIGS: dict[str, list[str]] = {
    "host": PRESSURE + HOST,
    "ngram": PRESSURE + NGRAM,
    "host+ngram": PRESSURE + HOST + NGRAM,
}

# The LoRA mix: adapter names, and the reference (no prefix cache; run with concurrency 1).
LORA_ADAPTERS = ("la", "lb")
LORA_REFERENCE_ARGS = ["--prefix-cache", "none", "--num-kv-blocks", "1024", "--block-size", "8"]
LORA_SHARED_PROMPTS = 0.35  # of the LoRA mix's prompts: an earlier prompt, any adapter

GREEDY_KINDS = ("greedy", "stream", "grammar", "greedy_n", "beam")
KINDS = {  # kind -> weight in the mix
    "greedy": 5,
    "stream": 2,
    "grammar": 2,
    "greedy_n": 3,
    "sampled_n": 3,
    "beam": 3,
    "sampled": 1,
}
FATES = {"complete": 0.8, "abort": 0.1, "disconnect": 0.1}
REGEX = r"[a-z]{1,6}( [a-z]{1,6}){0,5}\."
VOCAB = (10, 2000)  # prompt token ids (the tiny model's vocabulary, specials left out)
TIMEOUT_S = 120.0


@dataclass
class Job:
    rid: str
    kind: str  # a key of KINDS
    fate: str  # a key of FATES
    delay_s: float  # abort / disconnect after this long
    body: dict[str, Any]  # the /generate body


@dataclass
class Answer:
    status: int
    outputs: list[list[int]] = field(default_factory=list)  # per sequence (n / beams)
    finished: bool = True  # False: aborted or dropped (outputs may be partial or empty)


def make_workload(
    seed: int, num_requests: int, max_tokens: int = 24, loras: tuple[str, ...] = ()
) -> list[Job]:
    """`num_requests` jobs of seed `seed`; with `loras`, spread over those adapters and the
    base model (the LoRA mix: the same jobs as without, adapters and repeated prompts drawn
    from a second stream)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(*VOCAB) for _ in range(n)] for n in (5, 12, 30, 60)]
    kinds, weights = zip(*KINDS.items())
    jobs = []
    for i in range(num_requests):
        prompt = rng.choice(prefixes) if rng.random() < 0.8 else []
        prompt = prompt + [rng.randrange(*VOCAB) for _ in range(rng.randint(1, 20))]
        kind = rng.choices(kinds, weights)[0]
        fate = rng.choices(list(FATES), list(FATES.values()))[0]
        sp: dict[str, Any] = {
            "max_new_tokens": rng.randint(1, max_tokens),
            "temperature": 0,
            "ignore_eos": rng.random() < 0.8,
        }
        if kind == "grammar":
            sp["regex"] = REGEX
        elif kind in ("greedy_n", "sampled_n"):
            sp["n"] = rng.randint(2, 4)
        elif kind == "beam":
            sp["beam_width"] = rng.randint(2, 3)
        if kind.startswith("sampled"):
            sp.update(temperature=0.9, seed=rng.randrange(1 << 30))
        body = {"input_ids": prompt, "sampling_params": sp, "stream": kind == "stream"}
        jobs.append(Job(f"d{seed}-{i}", kind, fate, rng.uniform(0.0, 0.3), body))
    if loras:
        lrng = random.Random(f"lora-{seed}")
        for i, job in enumerate(jobs):
            if i and lrng.random() < LORA_SHARED_PROMPTS:
                job.body["input_ids"] = list(lrng.choice(jobs[:i]).body["input_ids"])
            adapter = lrng.choice((None, *loras))
            if adapter is not None:
                job.body["lora_path"] = adapter
    return jobs


def make_lora_adapters(model_dir: str, out_dir: str) -> dict[str, str]:
    """The LoRA mix's adapters for the model in `model_dir`, made and saved by PEFT (random A
    and B of a size that moves greedy answers, every projection): name -> directory."""
    import peft
    import torch
    import transformers

    paths = {}
    for i, name in enumerate(LORA_ADAPTERS):
        torch.manual_seed(i)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = peft.LoraConfig(
            r=4 * (i + 1),
            lora_alpha=8,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            init_lora_weights=False,
            lora_dropout=0.0,
        )
        model = peft.get_peft_model(base, config)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 1.0 / max(p.shape) ** 0.5)
        paths[name] = os.path.join(out_dir, name)
        model.save_pretrained(paths[name])
    return paths


def lora_args(paths: dict[str, str]) -> list[str]:
    """Serve args that load the LoRA mix's adapters at start."""
    mods = [f"{name}={path}" for name, path in paths.items()]
    return ["--max-loras", str(len(paths)), "--lora-modules", *mods]


def lora_config(paths: dict[str, str]) -> list[str]:
    """The LoRA mix's server under test: adapters and the base model batched together, the
    radix cache and the host tier (both keyed per adapter) under KV pressure."""
    return PRESSURE + HOST + lora_args(paths)


def run_workload(url: str, jobs: list[Job], concurrency: int, fates: bool = True) -> dict:
    """rid -> Answer. With `fates=False` every job runs to the end (the reference)."""
    with ThreadPoolExecutor(concurrency) as pool:
        answers = pool.map(lambda job: _run_job(url, job, fates), jobs)
        return {job.rid: a for job, a in zip(jobs, answers)}


def _run_job(url: str, job: Job, fates: bool) -> Answer:
    body = {**job.body, "rid": job.rid}
    fate = job.fate if fates else "complete"
    if fate == "disconnect":
        _drop_after(url, body, job.delay_s)
        return Answer(0, finished=False)
    timer = None
    if fate == "abort":
        timer = threading.Timer(job.delay_s, _post, (url + "/abort", {"rid": job.rid}))
        timer.start()
    try:
        status, outputs, reasons = _generate(url, body)
    finally:
        if timer is not None:
            timer.cancel()
    # an aborted beam search answers no sequence; aborted rows end with reason "abort"
    finished = status == 200 and bool(outputs) and bool(reasons) and "abort" not in reasons
    assert fate == "abort" or finished, f"{job.rid}: {status} {outputs}"
    return Answer(status, outputs, finished)


def _generate(url: str, body: dict) -> tuple[int, list[list[int]], list[str]]:
    """(status, output ids per sequence, finish reasons) of one /generate call."""
    req = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            if not body["stream"]:
                out = json.loads(resp.read())
                outs = out if isinstance(out, list) else [out]
                reasons = [(o["meta_info"]["finish_reason"] or {}).get("type", "") for o in outs]
                return resp.status, [o["output_ids"] for o in outs], reasons
            ids: list[int] = []
            reasons = []
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids = event["output_ids"]  # SGLang's streams carry everything so far
                reason = event["meta_info"]["finish_reason"]
                reasons += [reason["type"]] if reason else []
            return resp.status, [ids], reasons
    except urllib.error.HTTPError as e:
        return e.code, [], [e.read().decode(errors="replace")]


def _drop_after(url: str, body: dict, delay_s: float) -> None:
    """Send the request on a raw socket and close it after `delay_s` (a client gone)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(head.encode() + data)
        time.sleep(delay_s)


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        resp.read()


@dataclass
class Comparison:
    num_compared: int = 0  # greedy sequences checked (whole or, when aborted, as a prefix)
    mismatches: list[str] = field(default_factory=list)


def compare(jobs: list[Job], reference: dict, answers: dict) -> Comparison:
    """Every greedy sequence of `answers` against `reference` (see the module docstring)."""
    c = Comparison()
    for job in jobs:
        if job.kind not in GREEDY_KINDS:
            continue
        want, got = reference[job.rid], answers[job.rid]
        assert want.status == 200 and want.finished, f"{job.rid}: reference failed: {want}"
        if job.kind == "greedy_n":  # every child is the greedy answer
            want_outputs = want.outputs[:1] * len(got.outputs)
        else:
            want_outputs = want.outputs
        if got.finished:
            assert len(got.outputs) == len(want_outputs), f"{job.rid}: {got} vs {want}"
        for k, (w, g) in enumerate(zip(want_outputs, got.outputs)):
            c.num_compared += 1
            ok = g == w if got.finished else g == w[: len(g)]
            if not ok:
                c.mismatches.append(f"{job.rid} ({job.kind}, seq {k}): {g} != {w}")
    return c


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def check_balanced(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until the server is idle; assert nothing is in flight, integrity holds and every
    device (and host) block is free or cached. Returns the scheduler snapshot."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = get_json(url + "/debug/state")
        snap = st["scheduler"]
        busy = st["in_flight"], snap["running"], snap["waiting"], snap["kv_blocks_in_use"]
        if not any(busy):
            break
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {st}"
        time.sleep(0.05)
    assert snap["integrity_error"] is None, snap["integrity_error"]
    assert snap["kv_blocks_free"] + snap["kv_blocks_cached"] == snap["kv_blocks_total"], snap
    if snap["host_kv_blocks_total"]:
        host = snap["host_kv_blocks_free"] + snap["host_kv_blocks_cached"]
        assert host == snap["host_kv_blocks_total"], snap
    assert st["in_flight_client_rids"] == 0, st
    return snap
