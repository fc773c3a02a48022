"""Train the tiny Llama on the shipped text: a short, deterministic CPU run.

Deterministic means: the same settings give the same weights, bit for bit, on the same torch
build and CPU kind. The run uses one thread (reduction order fixed), deterministic algorithms,
seeded generators for the initial weights and the batches, and a fixed number of steps (no
time limits). Both global torch settings are restored afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixrt.model import tiny_data


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What decides the trained weights (besides the data and the model shape)."""

    steps: int = 220
    batch_size: int = 8  # sequences per step
    seq_len: int = 256  # tokens per sequence (the demo's prompts fit)
    learning_rate: float = 3e-3  # peak; linear warmup, cosine decay to min_lr_ratio * peak
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # matrices only
    grad_clip: float = 1.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps], got {self.warmup_steps}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.learning_rate * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


class TrainResult(NamedTuple):
    final_loss: float  # mean train loss (nats/token) over the last 10% of steps
    num_tokens: int  # tokens in the training stream (one pass)
    seconds: float  # wall time of the optimisation loop
    cpu_seconds: float  # CPU time of this process in it (the wall time on an idle core)


def training_stream(encode, eos_id: int, seed: int) -> torch.Tensor:
    """All training documents as one token stream, each followed by `eos_id`.

    `encode(text) -> list[int]` must encode special tokens written in the text.
    Returns a [num_tokens] int64 cpu tensor.
    """
    ids: list[int] = []
    for document in tiny_data.training_documents(seed):
        ids += encode(document)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def train(
    model: torch.nn.Module,
    stream: torch.Tensor,
    settings: TrainSettings,
    *,
    seed: int,
    progress: bool = True,
) -> TrainResult:
    """Initialise `model` (an HF causal LM, float32, cpu) from `seed` and train it in place
    on random windows of `stream` ([num_tokens] int64). Shows a tqdm bar when `progress`."""
    from tqdm import tqdm

    if len(stream) <= settings.seq_len + 1:
        raise ValueError(f"training stream of {len(stream)} tokens is shorter than seq_len")
    with _deterministic_cpu(seed):
        generator = torch.Generator().manual_seed(seed)
        _init_weights(model, settings.init_std, generator)
        optimizer = _optimizer(model, settings)
        model.train()
        losses: list[float] = []
        start, cpu_start = time.perf_counter(), time.process_time()
        bar = tqdm(range(settings.steps), desc="training tiny model", disable=not progress)
        for step, batch in zip(bar, _batches(stream, settings, generator)):
            for group in optimizer.param_groups:
                group["lr"] = settings.lr_at(step)
            logits = model(input_ids=batch[:, :-1]).logits  # [batch, seq_len, vocab]
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step % 10 == 0 or step == settings.steps - 1:
                bar.set_postfix(loss=f"{loss.item():.3f}")
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        bar.close()
        model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return TrainResult(sum(tail) / len(tail), len(stream), seconds, cpu_seconds)


@contextlib.contextmanager
def _deterministic_cpu(seed: int) -> Iterator[None]:
    """One thread, deterministic algorithms and the global RNG seeded with `seed` (for
    anything random inside HF code) inside; the previous settings and RNG state afterwards."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def _batches(
    stream: torch.Tensor, settings: TrainSettings, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len + 1] windows of `stream` at random offsets."""
    span = settings.seq_len + 1
    offsets = torch.arange(span)
    while True:
        starts = torch.randint(
            0, len(stream) - span + 1, (settings.batch_size, 1), generator=generator
        )
        yield stream[starts + offsets]


def _init_weights(model: torch.nn.Module, std: float, generator: torch.Generator) -> None:
    """GPT-2 style init from `generator`: matrices and embeddings N(0, std^2), the
    projections that write into the residual stream scaled by 1/sqrt(2 * num_layers),
    RMSNorm weights 1."""
    num_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            scale = (
                std / math.sqrt(2 * num_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            param.copy_(scale * torch.randn(param.shape, generator=generator))


def _optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": settings.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=settings.learning_rate, betas=(0.9, 0.95))
