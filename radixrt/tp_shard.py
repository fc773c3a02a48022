"""Which part of each weight a tensor-parallel rank holds (plain arithmetic, no torch).

Column-parallel (split along the output features): q/k/v (whole heads), gate/up, the
embedding and lm_head (vocabulary rows). Row-parallel (split along the input features, one
all-reduce after): o_proj, down_proj. KV heads are split when `num_kv_heads % tp == 0` and
replicated otherwise (then `tp % num_kv_heads == 0` and each rank holds the one KV head its
query heads use). The vocabulary is padded to a multiple of tp; rank r holds rows
[r * vocab_per_rank, (r + 1) * vocab_per_rank), of which those >= vocab_size are zero padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.config import ModelConfig

# HF tensor kind (the module name before ".weight"/".bias") -> dim of the checkpoint tensor
# that is split across ranks. Kinds not listed (norms) are replicated.
SPLIT_DIM = {
    "q_proj": 0,
    "k_proj": 0,
    "v_proj": 0,
    "gate_proj": 0,
    "up_proj": 0,
    "embed_tokens": 0,
    "lm_head": 0,
    "o_proj": 1,
    "down_proj": 1,
}


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: its local dimensions and the checkpoint ranges it reads."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int  # first (global) KV head this rank holds
    head_dim: int
    intermediate_size: int  # MLP features on this rank
    vocab_size: int  # the model's (unpadded) vocabulary
    vocab_per_rank: int  # embedding / lm_head rows on this rank (padded)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> TPShard:
        """The shard of `rank`; raises ValueError when the model cannot be split `size` ways."""
        check_divisible(cfg, size)
        assert 0 <= rank < size
        if cfg.num_kv_heads % size == 0:
            kv_local = cfg.num_kv_heads // size
            kv_start = rank * kv_local
        else:  # replicated: ranks [j * size / hkv, (j + 1) * size / hkv) share KV head j
            kv_local = 1
            kv_start = rank // (size // cfg.num_kv_heads)
        return cls(
            rank=rank,
            size=size,
            num_heads=cfg.num_heads // size,
            num_kv_heads=kv_local,
            kv_head_start=kv_start,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size // size,
            vocab_size=cfg.vocab_size,
            vocab_per_rank=-(-cfg.vocab_size // size),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        """One past the last real (not padding) vocabulary row on this rank."""
        return min(self.vocab_size, self.vocab_start + self.vocab_per_rank)

    def checkpoint_range(self, kind: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the checkpoint tensor of HF kind `kind` (e.g. "q_proj")
        this rank reads, or None when it reads the whole tensor (replicated)."""
        dim = SPLIT_DIM.get(kind)
        if dim is None:
            return None
        if kind == "q_proj":
            start, n = self.rank * self.q_size, self.q_size
        elif kind in ("k_proj", "v_proj"):
            start, n = self.kv_head_start * self.head_dim, self.kv_size
        elif kind in ("gate_proj", "up_proj", "down_proj"):
            start, n = self.rank * self.intermediate_size, self.intermediate_size
        elif kind == "o_proj":
            start, n = self.rank * self.q_size, self.q_size
        else:  # embed_tokens, lm_head: the real rows only (padding stays zero)
            return dim, self.vocab_start, self.vocab_end
        return dim, start, start + n


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError unless the model splits evenly over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {cfg.num_heads} "
            f"attention heads; use a divisor of {cfg.num_heads}"
        )
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {cfg.num_kv_heads} KV heads: one "
            "must divide the other (KV heads are split, or replicated when fewer than ranks)"
        )
    if cfg.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide intermediate_size {cfg.intermediate_size}"
        )


def check_devices(device: str, size: int, num_cuda_devices: int) -> None:
    """Raise ValueError unless `size` ranks fit on the devices present (CUDA: rank r on
    cuda:(index + r), index from `device`, default 0)."""
    if not device.startswith("cuda"):
        return
    base = int(device.split(":")[1]) if ":" in device else 0
    if base + size > num_cuda_devices:
        raise ValueError(
            f"tensor_parallel_size {size} on {device} needs CUDA devices "
            f"{base}..{base + size - 1}, but {num_cuda_devices} are visible"
        )
