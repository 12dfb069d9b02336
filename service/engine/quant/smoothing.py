"""SmoothQuant for the W8A8 modes (Xiao et al., 2023): move activation outliers into the weights before quantizing.

A token's activations get one scale (w8a8.quantize_rows), so a few channels far larger than the rest set it and
the others lose their precision. For a linear layer y = x W^T whose input comes from a layer it can be folded into,
dividing input channel j by s_j there and multiplying column j of W by s_j computes exactly the same y, with the
outliers smaller. With s_j = max|x_j|^a / max|W_j|^(1 - a) (the migration strength a), both sides quantize
better. Per Llama decoder layer, four places:
- q, k and v after the attention's RMSNorm (its weight divided by s);
- gate and up after the MLP's RMSNorm;
- down after up (up's output row j divided by s_j: silu(gate) * up is linear in up);
- o after v (v's output channel divided): the query heads that share a key-value head read the same v channels, so
  s is one per key-value head channel, the largest over the group's.
The activations' maxima come from the float model on a short built-in text (calibration.txt: a few hundred tokens
that none of the quality measurements use). Each place tries every strength in ALPHAS, and no smoothing, and keeps
the one whose simulated W8A8 output lies closest to the float output on that text. Nothing changes per step: the
folded weights are the model's weights, quantized as before. A model that is not Llama-shaped keeps today's path.
"""

import logging
from pathlib import Path

import torch
from torch import nn

from service.engine.quant import w8a8

log = logging.getLogger(__name__)

CALIBRATION_TEXT = Path(__file__).parent / "calibration.txt"
ALPHAS = (0.5, 0.6, 0.7, 0.8)  # the default model chose none of 0.3 and 0.4, offered too: left out, 2 s sooner
MAX_TOKENS = 512  # calibration tokens kept per place: the text is shorter


def foldable(model: nn.Module) -> list[nn.Module]:
    """The decoder layers smoothing can fold into: Llama-shaped ones (RMSNorm weights, q/k/v/o, gate/up/down)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    need = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
            ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"), ("input_layernorm", "weight"),
            ("post_attention_layernorm", "weight"))
    ok = all(all(hasattr(getattr(layer, a, None), b) for a, b in need) for layer in layers)
    return list(layers) if layers and ok else []


@torch.inference_mode()
def smooth(model: nn.Module, tokenizer, mode: str) -> list[dict]:
    """Calibrate on the built-in text and fold smoothing factors into `model` (float weights, before quantizing in
    W8A8 `mode`). Returns, per decoder layer and place, the strength chosen (None: no smoothing) and the simulated
    output error without and with it."""
    layers = foldable(model)
    if not layers:
        log.info("smoothing: %s is not Llama-shaped; its layers quantize without it", type(model).__name__)
        return []
    inputs = _calibration_inputs(model, tokenizer, layers)
    codes = w8a8.CODES[mode]
    config = model.config.get_text_config()
    group = config.num_attention_heads // config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    chosen = []
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        places = [
            ("qkv", [attn.q_proj, attn.k_proj, attn.v_proj], _norm_folder(layer.input_layernorm)),
            ("gate_up", [mlp.gate_proj, mlp.up_proj], _norm_folder(layer.post_attention_layernorm)),
            ("down", [mlp.down_proj], _rows_folder(mlp.up_proj)),
            ("o", [attn.o_proj], _rows_folder(attn.v_proj)),
        ]
        for name, linears, fold_before in places:
            x = inputs[id(linears[0])]
            tie = (group, head_dim) if name == "o" else None
            alpha, s, before, after = _choose(x, linears, codes, tie)
            if s is not None:
                fold_before(s if tie is None else s.view(-1, group, head_dim)[:, 0].reshape(-1))
                for linear in linears:
                    linear.weight.mul_(s.to(linear.weight.dtype))
            chosen.append({"layer": i, "place": name, "alpha": alpha, "error": before, "smoothed_error": after})
    strengths = [c["alpha"] for c in chosen]
    log.info("smoothing for %s: %d of %d places smoothed, strengths %s; simulated output error %.4f -> %.4f (mean "
             "relative)", mode, sum(a is not None for a in strengths), len(chosen),
             {a: strengths.count(a) for a in sorted(set(strengths), key=lambda a: (a is None, a or 0))},
             sum(c["error"] for c in chosen) / len(chosen), sum(c["smoothed_error"] for c in chosen) / len(chosen))
    return chosen


def _calibration_inputs(model: nn.Module, tokenizer, layers: list[nn.Module]) -> dict[int, torch.Tensor]:
    """The float inputs of each place's first linear layer over the calibration text: [tokens, features] float32."""
    ids = tokenizer.encode(CALIBRATION_TEXT.read_text(), add_special_tokens=False)[:MAX_TOKENS]
    watched = [m for layer in layers for m in (layer.self_attn.q_proj, layer.mlp.gate_proj, layer.mlp.down_proj,
                                               layer.self_attn.o_proj)]
    inputs, hooks = {}, []
    for module in watched:
        hooks.append(module.register_forward_pre_hook(
            lambda m, args: inputs.__setitem__(id(m), args[0].reshape(-1, args[0].shape[-1]).float().clone())))
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    return inputs


def _choose(x: torch.Tensor, linears: list[nn.Linear], codes: torch.dtype,
            tie: tuple[int, int] | None) -> tuple[float | None, torch.Tensor | None, float, float]:
    """The strength whose smoothed, simulated W8A8 output lies closest to the float output on `x`: (strength or
    None, the factors s [features] or None, the error without smoothing, the error with the choice). `tie`
    (group, head_dim): the factors of the query heads that share a key-value head are made equal (the largest)."""
    weight = torch.cat([linear.weight.float() for linear in linears])  # [outputs, features]
    w_max = weight.abs().amax(0).clamp(min=1e-5)
    exact = x @ weight.t()
    scale = exact.norm()

    def error(s: torch.Tensor | None) -> float:
        xs, ws = (x, weight) if s is None else (x / s, weight * s)
        xq, xscale = w8a8.quantize_rows(xs, codes)
        wq, wscale = w8a8.quantize_rows(ws, codes)
        # int8: the exact integer sums, as the kernels compute them (and three times faster than float32 on a CPU)
        sums = w8a8.int8_mm(xq, wq).float() if codes == torch.int8 else xq.float() @ wq.float().t()
        return (sums * xscale * wscale.t() - exact).norm().item() / max(scale.item(), 1e-12)

    x_max = x.abs().amax(0).clamp(min=1e-5)
    unsmoothed = error(None)
    best = (None, None, unsmoothed)
    for alpha in ALPHAS:
        s = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)
        if tie is not None:
            group, head_dim = tie
            s = s.view(-1, group, head_dim).amax(1, keepdim=True).expand(-1, group, -1).reshape(-1)
        e = error(s)
        if e < best[2]:
            best = (alpha, s, e)
    return best[0], best[1], unsmoothed, best[2]


def _norm_folder(norm: nn.Module):
    """Divide an RMSNorm's output channels by s: its weight."""
    return lambda s: norm.weight.div_(s.to(norm.weight.dtype))


def _rows_folder(linear: nn.Linear):
    """Divide a linear layer's output channels by s: its weight's rows (and its bias)."""
    def fold(s: torch.Tensor) -> None:
        linear.weight.div_(s.to(linear.weight.dtype).unsqueeze(1))
        if linear.bias is not None:
            linear.bias.div_(s.to(linear.bias.dtype))
    return fold
