"""Quantization measured in one process: weight memory, offline throughput against the unquantized engine (modes
alternating, so machine load hits all alike), greedy agreement with it, top-1 agreement with it under teacher
forcing, and perplexity. A W8A8 mode of a checkpoint is measured smoothed and unsmoothed (engine/quant/smoothing.py).

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
SMOOTHED = "smoothquant, calibrated at load"  # what a stored configuration says of a smoothed run
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
                   seed: int = 0, smoothing: bool = True) -> LoadedModel:
    """The model with the W8A8 scheme of `mode` (`fp8-w8a8:sim`) simulated in float32 in its linear layers (smoothed
    first, as the mode's kernels would be, unless `smoothing` is off or the weights are random)."""
    loaded = load_model(spec, resolve_dtype(dtype, device), device, cache_dir, seed)
    calibrate = smoothing and not spec.startswith("random:")
    quantize(loaded.model, mode.removesuffix(SIMULATED), device, simulate=True,
             tokenizer=loaded.tokenizer if calibrate else None)
    loaded.quantization = mode
    return loaded


def engine_for(config: EngineConfig, mode: str, smoothing: bool = True) -> LLMEngine:
    """An engine over its own copy of the weights, quantized in `mode` (simulated in float32 with `:sim`), smoothed
    first in a W8A8 mode unless `smoothing` is off."""
    config = dataclasses.replace(config, quantization=mode, smoothing=smoothing)
    if not mode.endswith(SIMULATED):
        return LLMEngine(config)
    loaded = load_simulated(config.model, mode, torch.device(config.device), config.dtype, config.cache_dir,
                            config.seed, smoothing)
    return LLMEngine(config, loaded=loaded)


def variants(model: str, modes: list[str]) -> list[tuple[str, str, bool]]:
    """(label, mode, smoothing) of each row of a comparison: a W8A8 mode of a checkpoint twice, smoothed and not (the
    label says "unsmoothed"); random weights are never smoothed, so their modes once."""
    rows = []
    for mode in modes:
        rows.append((mode, mode, True))
        if mode.removesuffix(SIMULATED) in W8A8_MODES and not model.startswith("random:"):
            rows.append((f"{mode} unsmoothed", mode, False))
    return rows


def scheme_entry(mode: str, smoothed: bool = False) -> dict:
    """What a stored configuration says of a mode's scheme (weights, activations, granularity), and `smoothed`: whether
    SmoothQuant was applied (engine/quant/smoothing.py). Only the W8A8 modes carry it, and smoothing only where
    applied: the configurations, and hashes, stored before either existed stay the same, and a smoothed run's
    differs from an unsmoothed one's, so `bench regress` never compares the two."""
    base = mode.removesuffix(SIMULATED)
    if base not in W8A8_MODES:
        return {}
    entry = {"quantization_scheme": describe(base) + (", simulated in float32" if base != mode else "")}
    if smoothed:
        entry["smoothing"] = SMOOTHED
    return entry


def smoothed(model: str, mode: str, smoothing: bool) -> bool:
    """Whether a run of `model` in `mode` is smoothed: a W8A8 mode, smoothing on, and weights that are not random."""
    return smoothing and mode.removesuffix(SIMULATED) in W8A8_MODES and not model.startswith("random:")


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
def text_scores(model, ids: list[int], reference: torch.Tensor | None = None,
                window: int = 512) -> tuple[float, torch.Tensor, float | None]:
    """Teacher forcing over consecutive windows of the text (transformers' own forward, sdpa): the perplexity (exp of
    the mean next-token loss), each position's top-1 token, and the share of positions whose top-1 token equals
    `reference`'s (the unquantized model's), when given: a steadier measure than free-running greedy agreement,
    where one flipped token changes the rest of an answer."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    nll, count, top = 0.0, 0, []
    try:
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window]], device=model.device)
            if chunk.shape[1] < 2:
                break
            n = chunk.shape[1] - 1
            out = model(input_ids=chunk, labels=chunk, use_cache=False)
            nll += out.loss.item() * n
            count += n
            top.append(out.logits[0, :-1].argmax(-1).cpu())
    finally:
        model.set_attn_implementation(previous)
    top = torch.cat(top)
    agreement = (top == reference).float().mean().item() if reference is not None else None
    return math.exp(nll / count), top, agreement


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
        reference_top = text_scores(engines[base].runner.model, text)[1]
    rows = []
    runner = engines[base].runner
    base_bytes = weight_bytes(runner.model)
    kv_token_bytes = runner.kv_cache_bytes / (runner.num_blocks * runner.block_size)
    for mode in modes:
        engine = engines[mode]
        ratios = sorted(b / s for b, s in zip(seconds[base], seconds[mode]))
        row = {"quantization": mode, "label": mode, "dtype": dtype_name(engine.runner.dtype),
               "weight_bytes": weight_bytes(engine.runner.model),
               "seconds": sorted(seconds[mode])[repeats // 2], "runs": seconds[mode],
               "output_tokens": sum(output_lens), "speed_vs_none": ratios[repeats // 2],
               "greedy_agreement": agreement(reference, greedy(engine, questions, 32)) if quality else None}
        row["perplexity"], _, row["forced_agreement"] = text_scores(engine.runner.model, text, reference_top) \
            if quality else (None, None, None)
        row["tokens_per_second"] = row["output_tokens"] / row["seconds"]
        # the weight memory a mode saves, as tokens of KV cache it would hold instead (the same cache layout)
        row["kv_tokens_gained"] = round((base_bytes - row["weight_bytes"]) / kv_token_bytes)
        rows.append(row)
        print(f"  {mode}: measured", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]["weight_bytes"]
    lines = ["| quantization | dtype | weight MiB | weights vs none | KV tokens gained | output tok/s (median) "
             "| speed vs none (median ratio) | greedy agreement | teacher-forced agreement | perplexity |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    shown = lambda value, spec: NO_QUALITY if value is None else format(value, spec)
    for r in rows:
        lines.append(f"| {r['label']} | {r['dtype']} | {r['weight_bytes'] / 2**20:.1f} | {r['weight_bytes'] / base:.2f} | "
                     f"{r['kv_tokens_gained']:,} | {r['tokens_per_second']:,.1f} | {r['speed_vs_none']:.2f} | "
                     f"{shown(r['greedy_agreement'], '.3f')} | {shown(r['forced_agreement'], '.3f')} | "
                     f"{shown(r['perplexity'], '.2f')} |")
    return "\n".join(lines)
