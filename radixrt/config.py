"""Frozen configuration for the model, the KV cache, the scheduler and the server.

"auto" values are resolved by the code that builds a config (see `Engine`), never by
mutating a config afterwards.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from radixrt.options import option
from radixrt.quantization import (
    FP8_ACTIVATION_SCALES,
    QUANTIZATIONS,
    Fp8Scheme,
    checkpoint_scheme,
)
from radixrt.sampling import MAX_CACHE_TTL_S

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
PREFIX_CACHES = ("radix", "blockhash", "none")
POLICIES = ("fcfs", "lpm", "dfs-weight", "random")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model's dtype
SPECULATIVE_METHODS = ("none", "ngram", "radix", "draft")
# kv_storage_load_policy: the cost model decides (radixrt.cache.storage_cost), or always / never
LOAD_POLICIES = ("auto", "always", "never")
MAX_NGRAM = 64  # longest n-gram the prompt-lookup proposer may match
ROPE_SCALING_TYPES = ("default", "linear", "llama3")  # what model.layers.rope_inv_freq computes
HIDDEN_ACTS = ("silu", "swish")  # the MLP's activation (one function, two names)
MODELOPT_CONFIG_FILE = "hf_quant_config.json"  # ModelOpt's quantization config (legacy)
DECODE_ATTENTION_KERNELS = ("auto", "fa2", "xqa")  # radixrt.attention.flashinfer_backend
XQA_BLOCK_SIZES = (16, 32, 64, 128)  # block sizes FlashInfer's XQA decode kernel is built for
MAX_LORA_RANK = 512  # max_lora_rank at most


def holds_back_shared_prefixes(policy: str, prefix_cache: str) -> bool:
    """Whether the scheduler (radixrt.scheduler.admission) holds back a request whose uncached
    prefix a running request computes until that prefix is cached, so it is computed once:
    under the cache-aware policies (all but "fcfs"), with a prefix cache to keep it (without
    one, waiting would gain nothing). Clients read it to send a fork's branches at once."""
    return policy != "fcfs" and prefix_cache != "none"


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, read from an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # a sliding attention window in force (Mistral's `sliding_window`, Qwen2's with
    # `use_sliding_window`): every layer here attends the whole context, so the served
    # context length may not exceed it (`limits.resolve_max_model_len`); None: no window
    sliding_window: int | None = None
    # the checkpoint's FP8 weights (its `quantization_config`, or ModelOpt's
    # hf_quant_config.json); None: 16/32-bit weights (radixrt.quantization)
    checkpoint_fp8: Fp8Scheme | None = None

    def stop_token_ids(self, tokenizer_eos_id: int | None) -> list[int]:
        """The ids that end a generation: the checkpoint config's EOS ids and the tokenizer's
        (what the Engine and the server's scheduler stop on)."""
        eos = set(self.eos_token_ids)
        if tokenizer_eos_id is not None:
            eos.add(tokenizer_eos_id)
        return sorted(eos)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if self.rope_scaling and (kind or "default") not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"rope_scaling type {kind!r} is not implemented; supported: "
                f"{', '.join(ROPE_SCALING_TYPES)}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        refuse_unimplemented(cfg, arch)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers >= 5 nests rope settings under "rope_parameters".
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window_in_force(cfg),
            checkpoint_fp8=checkpoint_scheme(cfg.get("quantization_config")),
        )

    @classmethod
    def from_pretrained(cls, model_path: str) -> ModelConfig:
        """config.json of an HF dir; a ModelOpt `hf_quant_config.json` beside it stands for
        a missing `quantization_config`. Raises ValueError for an unsupported one."""
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in {model_path!r}: expected an HF model dir")
        with open(path) as f:
            cfg = json.load(f)
        modelopt = os.path.join(model_path, MODELOPT_CONFIG_FILE)
        if cfg.get("quantization_config") is None and os.path.isfile(modelopt):
            with open(modelopt) as f:
                cfg["quantization_config"] = {"quant_method": "modelopt", **json.load(f)}
        return cls.from_hf_dict(cfg)


def refuse_unimplemented(cfg: dict[str, Any], arch: str) -> None:
    """Raise ValueError naming the config.json field when `cfg` asks for something the model
    code does not compute (the checkpoint would load and answer wrongly): another MLP
    activation, biases beyond Qwen2's q/k/v ones, partial rotary, logit soft-capping. Rope
    scaling types are checked by ModelConfig itself; a sliding window is honoured by limiting
    the context (`window_in_force`)."""
    act = cfg.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"config.json: hidden_act={act!r} is not implemented; supported: silu")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true (biases on the MLP) is not implemented")
    if cfg.get("attention_bias") and arch != "Qwen2ForCausalLM":
        raise ValueError(
            f"config.json: attention_bias=true for {arch} (biases on q/k/v and o_proj) is not "
            "implemented; only Qwen2's q/k/v biases are"
        )
    factor = cfg.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ValueError(
            f"config.json: partial_rotary_factor={factor} is not implemented (rotary over "
            "the whole head only)"
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            raise ValueError(f"config.json: {name}={cfg[name]} is not implemented")


def window_in_force(cfg: dict[str, Any]) -> int | None:
    """The sliding attention window a config.json applies to some layer, or None: Mistral's
    `sliding_window` whenever set; with Qwen2/Qwen3's `use_sliding_window` only when true and
    some layer is at or past `max_window_layers`; with `layer_types` (transformers >= 4.54)
    only when a layer is "sliding_attention"."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if "layer_types" in cfg and cfg["layer_types"] is not None:
        return window if "sliding_attention" in cfg["layer_types"] else None
    if "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return None
        first = cfg.get("max_window_layers", 0)
        return window if cfg["num_hidden_layers"] > first else None
    return window


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV memory and the prefix cache over it."""

    block_size: int = option(16, "tokens per KV block (a power of two)")
    num_kv_blocks: int | None = option(
        None,
        "KV pool size",
        doc_default="from `mem_fraction` (CUDA) or `cpu_kv_blocks` (CPU)",
    )
    mem_fraction: float = option(
        0.85, "of the free device memory after the weights, for the KV pool (CUDA)"
    )
    cpu_kv_blocks: int = option(4096, "KV pool size on a CPU without `num_kv_blocks`", cli=False)
    prefix_cache: str = option(
        "radix",
        "`radix`, `blockhash` (vLLM automatic prefix caching semantics), `none`",
        choices=PREFIX_CACHES,
    )
    # "auto" is a mode, not a value to resolve: it never means fp8
    kv_cache_dtype: str = option(
        "auto",
        "`auto` (the model dtype) or `fp8_e4m3` (per-layer K/V scales from the checkpoint, "
        "else 1.0; twice the tokens per byte; FlashInfer needs compute capability >= 8.9)",
        choices=KV_CACHE_DTYPES,
    )
    host_kv_gb: float = option(
        0.0,
        "host KV tier (radix cache only): GiB of host memory (pinned on CUDA) for evicted "
        "blocks; 0: off",
    )
    num_host_kv_blocks: int | None = option(
        None, "host tier size in blocks (overrides `host_kv_gb`)", cli=False
    )
    kv_storage: str | None = option(
        None,
        "storage KV tier (needs the host tier): a directory, or a Redis URL "
        "(`redis://host:port/db`, `rediss://`, `unix://`) that replicas may share, keeping KV "
        "pages beyond the process (written through as prefixes are cached, read back on an "
        "L1/L2 miss)",
    )
    kv_storage_max_gb: float = option(
        64.0,
        "size bound of a `kv_storage` directory in GiB (least recently used pages go; a Redis "
        "server bounds itself with `maxmemory`)",
    )
    kv_storage_write_pages: int = option(
        256,
        "pages of pinned staging memory for storage writes; a write finding them busy is "
        "dropped (counted)",
    )
    kv_storage_prefetch_timeout_s: float = option(
        2.0, "how long a request waits for its prefix pages from storage before it computes"
    )
    kv_storage_load_policy: str = option(
        "auto",
        "whether a prefix missing GPU and host memory is read from storage: `auto` (when the "
        "measured read is faster than the measured prefill it replaces), `always`, `never`",
        choices=LOAD_POLICIES,
    )
    kv_events: bool = option(
        False,
        "record KV cache events (radix cache only); the server publishes them in vLLM's format",
        cli=False,
        doc_flag="`--kv-events-endpoint` (serve)",
    )
    kv_events_hash_seed: str | None = option(
        None,
        "the seed of vLLM's `NONE_HASH`, block 0's parent hash (routers that hash tokens "
        "need the same)",
        doc_default="`$PYTHONHASHSEED`, else random",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(
                f"prefix_cache must be one of {PREFIX_CACHES}, got {self.prefix_cache!r}"
            )
        if not self.host_kv_gb >= 0:
            raise ValueError(f"host_kv_gb must be >= 0 (0: no host tier), got {self.host_kv_gb}")
        if self.num_host_kv_blocks is not None and self.num_host_kv_blocks < 1:
            raise ValueError(f"num_host_kv_blocks must be >= 1, got {self.num_host_kv_blocks}")
        if self.kv_events and self.prefix_cache != "radix":
            raise ValueError(f"kv_events need prefix_cache 'radix', got {self.prefix_cache!r}")
        if self.kv_storage is not None and not self.host_tier:
            raise ValueError(
                "kv_storage needs the host KV tier (host_kv_gb > 0): pages move through it"
            )
        if self.kv_storage is not None and not self.kv_storage.strip():
            raise ValueError("kv_storage must name a directory or a redis:// URL, got ''")
        if not self.kv_storage_max_gb > 0:
            raise ValueError(f"kv_storage_max_gb must be > 0, got {self.kv_storage_max_gb}")
        if self.kv_storage_write_pages < 1:
            raise ValueError(
                f"kv_storage_write_pages must be >= 1, got {self.kv_storage_write_pages}"
            )
        if not self.kv_storage_prefetch_timeout_s >= 0:
            raise ValueError(
                "kv_storage_prefetch_timeout_s must be >= 0, got "
                f"{self.kv_storage_prefetch_timeout_s}"
            )
        if self.kv_storage_load_policy not in LOAD_POLICIES:
            raise ValueError(
                f"kv_storage_load_policy must be one of {', '.join(LOAD_POLICIES)}, got "
                f"{self.kv_storage_load_policy!r}"
            )
        if self.host_tier and self.prefix_cache != "radix":
            raise ValueError(
                "a host KV tier (host_kv_gb > 0 or num_host_kv_blocks) needs prefix_cache "
                f"'radix', got {self.prefix_cache!r}"
            )

    @property
    def host_tier(self) -> bool:
        """Whether a host KV tier is configured."""
        return self.host_kv_gb > 0 or self.num_host_kv_blocks is not None

    @property
    def kv_fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8_e4m3"


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and the waiting-queue policy."""

    max_num_batched_tokens: int = option(8192, "tokens (prefill + decode) in one forward")
    max_running_requests: int = option(256, "running requests (runner slots)")
    long_prefill_token_threshold: int = option(0, "cap on one request's prefill chunk; 0: none")
    # resolve_config picks "auto"; a config built directly gets fcfs
    policy: str = option(
        "fcfs",
        "`lpm`, `dfs-weight`, `fcfs`, `random`; auto: lpm with the radix cache, else fcfs",
        choices=POLICIES,
        auto=True,
    )
    # a request with no cache hit overtakes every newer one after max_prompt_len / this steps
    aging_tokens_per_step: float = option(
        4.0, "lpm / dfs-weight: each waited step counts as this many matched tokens", cli=False
    )
    priority_aging_steps: int = option(
        256,
        "each this many waited steps make a request one priority level more urgent; 0: no aging",
        cli=False,
    )
    # the starvation bound under a flood of the most urgent priority: RESULTS.md, "Tenants"
    priority_max_wait_s: float = option(
        10.0,
        "a request waiting this long goes ahead of every priority level (the overdue in "
        "arrival order); 0: no bound",
    )
    # the held share's trade-off: RESULTS.md, "Program suite"
    retention_max_share: float = option(
        0.8,
        "share of the KV pool retention hints (`cache_ttl_s`) may hold (a running request "
        "that needs more blocks takes holds, youngest first)",
    )
    # what one tenant's holds leave the others: RESULTS.md, "Tenants"
    retention_max_tenant_share: float = option(
        0.25,
        "share of the KV pool one tenant's holds may keep, over all its cache salts (a keys "
        "file's `retention_share=` sets it per tenant); without API keys there is one tenant, "
        "bounded by `retention_max_share` only",
    )
    retention_max_ttl_s: float = option(600.0, "a retention hint's time to live at most")
    num_speculative_tokens: int = option(4, "drafts per decode row, 1..16")
    # a step with verify rows waits for its result on the host (RESULTS.md, "Speculative")
    speculative_min_gain: float = option(
        0.3,
        "a step verifies drafts only when the accepted drafts it expects (each row's recent "
        "accepted drafts per verify) reach this many per decode row: a step with verify rows "
        "cannot overlap with the next; 0: every drafted row verifies",
    )

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 means no cap)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.aging_tokens_per_step < 0:
            raise ValueError("aging_tokens_per_step must be >= 0")
        if not 0 <= self.retention_max_share <= 1:
            raise ValueError(
                f"retention_max_share must be in [0, 1], got {self.retention_max_share}"
            )
        if not 0 <= self.retention_max_tenant_share <= 1:
            raise ValueError(
                "retention_max_tenant_share must be in [0, 1], "
                f"got {self.retention_max_tenant_share}"
            )
        if not 0 <= self.retention_max_ttl_s <= MAX_CACHE_TTL_S:
            raise ValueError(
                f"retention_max_ttl_s must be in [0, {MAX_CACHE_TTL_S}], "
                f"got {self.retention_max_ttl_s}"
            )
        if not self.priority_max_wait_s >= 0:
            raise ValueError(
                f"priority_max_wait_s must be >= 0 (0: no bound), got {self.priority_max_wait_s}"
            )
        if self.priority_aging_steps < 0:
            raise ValueError(
                f"priority_aging_steps must be >= 0 (0: no aging), got {self.priority_aging_steps}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if not 0 <= self.speculative_min_gain <= 16:
            raise ValueError(
                f"speculative_min_gain must be in [0, 16], got {self.speculative_min_gain}"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who drafts (the scheduler's `num_speculative_tokens` caps how
    many tokens per decode row). `ngram`: prompt lookup over the row's own tokens; `radix`:
    the continuation the radix prefix cache holds after the row's context; `draft`: a smaller
    checkpoint with the target's tokenizer, run by the runner (see `radixrt.executor.draft`)."""

    speculative_method: str = option(
        "none",
        "`ngram` (prompt lookup), `radix` (the radix tree's continuation; needs "
        '`prefix_cache="radix"`), `draft` (a draft model: needs `speculative_draft_model`)',
        choices=SPECULATIVE_METHODS,
    )
    ngram_min_n: int = option(2, "ngram: shortest suffix matched")
    ngram_max_n: int = option(4, "ngram: longest suffix matched (the longest match wins)")
    speculative_draft_model: str | None = option(
        None, "draft: HF dir of a smaller checkpoint with the target's tokenizer"
    )

    def __post_init__(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        if not 1 <= self.ngram_min_n <= self.ngram_max_n <= MAX_NGRAM:
            raise ValueError(
                f"need 1 <= ngram_min_n <= ngram_max_n <= {MAX_NGRAM}, got "
                f"ngram_min_n={self.ngram_min_n}, ngram_max_n={self.ngram_max_n}"
            )
        has_draft = self.speculative_draft_model is not None
        if (self.speculative_method == "draft") != has_draft:
            raise ValueError(
                "speculative_draft_model must be given exactly when speculative_method is "
                f"'draft' (got speculative_method={self.speculative_method!r}, "
                f"speculative_draft_model={self.speculative_draft_model!r})"
            )

    @property
    def enabled(self) -> bool:
        return self.speculative_method != "none"


@dataclass(frozen=True)
class GrammarConfig:
    """Structured output (radixrt.grammar): compiling constraints and jump-forward."""

    jump_forward: bool = option(
        True,
        "structured output: append tokens the grammar forces without sampling them "
        "(output-identical)",
        flags=("--disable-jump-forward",),
    )
    # the model might have picked other tokens for a forced string
    jump_forward_retokenize: bool = option(
        False,
        "also append forced strings as the model's tokenizer writes them (fewer steps, not "
        "output-identical); always on for structural tags (tool calls)",
    )
    grammar_compile_timeout_s: float = option(
        30.0,
        "compile time a grammar may take in all (waiting for a worker does not count); the "
        "compile is then killed and the request gets a 400",
    )
    grammar_compile_workers: int = option(
        2,
        "grammar compiles at once, each in a worker process (killed and replaced on timeout; "
        "a waiting grammar preempts the longest-running compile after 1 s)",
    )
    grammar_mask_threads: int = option(4, "threads filling a step's token bitmasks", cli=False)
    grammar_cache_bytes: int = option(
        256 * 2**20,
        "compiled grammars kept, least recently used dropped first (xgrammar's reported size)",
        flags=("--grammar-cache-mb",),
        unit=("MiB", 2**20),
    )

    def __post_init__(self) -> None:
        t = self.grammar_compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"grammar_compile_timeout_s must be a number > 0, got {t!r}")
        n = self.grammar_compile_workers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
            raise ValueError(f"grammar_compile_workers must be an integer in 1..64, got {n!r}")
        n = self.grammar_cache_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"grammar_cache_bytes must be an integer >= 0, got {n!r}")
        n = self.grammar_mask_threads
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
            raise ValueError(f"grammar_mask_threads must be an integer in 1..64, got {n!r}")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (radixrt.lora): how many a batch may mix, their largest rank, how many
    stay loaded in host memory, and those loaded at start."""

    max_loras: int = option(
        0,
        "LoRA adapter slots on the device: distinct adapters one batch may mix; 0: LoRA off",
        flags=("--max-loras", "--max-loras-per-batch"),
    )
    max_lora_rank: int = option(16, "largest adapter rank accepted (slots are this wide)")
    max_cpu_loras: int | None = option(
        None,
        "adapters whose weights stay in host memory, least recently used dropped first (read "
        "again from their directory when next used)",
        doc_default="max_loras",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "adapters loaded at start, each `name=path` (a PEFT directory); needs max_loras > 0",
        flags=("--lora-modules", "--lora-paths"),
        doc_default="none",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        for name in ("max_loras", "max_lora_rank"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {n!r}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be in 1..{MAX_LORA_RANK}, got {self.max_lora_rank}"
            )
        n = self.max_cpu_loras
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < self.max_loras):
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {n!r}"
            )
        for spec in self.lora_modules:
            name, sep, path = spec.partition("=")
            if not (sep and name and path):
                raise ValueError(f"lora_modules: {spec!r} is not `name=path`")
        if self.lora_modules and not self.enabled:
            raise ValueError("lora_modules needs max_loras > 0 (the adapters' device slots)")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    @property
    def host_capacity(self) -> int:
        """Adapters kept in host memory (max_cpu_loras, at least max_loras)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def modules(self) -> list[tuple[str, str]]:
        """lora_modules as (name, path) pairs."""
        return [tuple(spec.split("=", 1)) for spec in self.lora_modules]  # type: ignore[misc]


@dataclass(frozen=True)
class EngineConfig:
    """Everything an Engine needs, resolved (no "auto" left)."""

    model_path: str
    # the device, dtype and attention defaults below are for configs built directly; a user's
    # options go through resolve_config, which picks each `auto` option
    device: str = option("cpu", "`cpu` or `cuda` (`cuda:N`); auto: CUDA when available", auto=True)
    dtype: str = option(
        "float32",
        "`float32`, `bfloat16`, `float16`; auto: bfloat16 on CUDA, float32 on CPU",
        choices=("float32", "bfloat16", "float16"),
        auto=True,
    )
    load_format: str = option(
        "auto",
        "`auto` (the checkpoint's weights) or `dummy` (random weights of the config's shape)",
        choices=("auto", "dummy"),
    )
    attention_backend: str = option(
        "torch",
        "`torch`, `torch-reference` (the exact oracle), `flashinfer`; auto: flashinfer on CUDA "
        "when installed, else torch",
        choices=("torch", "torch-reference", "flashinfer"),
        auto=True,
    )
    decode_attention_kernel: str = option(
        "auto",
        "flashinfer's kernel for decode rows: `fa2` (bf16 q), `xqa` (FlashInfer's XQA; over an "
        "fp8 cache its Hopper kernel rounds q and the softmax weights to fp8: about twice "
        "fa2's speed, ~3.6% relative attention error; block sizes 16-128, compute capability "
        '>= 9.0); auto: `xqa` for `kv_cache_dtype="fp8_e4m3"` on Hopper, else `fa2`. Other '
        "backends take only auto",
        choices=DECODE_ATTENTION_KERNELS,
    )
    enable_cuda_graph: bool = option(
        False,
        "decode steps replay CUDA graphs bucketed by batch size",
        flags=("--disable-cuda-graph",),
        auto=True,
        doc_default="on for CUDA",
    )
    overlap_schedule: bool = option(
        False,
        "plan step N+1 while step N runs",
        flags=("--disable-overlap-schedule",),
        auto=True,
        doc_default="on for CUDA",
    )
    cpu_threads: int | None = option(
        None,
        "torch threads on a CPU (set by the runner; none: leave torch's setting)",
        cli=False,
        auto=True,
        doc_flag="`--cpu-threads` (serve)",
        doc_default="in-process: the cores not busy at start-up (1-minute load average), at "
        "least 1; server: all cores but one",
    )
    cpu_prepack_weights: bool = option(
        True,
        "float32 on a CPU: keep a oneDNN-packed copy of each linear weight (faster GEMMs from 8 "
        "rows up, at twice the weights' memory; radixrt/model/linear.py)",
        flags=("--disable-cpu-prepack-weights",),
    )
    # Python's full collections otherwise rescan the model, graphs and modules every ~80 busy
    # steps (benchmarks/bench_timeline.py); off in-process, where an engine dropped without
    # shutdown() would keep its (device) memory for good
    freeze_gc: bool = option(
        False,
        "`gc.freeze()` once the engine is built, undone by `shutdown()`",
        cli=False,
        doc_default="off in-process; on in the server's scheduler process",
    )
    seed: int = option(
        0, "dummy weights and the sampler's generator for unseeded requests", cli=False
    )
    max_model_len: int | None = option(
        None,
        "context length: prompt + output tokens of one request",
        doc_default="the model's `max_position_embeddings`",
    )
    tensor_parallel_size: int = option(
        1, "ranks sharing each layer, rank r on cuda:r", flags=("--tensor-parallel-size", "--tp")
    )
    quantization: str | None = option(
        None,
        "`fp8`: W8A8 fp8 linear layers, a 16/32-bit checkpoint (or dummy weights) quantized at "
        "load; none: as the checkpoint is (fp8 checkpoints in the compressed-tensors "
        "`float-quantized` or ModelOpt FP8 layouts run in fp8 either way; other "
        "`quantization_config`s are refused). CUDA needs compute capability >= 8.9; on a CPU "
        "the weights are dequantized at load",
        choices=QUANTIZATIONS,
    )
    fp8_activation_scale: str = option(
        "auto",
        "when quantizing at load: `token` (per-channel weight scales, dynamic per-token "
        "activation scales; what auto means) or `tensor` (per-tensor weight scales, dynamic "
        "per-tensor activation scales over a step's real tokens: a CUDA graph's padding rows "
        "do not count); with an fp8 checkpoint only its own value (auto) is accepted",
        choices=FP8_ACTIVATION_SCALES,
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.attention_backend not in ("torch", "torch-reference", "flashinfer"):
            raise ValueError(
                "attention_backend must be 'torch', 'torch-reference' or 'flashinfer', "
                f"got {self.attention_backend!r}"
            )
        if self.decode_attention_kernel not in DECODE_ATTENTION_KERNELS:
            raise ValueError(
                f"decode_attention_kernel must be one of {DECODE_ATTENTION_KERNELS}, got "
                f"{self.decode_attention_kernel!r}"
            )
        if self.decode_attention_kernel == "xqa" and self.cache.block_size not in XQA_BLOCK_SIZES:
            raise ValueError(
                "decode_attention_kernel='xqa' takes block sizes "
                f"{', '.join(map(str, XQA_BLOCK_SIZES[:-1]))} or {XQA_BLOCK_SIZES[-1]}, got "
                f"block_size={self.cache.block_size}"
            )
        if self.decode_attention_kernel != "auto" and self.attention_backend != "flashinfer":
            raise ValueError(
                f"decode_attention_kernel={self.decode_attention_kernel!r} picks a flashinfer "
                f"kernel; attention_backend is {self.attention_backend!r}"
            )
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
            )
        if self.fp8_activation_scale not in FP8_ACTIVATION_SCALES:
            raise ValueError(
                f"fp8_activation_scale must be one of {FP8_ACTIVATION_SCALES}, "
                f"got {self.fp8_activation_scale!r}"
            )
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if self.cache.host_tier and tp > 1:
            raise ValueError("a host KV tier (host_kv_gb) needs tensor_parallel_size 1 for now")
        if self.cache.host_tier and self.speculative.speculative_method == "draft":
            raise ValueError(
                "a host KV tier (host_kv_gb) cannot be combined with speculative_method 'draft' "
                "yet: the draft model's KV is not written back to the host; use ngram or radix"
            )
        if self.speculative.speculative_method == "radix" and self.cache.prefix_cache != "radix":
            raise ValueError(
                "speculative_method 'radix' drafts from the radix prefix cache, but "
                f"prefix_cache is {self.cache.prefix_cache!r}; use prefix_cache='radix' or "
                "speculative_method 'ngram'"
            )
        if self.lora.enabled and self.quantization is not None:
            raise ValueError(
                f"LoRA adapters (max_loras={self.lora.max_loras}) need a 16/32-bit base; "
                f"quantization={self.quantization!r} has no LoRA path yet"
            )
        if self.speculative.speculative_method == "draft" and tp > 1:
            raise ValueError(
                "speculative_method 'draft' runs with tensor_parallel_size 1 only, "
                f"got tensor_parallel_size={tp}"
            )


def default_cpu_threads() -> int:
    """Torch threads for an in-process CPU engine: the usable cores minus those busy at
    start-up (the 1-minute load average, rounded), at least 1. OpenMP threads that share a
    core with other work spin: on 2 busy cores 2 threads made a tiny-model decode step 8x
    slower than 1; on 2 idle cores 2 threads ran the 32 x (128 in / 32 out) workload 1.4x
    faster than 1 (benchmarks/bench_serving.py --threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    try:
        busy = round(os.getloadavg()[0])
    except OSError:  # no load average on this platform: half the cores
        busy = cores // 2
    return max(1, min(cores, cores - busy))


def resolve_config(
    model_path: str,
    device: str = "auto",
    dtype: str = "auto",
    *,
    detect_devices: bool = True,
    **options: object,
) -> EngineConfig:
    """Turn user options (flat keyword arguments; "auto" allowed) into a frozen
    EngineConfig. Unknown options raise ValueError listing the allowed ones.

    `detect_devices=False` validates only (the torch-free front process): "auto" then
    stands for the CPU and neither torch nor flashinfer is imported."""
    if device == "auto":
        device = "cuda" if detect_devices and _cuda_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    groups = {
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "speculative": SpeculativeConfig,
        "grammar": GrammarConfig,
        "lora": LoraConfig,
    }
    sub: dict[str, dict[str, object]] = {k: {} for k in groups}
    top: dict[str, object] = {}
    top_names = {f.name for f in fields(EngineConfig)} - set(groups)
    for key, value in options.items():
        owner = next((g for g, c in groups.items() if key in {f.name for f in fields(c)}), None)
        if owner is not None:
            sub[owner][key] = value
        elif key in top_names:
            top[key] = value
        else:
            allowed = sorted(top_names | {f.name for c in groups.values() for f in fields(c)})
            raise ValueError(f"unknown engine option {key!r}; allowed: {', '.join(allowed)}")
    if top.get("attention_backend", "auto") == "auto":
        usable = detect_devices and _flashinfer_usable(device)
        top["attention_backend"] = "flashinfer" if usable else "torch"
    top.setdefault("enable_cuda_graph", device.startswith("cuda"))
    top.setdefault("overlap_schedule", device.startswith("cuda"))
    if device == "cpu":
        top.setdefault("cpu_threads", default_cpu_threads())
    cache = CacheConfig(**sub["cache"])
    if sub["scheduler"].get("policy", "auto") == "auto":
        sub["scheduler"]["policy"] = "lpm" if cache.prefix_cache == "radix" else "fcfs"
    return EngineConfig(
        model_path=model_path,
        device=device,
        dtype=dtype,
        cache=cache,
        scheduler=SchedulerConfig(**sub["scheduler"]),
        speculative=SpeculativeConfig(**sub["speculative"]),
        grammar=GrammarConfig(**sub["grammar"]),
        lora=LoraConfig(**sub["lora"]),
        **top,
    )


def _flashinfer_usable(device: str) -> bool:
    if not device.startswith("cuda"):
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _cuda_available() -> bool:
    import torch  # only when the device is "auto": the front process passes an explicit one

    return torch.cuda.is_available()
