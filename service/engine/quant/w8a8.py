"""W8A8: linear layers whose weights and activations are both 8-bit, so that the matmul runs on the GPU's int8 or
fp8 tensor cores instead of widening each weight to the activations' dtype (what the weight-only modes do).

The scheme, the same for both modes: weights quantized once, symmetric, one float32 scale per output channel;
activations quantized at every call, symmetric, one float32 scale per token (row) from that token's largest
magnitude. int8 codes lie in [-127, 127] (round half to even); fp8 codes are float8 e4m3fn in [-448, 448] (the
cast rounds). The product is rescaled by token scale times channel scale in float32 and cast to the
activations' dtype.

Kernels: int8 through a Triton kernel of our own on CUDA (engine/quant/triton_w8a8.py: exact int32 sums on the tensor
cores and the rescale in its epilogue; cuBLAS's `torch._int_mm` was no faster than bf16 on the H100) and
`torch._int_mm` on the CPU; fp8 through `torch._scaled_mm` (fp8 tensor cores, CUDA 8.9+). Each sits behind a
custom op, so that torch.compile fuses the quantization around a matmul it cannot see and so never tunes one per
prefill size (what stalled weight-only int8). Shapes a kernel refuses run an exact fallback.
`reference` computes the same rounding in float32 (quantize, dequantize, matmul) and `error_bound` how far a
kernel may lie from it; a layer built with `simulate=True` runs that reference instead of a kernel (how fp8 is
measured on a CPU, which never serves it).

On CUDA the same layer also serves the weight-only `int8` mode (`WEIGHT_ONLY`): the same int8 weights and
scales, the activations kept in their dtype, the Triton kernel widening each weight tile in registers. It
replaced torchao's int8 there, whose matmul torch.compile saw and tuned at every new prefill size (a stall).
"""

import functools

import torch
from torch import nn

CODES = {"int8-w8a8": torch.int8, "fp8-w8a8": torch.float8_e4m3fn}  # mode -> the dtype of its codes
WEIGHT_ONLY = {"int8": torch.int8}  # modes whose activations keep their dtype -> the dtype of the weights' codes
WEIGHT_CODES = CODES | WEIGHT_ONLY  # every mode this module's layer serves -> the dtype of its weights' codes
TINY = 1e-12  # the smallest row maximum a scale is made from: an all-zero row gets codes 0, not NaN
EPS32 = 2.0 ** -24  # float32 unit roundoff
FAST_ACCUM = True  # fp8 sums kept in the tensor cores' accumulator (fp8_mm)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of each row of a 2-D tensor: codes in `dtype` (int8 or float8 e4m3fn), and float32
    scales [rows, 1].

    Written so that eager and compiled code round alike: inductor turns a division by a constant into a product
    with its reciprocal (so the scale is that product here), Triton's float32 division is approximate while
    float64's is exact-rounded (so each row's reciprocal scale comes from a float64 division, and the codes from
    a float32 product with it), and torch.compile would make a float held in a variable a graph input (so the
    code ranges are literals)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=TINY)
    if dtype == torch.int8:
        scale = amax * (1 / 127)
        return (x * (1 / scale.double()).float()).round().clamp(-127.0, 127.0).to(torch.int8), scale
    scale = amax * (1 / 448)
    return (x * (1 / scale.double()).float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def int8_mm(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """codes [M, K] int8 @ weight [N, K] int8 transposed -> int32 [M, N], exact: `torch._int_mm`, the CPU's kernel
    (and on CUDA cuBLAS's, kept as the exact reference the Triton kernel is measured and checked against).

    cuBLAS wants more than 16 rows and K, N multiples of 8: fewer rows are padded with
    zero rows; other K or N go through float64, whose sums of int8 products are exact. The CPU kernel takes any shape.
    """
    if codes.device.type != "cuda":
        return torch._int_mm(codes, weight.t())
    rows, k = codes.shape
    if k % 8 or weight.shape[0] % 8:
        return (codes.double() @ weight.double().t()).to(torch.int32)
    if rows <= 16:
        padded = torch.nn.functional.pad(codes, (0, 0, 0, 32 - rows))
        return torch._int_mm(padded, weight.t())[:rows]
    return torch._int_mm(codes, weight.t())


@torch.library.custom_op("llm_service::int8_scaled_mm", mutates_args=())
def int8_scaled_mm(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """(codes [M, K] * scale [M, 1]) @ (weight [N, K] * weight_scale [1, N]).T in out_dtype; int8 codes, the sums
    exact, the rescale in float32 (token scale first, then channel scale: the same rounding on every device)."""
    if codes.device.type == "cuda":
        from service.engine.quant import triton_w8a8

        return triton_w8a8.int8_scaled_mm(codes, scale, weight, weight_scale, out_dtype)
    return (int8_mm(codes, weight).float() * scale * weight_scale).to(out_dtype)


@int8_scaled_mm.register_fake
def _(codes, scale, weight, weight_scale, out_dtype):
    return codes.new_empty(codes.shape[0], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("llm_service::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 * weight_scale [1, N]).T in x's dtype: the sums in float32, then the scale."""
    if x.device.type == "cuda":
        from service.engine.quant import triton_w8a8

        return triton_w8a8.int8_scaled_mm(x.contiguous(), None, weight, weight_scale, x.dtype)
    return ((x.float() @ weight.float().t()) * weight_scale).to(x.dtype)


@int8_weight_mm.register_fake
def _(x, weight, weight_scale):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("llm_service::silu_mul_quantize", mutates_args=())
def silu_mul_quantize(h: torch.Tensor, codes_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2N], a fused gate-and-up projection's output -> quantize_rows(silu(gate) * up): one Triton pass on
    CUDA (engine/quant/triton_w8a8.py), these very ops elsewhere and for rows wider than its registers hold."""
    if h.device.type == "cuda":
        from service.engine.quant import triton_w8a8

        if h.shape[1] // 2 <= triton_w8a8.MAX_ROW:
            return triton_w8a8.silu_mul_quantize(h.contiguous(), codes_dtype)
    gate, up = h.chunk(2, dim=-1)
    return quantize_rows(nn.functional.silu(gate) * up, codes_dtype)


@silu_mul_quantize.register_fake
def _(h, codes_dtype):
    return (h.new_empty(h.shape[0], h.shape[1] // 2, dtype=codes_dtype),
            h.new_empty(h.shape[0], 1, dtype=torch.float32))


@functools.cache
def _rowwise_scaling(device_index: int) -> bool:
    """torch._scaled_mm scales rows and columns in its epilogue on Hopper (compute capability 9.0) and newer."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


@torch.library.custom_op("llm_service::fp8_mm", mutates_args=())
def fp8_mm(codes: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """(codes [M, K] * scale [M, 1]) @ (weight [N, K] * weight_scale [1, N]).T in out_dtype; float8 e4m3fn codes.

    torch._scaled_mm wants K and N multiples of 16 (others: the float32 reference's math); it scales rows and
    columns itself only into bfloat16 on Hopper, so elsewhere it sums in float32 and the scales follow.
    The sums stay in the tensor cores' own accumulator over the whole of K (FAST_ACCUM), as vLLM's fp8 kernels
    for Hopper do: cuBLAS otherwise moves them into float32 registers every few steps, at a cost in speed.
    """
    if codes.shape[1] % 16 or weight.shape[0] % 16:
        return ((codes.float() * scale) @ (weight.float() * weight_scale.t()).t()).to(out_dtype)
    if out_dtype == torch.bfloat16 and _rowwise_scaling(codes.device.index or 0):
        return torch._scaled_mm(codes, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype,
                                use_fast_accum=FAST_ACCUM)
    one = torch.ones((), dtype=torch.float32, device=codes.device)
    summed = torch._scaled_mm(codes, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                              use_fast_accum=FAST_ACCUM)
    return (summed * scale * weight_scale).to(out_dtype)


@fp8_mm.register_fake
def _(codes, scale, weight, weight_scale, out_dtype):
    return codes.new_empty(codes.shape[0], weight.shape[0], dtype=out_dtype)


class W8A8Linear(nn.Module):
    """A linear layer with 8-bit weights (per output channel) that, in the W8A8 modes, quantizes its input per token
    at every call (weight-only int8 multiplies its input as it is)."""

    def __init__(self, linear: nn.Linear, mode: str, simulate: bool = False):
        super().__init__()
        codes, scale = quantize_rows(linear.weight.detach(), WEIGHT_CODES[mode])
        self._hold(codes, scale.reshape(1, -1), linear.bias, mode, simulate)

    @classmethod
    def _of(cls, codes, scale, bias, mode, simulate) -> "W8A8Linear":
        """A layer holding codes and scales already made (by `concatenated` or `split`)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(codes, scale, bias, mode, simulate)
        return layer

    def _hold(self, codes, scale, bias, mode, simulate) -> None:
        self.mode, self.codes, self.simulate = mode, WEIGHT_CODES[mode], simulate
        self.weight_only = mode in WEIGHT_ONLY
        self.quantizes_activations = not self.weight_only and not simulate  # runs a kernel on 8-bit codes
        self.out_features, self.in_features = codes.shape
        # [out, in] row-major: K-major, as 8-bit tensor-core instructions want both operands (cuBLAS refuses int8
        # with a row-major second operand for many shapes: CUBLAS_STATUS_NOT_SUPPORTED on the H100, 17 x 64 x 64)
        self.weight = nn.Parameter(codes.contiguous(), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)  # [1, out] float32
        self.bias = bias if bias is None or isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)
        # a simulated layer keeps its dequantized weight (a buffer: not counted as weight bytes) instead of making it
        # again at every call
        self.register_buffer("simulated_weight", self.dequantized_weight() if simulate else None, persistent=False)

    @classmethod
    def concatenated(cls, layers: list["W8A8Linear"]) -> "W8A8Linear":
        """One layer whose outputs are those of `layers` (same input, same mode) side by side: the codes and the
        per-channel scales are stacked, so the one matmul rounds exactly as the separate ones did."""
        first = layers[0]
        bias = None if first.bias is None else torch.cat([lay.bias for lay in layers])
        return cls._of(torch.cat([lay.weight for lay in layers]), torch.cat([lay.weight_scale for lay in layers], 1),
                       bias, first.mode, first.simulate)

    def split(self, sizes: list[int]) -> list["W8A8Linear"]:
        """The layers `concatenated` made this one of, by their numbers of outputs."""
        biases = self.bias.split(sizes) if self.bias is not None else [None] * len(sizes)
        return [self._of(codes, scale, bias, self.mode, self.simulate)
                for codes, scale, bias in zip(self.weight.split(sizes), self.weight_scale.split(sizes, 1), biases)]

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the codes stand for, [out, in] float32."""
        return self.weight.float() * self.weight_scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.quantizes_activations:
            out = self.from_codes(*quantize_rows(rows, self.codes), x.dtype)
        else:
            out = reference(self, rows).to(x.dtype) if self.simulate else \
                int8_weight_mm(rows, self.weight, self.weight_scale)
            out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def from_codes(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer's output [rows, out] in dtype for activations already quantized (a W8A8 mode's codes and
        per-row scales, as quantize_rows makes them)."""
        if self.codes == torch.int8:
            out = int8_scaled_mm(codes, scale, self.weight, self.weight_scale, dtype)
        else:
            out = fp8_mm(codes, scale, self.weight, self.weight_scale, dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}" + \
            (", simulated in float32" if self.simulate else "")


def _activations(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The activations the layer's matmul multiplies, [rows, in] float32: dequantized codes, or (weight-only) x."""
    rows = x.reshape(-1, layer.in_features)
    if layer.weight_only:
        return rows.float()
    codes, scale = quantize_rows(rows, layer.codes)
    return codes.float() * scale


def reference(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's matmul (no bias) in float32 from the same codes and scales: quantize, dequantize, multiply."""
    weight = layer.simulated_weight if layer.simulated_weight is not None else layer.dequantized_weight()
    out = _activations(layer, x) @ weight.t()
    return out.reshape(*x.shape[:-1], layer.out_features)


def error_bound(layer: W8A8Linear, x: torch.Tensor, dtype: torch.dtype, kernel_sum_error: float = 0.0
                ) -> torch.Tensor:
    """How far, elementwise, a kernel's output (no bias) in `dtype` may lie from `reference`.

    With the same codes on both sides, the sums differ only by rounding: float32 sums of K products whose
    factors were each rounded once (dequantizing) lie within (K + 2) u of the sum of |terms| of the exact sum
    (Higham's gamma bound, any summation order), the kernel's rescale of its sum within 3 u more; an output in
    a narrower dtype adds one rounding of each side. A kernel that sums less exactly than float32 adds
    `kernel_sum_error` times the sum of |terms| (int8 sums are exact: 0).
    """
    magnitude = _activations(layer, x).abs() @ layer.dequantized_weight().abs().t()
    bound = ((layer.in_features + 5) * EPS32 + kernel_sum_error) * magnitude
    if dtype != torch.float32:
        ref = reference(layer, x).reshape(bound.shape).abs()
        bound = bound + torch.finfo(dtype).eps * (ref + bound)
    return bound.reshape(*x.shape[:-1], layer.out_features)


def quantize(model: nn.Module, mode: str, simulate: bool = False, skip: nn.Module | None = None) -> int:
    """Replace every nn.Linear of the model but `skip` by a W8A8Linear, in place; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not skip:
                setattr(parent, name, W8A8Linear(child, mode, simulate))
                replaced += 1
    return replaced
