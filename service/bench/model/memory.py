"""Training-memory calculator for the Llama-architecture models of `bench model`, from the configuration alone.

Activations are what autograd saves for backward in transformers' Llama code, tensor by tensor (checked
against saved-tensor hooks in the tests), for fp32 or bf16 autocast and eager or SDPA attention.
Parameters, gradients and AdamW state stay fp32 under autocast; autocast keeps a bf16 copy of each
linear weight for as long as the forward's graph lives.
"""

from dataclasses import dataclass, field, replace

GIB = 2**30


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False

    @classmethod
    def from_config(cls, config) -> "Shape":
        """From a transformers Llama-style config (or the dict of a preset)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in needed if not get(k)]
        if missing:
            raise ValueError(f"the memory calculator needs a Llama-style config; this one lacks {', '.join(missing)}")
        heads = get("num_attention_heads")
        return cls(vocab=get("vocab_size"), hidden=get("hidden_size"), intermediate=get("intermediate_size"),
                   layers=get("num_hidden_layers"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads,
                   tied=bool(get("tie_word_embeddings", False)))


def parameter_counts(s: Shape) -> dict[str, int]:
    """Parameters by part: no biases, SwiGLU FFN (gate, up, down), two RMSNorm weights per layer."""
    attention = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    ffn = 3 * s.hidden * s.intermediate
    counts = {"embedding": s.vocab * s.hidden, "attention": s.layers * attention, "ffn": s.layers * ffn,
              "norms": s.layers * 2 * s.hidden + s.hidden, "lm_head": 0 if s.tied else s.vocab * s.hidden}
    counts["total"] = sum(counts.values())
    return counts


@dataclass
class Estimate:
    shape: Shape
    batch: int
    context: int
    precision: str
    mode: str
    attention: str
    parameters: int
    bytes: dict[str, int]  # component -> bytes held at the peak
    per_layer: dict[str, int] = field(default_factory=dict)  # activation bytes of one layer, by part
    head: dict[str, int] = field(default_factory=dict)  # activation bytes outside the layers
    peak_at: str = ""  # forward, start of backward, end of backward, optimizer step

    @property
    def peak(self) -> int:
        return sum(self.bytes.values())


MODES = ("fwd", "fwd+bwd", "train")
PRECISIONS = ("fp32", "bf16")
ATTENTIONS = ("sdpa", "eager")


def _layer_activations(s: Shape, tokens: int, context: int, bf16: bool, attention: str) -> dict[str, int]:
    """Bytes autograd saves in one decoder layer (tokens = batch x context)."""
    d, q_dim = s.hidden, s.heads * s.head_dim
    lo = 2 if bf16 else 4  # matmul inputs and outputs under autocast; the residual stream and norms stay fp32
    # eager attention repeats grouped K/V heads into new tensors; SDPA takes them as they are
    kv_dim = (s.kv_heads if attention == "sdpa" else s.heads) * s.head_dim
    # each RMSNorm saves its input, rsqrt (one per token) and the normalized input; its output feeds the
    # projections, which save it once in fp32, or under autocast each its own bf16 copy (q, k, v; gate, up)
    norm_out = (3 + 2) * d * 2 if bf16 else 2 * d * 4
    parts = {
        "layer input and residual": 2 * d * 4,
        "RMSNorm (rsqrt, normalized, output)": 2 * (d + 1) * 4 + norm_out,
        "attention q, k, v": (q_dim + 2 * kv_dim) * lo,
        "attention output": q_dim * lo,
        "FFN intermediates (gate, SiLU, up, product)": 4 * s.intermediate * lo,
    }
    if attention == "eager":  # softmax output (fp32), plus its bf16 copy for the second matmul under autocast
        parts["attention scores/softmax"] = s.heads * context * (4 + (2 if bf16 else 0))
    else:  # fused kernels keep only the log-sum-exp per query and head
        parts["attention scores/softmax"] = s.heads * 4
    return {k: v * tokens for k, v in parts.items()}


def estimate(s: Shape, batch: int, context: int, precision: str = "fp32", mode: str = "train",
             attention: str = "sdpa", foreach_adamw: bool = True) -> Estimate:
    """Bytes held at the peak of one step of `mode` (fwd runs without grad; fwd+bwd and train from scratch grads).

    Candidates for the peak: the forward's working set; the start of backward (every saved activation, bf16
    weight copies, the logits and their gradients); its end (every gradient; the graph and its copies are
    gone); and, in train, the optimizer step (gradients plus the foreach implementation's temporary of one
    parameter size, or the for-loop one's largest tensor). AdamW's two states are held throughout.
    """
    if precision not in PRECISIONS or mode not in MODES or attention not in ATTENTIONS:
        raise ValueError(f"precision in {PRECISIONS}, mode in {MODES}, attention in {ATTENTIONS}")
    bf16 = precision == "bf16"
    counts = parameter_counts(s)
    n, tokens = counts["total"], batch * context
    linear = counts["attention"] + counts["ffn"] + (counts["lm_head"] or counts["embedding"])
    copies = {"bf16 weight copies (autocast)": 2 * linear} if bf16 else {}
    logits_bytes = tokens * s.vocab * 4
    held = {"parameters": 4 * n}
    per_layer = _layer_activations(s, tokens, context, bf16, attention)
    rope = 2 * context * s.head_dim * 4  # cos and sin, shared by all layers
    head = {"token ids, rotary cos/sin": tokens * 8 + rope,
            "final RMSNorm": tokens * ((2 * s.hidden + 1) * 4 + (s.hidden * 2 if bf16 else s.hidden * 4)),
            "logits (log-softmax) and loss": logits_bytes + 4}
    if mode == "fwd":
        # no graph: only the largest working set is alive; in a layer the residual, the norm's output and three
        # FFN tensors (SiLU output, up, their product; eager: two score tensors too), at the end the logits,
        # their fp32 copy and the log-softmax
        lo = 2 if bf16 else 4
        layer = tokens * (3 * s.intermediate * lo + 3 * s.hidden * 4)
        if attention == "eager":
            layer = max(layer, tokens * (2 * s.heads * context * 4 + 3 * s.hidden * 4))
        head_ws = logits_bytes * 2 + tokens * s.vocab * (2 if bf16 else 0)
        held |= copies | ({"working set (logits, log-softmax)": head_ws} if head_ws >= layer else
                          {"working set (one layer)": layer})
        return Estimate(s, batch, context, precision, mode, attention, n, held, peak_at="forward")
    activations = s.layers * sum(per_layer.values()) + sum(head.values())
    # held logits (bf16 or fp32), the log-softmax's and the logits' gradients, lm_head's weight gradient
    grads_of_logits = tokens * s.vocab * (2 if bf16 else 4) + 2 * logits_bytes + 4 * s.vocab * s.hidden
    candidates = {"start of backward": copies | {"activations": activations,
                                                 "logits and their gradients": grads_of_logits},
                  "end of backward": {"gradients": 4 * n}}
    if mode == "train":
        held["AdamW state (exp_avg, exp_avg_sq)"] = 8 * n
        largest = 4 * max(s.vocab * s.hidden, s.hidden * s.intermediate, s.hidden * s.heads * s.head_dim)
        candidates["optimizer step"] = {"gradients": 4 * n, "optimizer step temporaries": 4 * n if foreach_adamw
                                        else largest}
    peak_at = max(candidates, key=lambda k: sum(candidates[k].values()))
    return Estimate(s, batch, context, precision, mode, attention, n, held | candidates[peak_at], per_layer, head,
                    peak_at)


DEQUANTIZING = ("int8", "fp8")  # torchao's eager weight-only matmul for these dequantizes the weight first


def with_weights(e: Estimate, weight_bytes: int, quantization: str) -> Estimate:
    """A forward estimate for a model whose weights take `weight_bytes` (quantized, in the compute dtype: no
    autocast copies). int8 and fp8 multiply with a dequantized copy of the weight, one layer at a time (seen
    on CPU: measured peaks exceed the plain estimate by the largest weight in the compute dtype)."""
    s = e.shape
    held = {"parameters (as stored, quantized)": weight_bytes}
    held |= {k: v for k, v in e.bytes.items() if k not in ("parameters", "bf16 weight copies (autocast)")}
    if quantization in DEQUANTIZING:
        largest = max(s.hidden * s.intermediate, s.hidden * s.heads * s.head_dim)
        held["dequantized weight (matmul temporary)"] = largest * (2 if e.precision == "bf16" else 4)
    return replace(e, bytes=held)


def activation_bytes(e: Estimate) -> int:
    """Everything autograd saves in one forward pass (the layers and the rest)."""
    return e.shape.layers * sum(e.per_layer.values()) + sum(e.head.values())


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB" if x >= GIB / 10 else f"{x / 2**20:,.2f} MiB"


def format_breakdown(e: Estimate, name: str = "") -> str:
    """A readable breakdown, like the reference's 2.7B fp32 example."""
    s, counts = e.shape, parameter_counts(e.shape)
    lines = [f"memory of {name or 'the model'}: batch {e.batch}, context {e.context}, {e.precision}, "
             f"{e.mode}, {e.attention} attention",
             f"  parameters: {e.parameters:,} = {_gib(4 * e.parameters)} (fp32)",
             "    " + ", ".join(f"{k} {v:,}" for k, v in counts.items() if k != "total" and v)]
    train = e.mode != "fwd"
    lines.append(f"  gradients: {_gib(4 * e.parameters) if train else '-'}")
    lines.append(f"  AdamW state (exp_avg + exp_avg_sq = 2 x parameters): "
                 f"{_gib(8 * e.parameters) if e.mode == 'train' else '-'}")
    if train:
        lines.append(f"  activations saved for backward: {_gib(activation_bytes(e))}")
        lines.append(f"    per layer (x {s.layers}): {_gib(sum(e.per_layer.values()))}")
        lines += [f"      {k}: {_gib(v)}" for k, v in e.per_layer.items()]
        lines += [f"    {k}: {_gib(v)}" for k, v in e.head.items()]
    lines.append(f"  peak ({e.peak_at}): {_gib(e.peak)} = " + " + ".join(f"{k} {_gib(v)}" for k, v in e.bytes.items()))
    return "\n".join(lines)
