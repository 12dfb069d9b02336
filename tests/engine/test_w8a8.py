"""W8A8 layers on CPU: the codes and scales follow the scheme, the int8 kernel lies within the derived bound of
the float32 reference (and is the kernel that ran), the simulation is the reference, and under torch.compile the
matmul stays one opaque op."""

import pytest
import torch

from service.engine.quant import w8a8
from service.engine.quant.w8a8 import CODES, TINY, W8A8Linear, error_bound, quantize_rows, reference

MODES = list(CODES)


def ops_run(fn, *args) -> tuple[torch.Tensor, set[str]]:
    """fn's result and the names of the operators that ran inside it (the profiler's record: aten::_int_mm...)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    return out, {event.name for event in prof.events()}


def layer(mode: str, in_features: int, out_features: int, simulate: bool = False, seed: int = 0) -> W8A8Linear:
    torch.manual_seed(seed)
    return W8A8Linear(torch.nn.Linear(in_features, out_features, bias=False), mode, simulate)


def test_int8_codes_round_half_to_even_and_scale_by_the_row_maximum():
    codes, scale = quantize_rows(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]), CODES["int8-w8a8"])
    assert scale.tolist() == [[pytest.approx(2 / 127, rel=1e-7)], [pytest.approx(TINY / 127, rel=1e-7)]]
    assert codes.dtype == torch.int8
    assert codes.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 -> 64, 31.75 -> 32; an all-zero row stays 0


def test_fp8_codes_span_the_e4m3_range():
    codes, scale = quantize_rows(torch.tensor([[1.0, -2.0, 0.5, 0.01]]), CODES["fp8-w8a8"])
    assert codes.dtype == torch.float8_e4m3fn
    assert scale.item() == pytest.approx(2 / 448, rel=1e-7)
    assert codes.float().tolist() == [[224.0, -448.0, 112.0, 2.25]]  # 2.24 rounds to e4m3's 2.25


@pytest.mark.parametrize("mode", MODES)
def test_weights_are_codes_with_one_float32_scale_per_output_channel(mode):
    lin = layer(mode, 48, 40)
    assert lin.weight.dtype == CODES[mode] and lin.weight_scale.dtype == torch.float32
    assert lin.weight_scale.shape == (1, 40)
    assert lin.dequantized_weight().shape == (40, 48)
    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 40, bias=False).weight
    # each row's largest magnitude is a code of qmax, so it comes back exactly up to the scale's rounding
    assert torch.allclose(lin.dequantized_weight().abs().amax(1), dense.abs().amax(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 96), (7, 576, 1536), (33, 23, 17), (300, 128, 8)])
def test_int8_kernel_lies_within_the_derived_bound_of_the_float32_reference(rows, in_features, out_features, dtype):
    lin = layer("int8-w8a8", in_features, out_features)
    x = (torch.randn(rows, in_features) * torch.rand(rows, 1) * 10).to(dtype)
    x[0] = 0  # an all-zero token: scale from TINY, output exactly 0
    out, ops = ops_run(lin, x)
    assert "aten::_int_mm" in ops  # the integer kernel ran, not a float fallback
    assert out.dtype == dtype and out.shape == (rows, out_features)
    assert out[0].abs().max().item() == 0
    diff = (out.float() - reference(lin, x)).abs()
    assert (diff <= error_bound(lin, x, dtype)).all(), (diff - error_bound(lin, x, dtype)).max()


@pytest.mark.parametrize("mode", MODES)
def test_a_simulated_layer_computes_the_reference_and_no_8_bit_matmul(mode):
    lin = layer(mode, 64, 32, simulate=True)
    x = torch.randn(2, 5, 64)
    out, ops = ops_run(lin, x)
    assert "aten::_int_mm" not in ops and "aten::_scaled_mm" not in ops
    assert torch.equal(out, reference(lin, x))


@pytest.mark.parametrize("mode", MODES)
def test_quantization_error_is_that_of_8_bit_codes(mode):
    """Against the unquantized layer: relative error of the order of half a code step over the row maximum
    (int8: 1/254 per factor; e4m3: 2^-4 relative per factor), on Gaussian data where a few percent is right."""
    torch.manual_seed(1)
    dense = torch.nn.Linear(256, 128, bias=False)
    x = torch.randn(16, 256)
    lin = W8A8Linear(dense, mode, simulate=True)
    err = ((lin(x) - dense(x)).norm() / dense(x).norm()).item()
    assert err < {"int8-w8a8": 0.02, "fp8-w8a8": 0.06}[mode], err


def test_bias_is_added_after_the_rescale():
    torch.manual_seed(0)
    dense = torch.nn.Linear(32, 16, bias=True)
    lin = W8A8Linear(dense, "int8-w8a8")
    x = torch.randn(3, 32)
    assert lin.bias is dense.bias
    assert torch.allclose(lin(x), W8A8Linear(dense, "int8-w8a8", simulate=True)(x), rtol=0, atol=1e-5)
    assert torch.equal(lin(x) - lin.bias, lin(x) - dense.bias)


def test_compiled_int8_layer_keeps_the_matmul_one_opaque_op_over_any_row_count():
    """torch.compile with dynamic shapes: one graph serves every prefill size (no recompiles, nothing to tune),
    with the int8 matmul inside it as the custom op."""
    import torch._dynamo.testing

    lin = layer("int8-w8a8", 64, 48)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend=counter, dynamic=True)
    compiles = []
    for rows in (3, 17, 64, 129, 250):
        x = torch.randn(rows, 64)
        out = compiled(x)
        assert torch.equal(out, lin(x))  # rounds as eager code does
        assert ((out - reference(lin, x)).abs() <= error_bound(lin, x, torch.float32)).all()
        compiles.append(counter.frame_count)
    assert compiles == compiles[:1] * 5  # compiled at the first call only
    assert any(node.target is torch.ops.llm_service.int8_scaled_mm.default
               for graph in counter.graphs for node in graph.graph.nodes)


def test_quantize_replaces_every_linear_but_the_one_skipped():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    head = model[2]
    assert w8a8.quantize(model, "int8-w8a8", skip=head) == 1
    assert isinstance(model[0], W8A8Linear) and model[2] is head


def test_weight_only_int8_layer_keeps_the_activations_and_lies_within_the_bound():
    """The layer weight-only int8 runs on CUDA (here its CPU fallback): int8 weights with per-channel scales, the
    activations multiplied as they are, within the bound of the float32 reference; stacked and split like W8A8."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48, bias=False)
    lin = W8A8Linear(dense, "int8")
    assert lin.weight_only and lin.weight.dtype == torch.int8 and lin.weight_scale.shape == (1, 48)
    x = torch.randn(5, 64) * 4
    out = lin(x)
    torch.testing.assert_close(reference(lin, x), x @ lin.dequantized_weight().t(), rtol=0, atol=0)
    assert ((out - reference(lin, x)).abs() <= error_bound(lin, x, torch.float32)).all()
    assert (out - dense(x)).abs().max() < 0.02 * dense(x).abs().max()  # int8 weights: close to float32
    parts = W8A8Linear.concatenated([lin, lin]).split([48, 48])
    assert all(torch.equal(part(x), out) for part in parts)
