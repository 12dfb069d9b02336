"""One matrix multiply for the query, key and value projections of each attention layer, and one for the gate and
up projections of each MLP.

transformers' Llama-family attention runs q_proj, k_proj and v_proj as three multiplies over the same input. In a
decode step the key and value ones are small (a 1B model's: 2 MB of weights each), and a small multiply does not
reach the memory bandwidth: on an H100 at one row the three took 15.1 us and one multiply over the concatenated
weights 5.3 us; at 256 rows 17.3 us and 8.2 us (tests/gpu/kernels/decode_kernels.py). `fuse_qkv` concatenates them into
one `qkv_proj` and gives the attention module a forward pass that splits its output; what follows is the
model's own code (Qwen3's norms, the attention function, o_proj) as its own forward pass calls it, but for the
rotary embedding: under the engine's paged attention the attention backend turns the queries as it reads them and
the keys as it writes them into the cache (runner/attention.py; on CUDA inside the Triton kernels, where a pass of
its own over q and k took 7% of a prefill step's device time on an H200); under any other attention q's and k's
heads are turned together (the family's formula, with its rotate_half: compiled, one kernel instead of two a
layer). Qwen3 keeps the model's own, after its per-head norms. `fuse_gate_up` does
the same for the MLP's gate_proj and up_proj (one `gate_up_proj`; the forward pass splits it and runs
down_proj(act(gate) * up), the family's own formula).

Only the attention and MLP classes whose forward pass is known (below) are fused, and only plain floating-point
weights or W8A8Linear layers of one mode (engine/quant/w8a8.py: the W8A8 modes, and weight-only int8 on CUDA;
stacking their codes and per-channel scales rounds exactly as the separate layers did, and the input is quantized
once instead of once per projection): a quantized checkpoint or a torchao --quantization keeps its own projections.
"""

import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama as llama

from service.engine.quant.w8a8 import W8A8Linear, silu_mul_quantize
from service.engine.runner.attention import ATTN_IMPLEMENTATION

# transformers attention classes whose forward pass is Llama's: project, (Qwen3: per-head norms of q and k),
# rotary embedding, attention (Mistral, Qwen2 and Qwen3: with a sliding window), o_proj
FUSABLE = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}
# MLP classes whose forward pass is down_proj(act_fn(gate_proj(x)) * up_proj(x))
FUSABLE_MLP = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def fuse(model: torch.nn.Module) -> tuple[int, int]:
    """Fuse q, k, v and gate, up wherever they can be (what --fuse-qkv turns on); returns how many attention
    modules and how many MLPs."""
    return fuse_qkv(model), fuse_gate_up(model)


def unfuse(model: torch.nn.Module) -> None:
    """Undo `fuse`."""
    unfuse_qkv(model)
    unfuse_gate_up(model)


def fuse_qkv(model: torch.nn.Module) -> int:
    """Replace q_proj, k_proj and v_proj of every fusable attention module by one qkv_proj; return how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE and _plain(module, QKV):
            _fuse(module)
            count += 1
    return count


def unfuse_qkv(model: torch.nn.Module) -> None:
    """Give every fused attention module its three projections and its class's forward pass back."""
    for module in model.modules():
        if "qkv_proj" not in module._modules:
            continue
        for name, part in zip(QKV, _split(module.qkv_proj, module.qkv_sizes)):
            setattr(module, name, part)
        del module.qkv_proj, module.qkv_sizes, module.fused_sliding_window, module.model_code, module.fused_rotary
        del module.forward


def fuse_gate_up(model: torch.nn.Module) -> int:
    """Replace gate_proj and up_proj of every fusable MLP by one gate_up_proj; return how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE_MLP and _plain(module, GATE_UP):
            gate, up = module.gate_proj, module.up_proj
            module.gate_up_proj = _concatenated([gate, up])
            module.gate_up_sizes = [gate.out_features, up.out_features]
            # a W8A8 down projection after SiLU takes its input as codes made in one pass (w8a8.silu_mul_quantize)
            module.silu_codes = (type(module.act_fn).__name__ in ("SiLU", "SiLUActivation")
                                 and type(module.down_proj) is W8A8Linear and module.down_proj.quantizes_activations
                                 and gate.out_features == up.out_features)
            del module.gate_proj, module.up_proj
            module.forward = _fused_mlp_forward.__get__(module)
            count += 1
    return count


def unfuse_gate_up(model: torch.nn.Module) -> None:
    """Give every fused MLP its two projections and its class's forward pass back."""
    for module in model.modules():
        if "gate_up_proj" in module._modules:
            for name, part in zip(GATE_UP, _split(module.gate_up_proj, module.gate_up_sizes)):
                setattr(module, name, part)
            del module.gate_up_proj, module.gate_up_sizes, module.silu_codes, module.forward


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    h = self.gate_up_proj(x)
    if self.silu_codes:
        codes, scale = silu_mul_quantize(h.reshape(-1, h.shape[-1]), self.down_proj.codes)
        return self.down_proj.from_codes(codes, scale, h.dtype).reshape(*h.shape[:-1], -1)
    gate, up = h.split(self.gate_up_sizes, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _split(fused: torch.nn.Module, sizes: list[int]) -> list[torch.nn.Module]:
    """The layers a fused one was concatenated from, by their numbers of outputs."""
    if isinstance(fused, W8A8Linear):
        return fused.split(sizes)
    biases = fused.bias.split(sizes) if fused.bias is not None else [None] * len(sizes)
    parts = []
    for weight, bias in zip(fused.weight.split(sizes), biases):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias, requires_grad=False)
        parts.append(linear)
    return parts


def _plain(module, names: tuple[str, ...]) -> bool:
    """Whether the module's projections `names` can be concatenated: plain float layers or W8A8 layers of one mode,
    all over one input size, all with a bias or none."""
    projections = [getattr(module, name, None) for name in names]
    if all(type(p) is W8A8Linear for p in projections):
        return len({(p.mode, p.simulate, p.in_features, p.bias is None) for p in projections}) == 1
    return all(type(p) is torch.nn.Linear and type(p.weight) is torch.nn.Parameter and p.weight.is_floating_point()
               for p in projections) and len({p.in_features for p in projections}) == 1 \
        and len({p.bias is None for p in projections}) == 1


def _concatenated(layers: list[torch.nn.Module]) -> torch.nn.Module:
    """One layer whose outputs are those of `layers` side by side."""
    first = layers[0]
    if isinstance(first, W8A8Linear):
        return W8A8Linear.concatenated(layers)
    fused = torch.nn.Linear(first.in_features, sum(lay.out_features for lay in layers), bias=first.bias is not None,
                            device="meta")
    with torch.no_grad():
        fused.weight = torch.nn.Parameter(torch.cat([lay.weight for lay in layers]), requires_grad=False)
        if first.bias is not None:
            fused.bias = torch.nn.Parameter(torch.cat([lay.bias for lay in layers]), requires_grad=False)
    return fused


def _fuse(module) -> None:
    module.qkv_proj = _concatenated([module.q_proj, module.k_proj, module.v_proj])
    module.qkv_sizes = [module.q_proj.out_features, module.k_proj.out_features, module.v_proj.out_features]
    del module.q_proj, module.k_proj, module.v_proj
    # Mistral reads its window from the config, Qwen2 and Qwen3 keep one per layer (None on full-attention layers);
    # Llama has none (None: every attention function's default)
    module.fused_sliding_window = (module.sliding_window if hasattr(module, "sliding_window")
                                   else getattr(module.config, "sliding_window", None))
    module.model_code = sys.modules[type(module).__module__]  # its apply_rotary_pos_emb and eager attention
    # under the engine's paged attention the rotary embedding is the attention's (Llama's formula), where the family
    # turns heads as Llama does (Qwen3 turns them after its per-head norms, in its own code)
    probe = torch.arange(4.0)
    module.fused_rotary = (not hasattr(module, "q_norm") and module.head_dim % 2 == 0
                           and torch.equal(module.model_code.rotate_half(probe), llama.rotate_half(probe)))
    module.forward = _fused_forward.__get__(module)


def _fused_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                   past_key_values=None, **kwargs):
    """The model's attention forward pass with one projection: [B, T, hidden] -> ([B, T, hidden], weights).

    With the engine's paged attention or any other transformers attention (the offline bench runs the same
    weights through `generate` with sdpa and a KV cache of transformers' own)."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    qkv = self.qkv_proj(hidden_states)
    cos, sin = position_embeddings
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over each head of q and k, before the rotary embedding
        q, k, v = (t.view(hidden_shape) for t in qkv.split(self.qkv_sizes, dim=-1))
        q, k, v = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = self.model_code.apply_rotary_pos_emb(q, k, cos, sin)
    elif (self.fused_rotary and past_key_values is None and cos.shape[-1] == self.head_dim
          and self.config._attn_implementation == ATTN_IMPLEMENTATION):
        # the engine's paged attention turns them as it reads the queries and writes the keys (a rotary embedding
        # as wide as the heads)
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in qkv.split(self.qkv_sizes, dim=-1))
        kwargs["rotary"] = (cos[0], sin[0])
    else:  # q's and k's heads turned together, as apply_rotary_pos_emb turns each: one kernel where compiled
        q_size, k_size, v_size = self.qkv_sizes
        qk, v = (t.view(hidden_shape).transpose(1, 2) for t in qkv.split([q_size + k_size, v_size], dim=-1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qk = qk * cos + self.model_code.rotate_half(qk) * sin
        q, k = qk.split([q_size // self.head_dim, k_size // self.head_dim], dim=1)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    # the engine's paged attention is registered there too (attention.py), as the model's own forward finds it
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      self.model_code.eager_attention_forward)
    out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, sliding_window=self.fused_sliding_window,
                             **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
