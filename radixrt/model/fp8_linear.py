"""`Fp8Linear`: a linear layer with float8_e4m3fn weights (W8A8, `radixrt.quantization`).

Weights: [N, K] float8_e4m3fn, x ~ weight.float() * scale with `weight_scale` [N] float32
(per output channel) or [1] (per tensor). A merged layer (q/k/v, gate/up) loads each part
("shard") on its own: per-channel scales are rows like the weight's; per-tensor ones are kept
per shard while loading and merged by `finish_loading` into the largest (the other shards'
weights requantized to it), as is a static `input_scale` (the largest of the shards').

Quantizing at load (a 16/32-bit tensor given to `load`): per channel, scale = max |row| / 448;
per tensor, max |shard| / 448; the tensor is moved to the weight's device first and
quantized there, so the peak is the fp8 model plus one checkpoint tensor (and its float32
copy).

Forward, on CUDA (compute capability >= 8.9): the activation is quantized in one Triton pass
(`radixrt.kernels.fp8_quant`: dynamic per token, or per tensor with the static or a dynamic
scale) unless the caller passes an `Fp8Activation` it quantized in a fused kernel, and one
`torch._scaled_mm` (cuBLASLt) computes the product in the model dtype:
- weight and activation scales both per tensor: the tensor-wise GEMM, scales applied inside;
- per-token activation or per-channel weight scales (row-wise scales), M > EPILOGUE_MAX_ROWS
  rows: the row-wise GEMM (scale_a [M, 1], scale_b [1, N]; a per-tensor weight scale is
  expanded to [N] once, a per-tensor activation scale to [M, 1] per call);
- row-wise scales, M <= EPILOGUE_MAX_ROWS (decode): the tensor-wise GEMM with the per-tensor
  parts of the scales (1 for the others; at M = 1 a per-token scale is one number and goes
  in), and the per-row / per-column scales applied after it as an epilogue. cuBLASLt's
  row-wise kernel is no faster than bf16 at small M (benchmarks/bench_fp8_gemm.py), its
  tensor-wise one ~1.8x. `product` returns that output unscaled (an `Fp8Product`) for a
  kernel of ours that reads it next to apply the scales (the fused residual add + RMSNorm +
  quantization after o_proj / down_proj, SiLU-and-mul + quantization after gate_up);
  `forward` applies them itself (`scale_product`: one small kernel, the bias folded in).
  The unscaled output is in the model dtype: bfloat16 holds any e4m3 dot product (|sum| <=
  K * 448^2, ~3e9 at K = 14336, bf16's range is 3e38) and rounds it to 8 bits, so the
  epilogue's output may differ from the row-wise GEMM's by one more bf16 rounding (at most
  2^-9 of a value, an order below the fp8 quantization error, ~3.5%); float32 is exact.

On a CPU (`finish_loading(dequantize=True)`) the weight is dequantized once into the model
dtype (weight.float() * scale) and replaces the fp8 one: there is no fp8 GEMM to run and a
per-call dequantization would add a weight-sized pass to every GEMM; prepacking
(`radixrt.model.linear`) then applies as to any float32 weight. Activations are quantized and
dequantized per call with the torch reference (the same scales and roundings as the CUDA
kernels), so a CPU run emulates W8A8 up to the GEMM's summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from radixrt.kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    Fp8Activation,
    Fp8Product,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_reference,
    rmsnorm_quantize_fp8,
    scale_product,
    silu_mul_quantize_fp8,
)
from radixrt.model.linear import Linear
from radixrt.quantization import Fp8Scheme

FP8_TENSOR_NAMES = ("weight", "weight_scale", "input_scale")  # what `load` takes
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: fp8 tensor cores (torch._scaled_mm)
# Row-wise scales at M <= this: the tensor-wise GEMM + an epilogue (the module docstring).
# benchmarks/bench_fp8_gemm.py, 32 Llama-3-8B layers + lm_head: tensor-wise 1.6-1.9x faster
# than row-wise at M = 1..32, 1.2x at 256, the same at 4096 (decode graphs of more rows, up
# to 1024, run the row-wise GEMM).
EPILOGUE_MAX_ROWS = 256


def quantize_weight(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, K] float -> (fp8 [n, K], scale float32: [n] per channel or [1]), computed on
    w's device (one float32 copy of w at a time)."""
    wf = w.float()
    if per_channel:
        amax = wf.abs().amax(dim=1)
    else:
        amax = wf.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (wf / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


class Fp8Linear(Linear):
    """See the module docstring. `shards`: (offset, size) of each separately loaded part
    along the output features (default: one, the whole). Parameters: `weight` (fp8, or the
    model dtype once dequantized), `bias` (model dtype); buffers `weight_scale` and, for a
    static activation scale, `input_scale`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: Fp8Scheme,
        bias: bool = False,
        shards: tuple[tuple[int, int], ...] = (),
        row_parts: tuple[tuple[int, int], ...] = (),
    ) -> None:
        device = torch.get_default_device()  # the model is built under `torch.device(...)`
        with torch.device("meta"):  # no 16-bit weight is ever allocated
            super().__init__(in_features, out_features, bias=False, row_parts=row_parts)
        self.out_dtype = torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty((out_features, in_features), dtype=FP8_DTYPE, device=device),
            requires_grad=False,
        )
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.scheme = scheme
        self.shards = shards or ((0, out_features),)
        self.per_channel = scheme.weight_scale == "channel"
        self.per_token = scheme.activation_scale == "token"
        self.static = scheme.static_input_scale
        n = len(self.shards)
        scale_shape = (out_features,) if self.per_channel else (n,)
        f32 = dict(dtype=torch.float32, device=device)  # scales: float32 whatever the model's
        self.register_buffer("weight_scale", torch.zeros(scale_shape, **f32))
        self.register_buffer("input_scale", torch.zeros(n, **f32) if self.static else None)
        self.dequantized = False  # set by finish_loading(dequantize=True)
        self.finished = False
        self._scale_b: torch.Tensor | None = None  # [1, N] float32 for the row-wise GEMM
        self._one: torch.Tensor | None = None  # [1] float32 1.0: a tensor-wise scale of 1
        self._rowwise = not (scheme.weight_scale == "tensor" and not self.per_token)
        # rows up to which row-wise scales run as the tensor-wise GEMM + epilogue (0: never;
        # EPILOGUE_MAX_ROWS once finished on the GEMM path)
        self.epilogue_max_rows = 0
        # dynamic per-tensor activation scales: [1] integer on the device, the rows whose
        # absmax counts (a CUDA graph's real rows; set by the model), or None: all rows
        self.num_rows: torch.Tensor | None = None

    # ---- loading ----
    def load(self, name: str, tensor: torch.Tensor, shard: int) -> None:
        """Load checkpoint tensor `name` ("weight", "weight_scale", "input_scale") of shard
        index `shard`. A 16/32-bit weight is quantized here; an fp8 one is copied as is
        (its scale comes as "weight_scale")."""
        assert not self.finished, "load after finish_loading"
        offset, size = self.shards[shard]
        with torch.no_grad():
            if name == "weight":
                if tuple(tensor.shape) != (size, self.in_features):
                    raise ValueError(
                        f"weight shape {tuple(tensor.shape)} != ({size}, {self.in_features})"
                    )
                rows = self.weight[offset : offset + size]
                if tensor.dtype == FP8_DTYPE:
                    rows.copy_(tensor)
                    return
                if self.scheme.from_checkpoint:
                    raise ValueError(
                        f"a {tensor.dtype} weight in a {self.scheme.checkpoint_format} fp8 "
                        "checkpoint (expected float8_e4m3fn)"
                    )
                q, scale = quantize_weight(tensor.to(self.weight.device), self.per_channel)
                rows.copy_(q)
                self._set_weight_scale(scale, shard)
            elif name == "weight_scale":
                self._set_weight_scale(tensor.to(self.weight_scale.device).float(), shard)
            elif name == "input_scale":
                if not self.static:
                    raise ValueError("an input_scale in a checkpoint with dynamic activations")
                if tensor.numel() != 1:
                    raise ValueError(
                        f"input_scale of shape {tuple(tensor.shape)}: only per-tensor (one "
                        "number) static input scales are supported"
                    )
                self.input_scale[shard] = tensor.float().reshape(())
            else:
                raise ValueError(f"unknown fp8 tensor {name!r}; known: {FP8_TENSOR_NAMES}")

    def _set_weight_scale(self, scale: torch.Tensor, shard: int) -> None:
        offset, size = self.shards[shard]
        if self.per_channel:
            if scale.numel() != size or (scale.dim() == 2 and scale.shape[0] != size):
                raise ValueError(
                    f"weight_scale of shape {tuple(scale.shape)}: per-channel scales must be "
                    f"[{size}] or [{size}, 1] (one per output row)"
                )
            self.weight_scale[offset : offset + size] = scale.reshape(size)
        else:
            if scale.numel() != 1:
                raise ValueError(
                    f"weight_scale of shape {tuple(scale.shape)}: per-tensor scales are one number"
                )
            self.weight_scale[shard] = scale.reshape(())

    def finish_loading(self, dequantize: bool) -> None:
        """Merge per-shard per-tensor scales (requantizing shards to the largest), and make
        the GEMM's operands; with `dequantize`, replace the fp8 weight by its value in the
        model dtype (the CPU path)."""
        assert not self.finished
        with torch.no_grad():
            if not self.per_channel and len(self.shards) > 1:
                merged = self.weight_scale.max()
                for (offset, size), s in zip(self.shards, self.weight_scale.tolist()):
                    if s != merged.item():
                        rows = self.weight[offset : offset + size]
                        rows.copy_(
                            (rows.float() * (s / merged)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                        )
                self.weight_scale = merged.reshape(1)
            if self.static:
                self.input_scale = self.input_scale.max().reshape(1)
            if dequantize:
                scale = self.weight_scale[:, None] if self.per_channel else self.weight_scale
                weight = (self.weight.float() * scale).to(self.out_dtype)
                self.weight = nn.Parameter(weight, requires_grad=False)
                self.dequantized = True
            else:
                self._check_gemm_shape()
            if not dequantize and self._rowwise:
                self._scale_b = self.weight_scale.expand(self.out_features).reshape(1, -1)
                self._scale_b = self._scale_b.contiguous()
                self._one = torch.ones(1, dtype=torch.float32, device=self.weight.device)
                self.epilogue_max_rows = EPILOGUE_MAX_ROWS
        self.finished = True

    def _check_gemm_shape(self) -> None:
        """torch._scaled_mm needs K and N multiples of 16; on CUDA row-wise scales need a
        bf16 output (torch's CPU kernel, which the tests use, takes float32 too)."""
        if self._rowwise and self.weight.is_cuda and self.out_dtype != torch.bfloat16:
            raise ValueError(
                f"the row-wise fp8 GEMM (per-channel or per-token scales) outputs bfloat16 "
                f"only, the model dtype is {self.out_dtype}; use dtype bfloat16 or "
                "per-tensor scales (fp8_activation_scale='tensor')"
            )
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(
                f"an fp8 linear of {self.in_features} -> {self.out_features} features: the "
                "fp8 GEMM needs both multiples of 16 (on this rank)"
            )

    # ---- forward ----
    @property
    def fusable(self) -> bool:
        """Whether callers may quantize this layer's input in a fused kernel (the CUDA path
        with per-token or static per-tensor activation scales)."""
        return self.finished and not self.dequantized and (self.per_token or self.static)

    def quantize_input(self, x: torch.Tensor) -> Fp8Activation:
        """x [T, K] -> its quantized form for this layer (the CUDA kernels)."""
        return quantize_fp8(
            x, per_token=self.per_token, scale=self.input_scale, num_rows=self.num_rows
        )

    def quantize_rmsnorm(
        self,
        x: torch.Tensor | Fp8Product,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[Fp8Activation, torch.Tensor]:
        """RMSNorm (with the residual add) fused with this layer's input quantization; x may be
        another layer's unscaled `product`. Returns (quantized norm output, new residual).
        Only when `fusable`."""
        return rmsnorm_quantize_fp8(
            x, weight, eps, residual, per_token=self.per_token, scale=self.input_scale
        )

    def quantize_silu_mul(self, gate_up: torch.Tensor | Fp8Product) -> Fp8Activation:
        """silu(gate) * up fused with this layer's input quantization; gate_up may be an
        unscaled `product`. Only when `fusable`."""
        return silu_mul_quantize_fp8(gate_up, per_token=self.per_token, scale=self.input_scale)

    def _emulated_input(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized path: x quantized and dequantized as the GPU quantizes it."""
        q = quantize_fp8_reference(
            x, per_token=self.per_token, scale=self.input_scale, num_rows=self.num_rows
        )
        return dequantize_fp8(q, x.dtype)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """x [T, K] (model dtype, or already quantized) -> [T, N] model dtype."""
        out = Fp8Linear.product(self, x)
        return out if isinstance(out, torch.Tensor) else scale_product(out, self.bias)

    def product(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor | Fp8Product:
        """`forward`, except that with row-wise scales at M <= `epilogue_max_rows` (no bias)
        the output [T, N] comes unscaled, as an `Fp8Product`, for the kernel that reads it
        to apply them (`quantize_rmsnorm`, `quantize_silu_mul`, `scale_product`)."""
        if self.dequantized:
            assert isinstance(x, torch.Tensor), "the dequantized path takes unquantized inputs"
            return super().forward(self._emulated_input(x))
        assert self.finished, "forward before finish_loading"
        q = x if isinstance(x, Fp8Activation) else self.quantize_input(x)
        m = q.data.shape[0]
        if self._rowwise and m <= self.epilogue_max_rows:
            return self._epilogue_product(q)
        if self._rowwise:
            scale_a = q.scale
            if scale_a.dim() == 1:  # a per-tensor activation scale [1] (also at M = 1)
                scale_a = scale_a.expand(m, 1).contiguous()
            scale_b = self._scale_b
        else:
            scale_a, scale_b = q.scale, self.weight_scale
        out = torch._scaled_mm(
            q.data, self.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=self.out_dtype
        )
        return out if self.bias is None else out.add_(self.bias)

    def _epilogue_product(self, q: Fp8Activation) -> torch.Tensor | Fp8Product:
        """The tensor-wise GEMM with the per-tensor parts of the scales; the rest (per-token
        rows at M > 1, per-channel columns) left to the epilogue. No scale left: a tensor."""
        per_row = self.per_token and q.data.shape[0] != 1
        scale_a = self._one if per_row else q.scale.reshape(1)  # M = 1: one row, one scale
        scale_b = self._one if self.per_channel else self.weight_scale
        raw = torch._scaled_mm(
            q.data, self.weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=self.out_dtype
        )
        out = Fp8Product(
            raw, q.scale if per_row else None, self.weight_scale if self.per_channel else None
        )
        if self.bias is not None or (out.row_scale is None and out.col_scale is None):
            return scale_product(out, self.bias)
        return out

    def forward_rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The dequantized path's part of the output features (see `Linear.forward_rows`)."""
        assert self.dequantized, "forward_rows is the CPU path"
        return super().forward_rows(self._emulated_input(x), start, stop)

    def init_dummy(self, generator: torch.Generator, low: float, high: float) -> None:
        """Random weights (uniform in [low, high) in the model dtype, one shard at a time),
        quantized as a checkpoint's would be at load."""
        for i, (_, size) in enumerate(self.shards):
            w = torch.empty(
                (size, self.in_features), dtype=self.out_dtype, device=self.weight.device
            )
            self.load("weight", w.uniform_(low, high, generator=generator), i)

    def weight_bytes(self) -> int:
        """Bytes of the weight and its scales as held now."""
        scales = self.weight_scale.numel() * 4
        return self.weight.numel() * self.weight.element_size() + scales


def linear_product(linear: nn.Module, x: torch.Tensor | Fp8Activation) -> torch.Tensor | Fp8Product:
    """`linear.product(x)` for an `Fp8Linear` (perhaps unscaled), else `linear(x)`."""
    return linear.product(x) if isinstance(linear, Fp8Linear) else linear(x)


def as_tensor(x: torch.Tensor | Fp8Product) -> torch.Tensor:
    """x's value: an `Fp8Product`'s scales applied (`scale_product`, in place), a tensor as is."""
    return scale_product(x) if isinstance(x, Fp8Product) else x


def check_fp8_capability(device: torch.device) -> None:
    """Raise ValueError unless `device` can run the fp8 GEMMs (CUDA, capability >= 8.9)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"fp8 weights (quantization='fp8' or an fp8 checkpoint) need a GPU of compute "
            f"capability >= 8.9 (Ada, Hopper); {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}"
        )
