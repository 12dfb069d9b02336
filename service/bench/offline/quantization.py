"""Quantization measured in one process: weight memory, offline throughput against the unquantized engine (modes
alternating, so machine load hits all alike), greedy agreement with it, and perplexity.

A W8A8 mode with the suffix `:sim` (`fp8-w8a8:sim`) runs its float32 reference instead of its kernels: the
quality of fp8-w8a8 measured on a CPU, which cannot serve it (its speed then means nothing).

Perplexity is over a text the repository ships: chapter I of Lewis Carroll's "Alice's Adventures in
Wonderland" (1865, public domain; Project Gutenberg eBook #11, Millennium Fulcrum Edition 3.0).
"""

import dataclasses
import math
from pathlib import Path

import torch

from service.engine import EngineConfig, LLMEngine, SamplingParams
from service.engine.config import dtype_name, resolve_dtype
from service.engine.models import LoadedModel, load_model
from service.engine.quant.quantization import W8A8_MODES, check, describe, quantize, weight_bytes

TEXT = Path(__file__).parent.parent / "data" / "alice_chapter1.txt"

# the fixed prompt set of the agreement measure: short questions of several kinds, sent as chat
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "What is 17 plus 25?",
    "Give a synonym for 'happy'.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "List the days of the week.",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
    "What does HTTP stand for?",
]


SIMULATED = ":sim"
# random weights predict nothing: how often two modes pick the same greedy token (fp8-w8a8 against none: 0.003)
# and how well either predicts a text mean nothing there; shown as this, null in the JSON, not stored
NO_QUALITY = "n/a (random weights)"


def check_mode(mode: str, device: torch.device, dtype: str) -> None:
    """`check` for a mode of the comparison: a simulated one needs only to be a W8A8 mode."""
    base = mode.removesuffix(SIMULATED)
    if base != mode and base not in W8A8_MODES:
        raise ValueError(f"only the W8A8 modes ({', '.join(W8A8_MODES)}) have a float32 simulation, not {base}")
    if base == mode:
        check(mode, device, resolve_dtype(dtype, device, mode))


def load_simulated(spec: str, mode: str, device: torch.device, dtype: str = "auto", cache_dir: str | None = None,
                   seed: int = 0) -> LoadedModel:
    """The model with the W8A8 scheme of `mode` (`fp8-w8a8:sim`) simulated in float32 in its linear layers."""
    loaded = load_model(spec, resolve_dtype(dtype, device), device, cache_dir, seed)
    quantize(loaded.model, mode.removesuffix(SIMULATED), device, simulate=True)
    loaded.quantization = mode
    return loaded


def engine_for(config: EngineConfig, mode: str) -> LLMEngine:
    """An engine over its own copy of the weights, quantized in `mode` (simulated in float32 with `:sim`)."""
    config = dataclasses.replace(config, quantization=mode)
    if not mode.endswith(SIMULATED):
        return LLMEngine(config)
    loaded = load_simulated(config.model, mode, torch.device(config.device), config.dtype, config.cache_dir,
                            config.seed)
    return LLMEngine(config, loaded=loaded)


def scheme_entry(mode: str) -> dict:
    """What a stored configuration says of a mode's scheme (weights, activations, granularity). Only the W8A8 modes
    carry it: the configurations, and hashes, stored for the other modes before it existed stay the same."""
    base = mode.removesuffix(SIMULATED)
    if base not in W8A8_MODES:
        return {}
    return {"quantization_scheme": describe(base) + (", simulated in float32" if base != mode else "")}


def prompt_ids(engine: LLMEngine, prompts: list[str] = PROMPTS) -> list[list[int]]:
    """The prompts as token ids, wrapped in the model's chat template when it has one."""
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False) for p in prompts]
    return [engine.tokenize(p) for p in prompts]


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations through the engine (paged cache, continuous batching), all prompts at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [out["token_ids"] for out in engine.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Share of output positions where both generated the same token (after a divergence, most differ)."""
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    return same / sum(len(r) for r in reference)


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int = 512) -> float:
    """exp of the mean next-token loss over consecutive windows of the text (transformers' own loss, sdpa)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    nll, count = 0.0, 0
    try:
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window]], device=model.device)
            if chunk.shape[1] < 2:
                break
            n = chunk.shape[1] - 1
            nll += model(input_ids=chunk, labels=chunk, use_cache=False).loss.item() * n
            count += n
    finally:
        model.set_attn_implementation(previous)
    return math.exp(nll / count)


def compare(engines: dict[str, LLMEngine], prompts: list[list[int]], output_lens: list[int], repeats: int,
            run_engine) -> list[dict]:
    """One row per mode; `engines` maps each mode to an engine over its own copy of the weights, "none" first."""
    modes = list(engines)
    seconds = {m: [] for m in modes}
    for _ in range(repeats):  # alternating: a burst of machine load hits every mode
        for mode in modes:
            seconds[mode].append(run_engine(engines[mode], prompts, output_lens)["seconds"])
        print("  throughput round:", {m: round(s[-1], 2) for m, s in seconds.items()}, flush=True)
    base = modes[0]
    for engine in engines.values():
        engine.runner.uncompile()  # perplexity runs the model with transformers' own attention
    quality = not engines[base].config.model.startswith("random:")
    if quality:
        questions = prompt_ids(engines[base])
        reference = greedy(engines[base], questions, 32)
        text = engines[base].tokenize(TEXT.read_text())
    rows = []
    runner = engines[base].runner
    base_bytes = weight_bytes(runner.model)
    kv_token_bytes = runner.kv_cache_bytes / (runner.num_blocks * runner.block_size)
    for mode in modes:
        engine = engines[mode]
        ratios = sorted(b / s for b, s in zip(seconds[base], seconds[mode]))
        row = {"quantization": mode, "dtype": dtype_name(engine.runner.dtype),
               "weight_bytes": weight_bytes(engine.runner.model),
               "seconds": sorted(seconds[mode])[repeats // 2], "runs": seconds[mode],
               "output_tokens": sum(output_lens), "speed_vs_none": ratios[repeats // 2],
               "greedy_agreement": agreement(reference, greedy(engine, questions, 32)) if quality else None,
               "perplexity": perplexity(engine.runner.model, text) if quality else None}
        row["tokens_per_second"] = row["output_tokens"] / row["seconds"]
        # the weight memory a mode saves, as tokens of KV cache it would hold instead (the same cache layout)
        row["kv_tokens_gained"] = round((base_bytes - row["weight_bytes"]) / kv_token_bytes)
        rows.append(row)
        print(f"  {mode}: measured", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]["weight_bytes"]
    lines = ["| quantization | dtype | weight MiB | weights vs none | KV tokens gained | output tok/s (median) "
             "| speed vs none (median ratio) | greedy agreement | perplexity |", "|---|---|---|---|---|---|---|---|---|"]
    shown = lambda value, spec: NO_QUALITY if value is None else format(value, spec)
    for r in rows:
        lines.append(f"| {r['quantization']} | {r['dtype']} | {r['weight_bytes'] / 2**20:.1f} | {r['weight_bytes'] / base:.2f} | "
                     f"{r['kv_tokens_gained']:,} | {r['tokens_per_second']:,.1f} | {r['speed_vs_none']:.2f} | "
                     f"{shown(r['greedy_agreement'], '.3f')} | {shown(r['perplexity'], '.2f')} |")
    return "\n".join(lines)
