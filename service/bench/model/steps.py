"""One configuration of `bench model`: build a random-weight model, time forward / backward / optimizer phases.

fwd runs without autograd (inference); fwd+bwd and train set gradients to None every step, so each step
starts from the same memory. On CUDA every timed section is bracketed by torch.cuda.synchronize().
"""

import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from service.bench.model.measure import PeakMemory
from service.engine.models import PRESETS

PHASES = ("forward", "backward", "optimizer")


def model_config(size: str):
    """A preset name (`small`, `random:small`) or a local Hugging Face folder; ValueError naming the presets."""
    preset = size.split(":", 1)[1] if size.startswith("random:") else size
    if preset in PRESETS:
        return LlamaConfig(**PRESETS[preset], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if os.path.isfile(os.path.join(size, "config.json")):
        return AutoConfig.from_pretrained(size)
    raise ValueError(f"unknown model size {size!r}: use a preset ({', '.join(PRESETS)}) or a local model folder")


def build_model(config, device: torch.device, attention: str, quantization: str = "none",
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Random weights straight on the device (on `meta` it costs nothing: used to count parameters).

    Unquantized models hold fp32 weights (bf16 is autocast); a quantized one is built in `dtype` and its linear
    layers quantized the way the engine does it.
    """
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                 dtype=torch.float32 if quantization == "none" else dtype)
    if quantization != "none":
        from service.engine.quant.quantization import quantize
        quantize(model.eval(), quantization, device)
        return model
    return model.train()


@dataclass
class Case:
    size: str
    context: int
    batch: int
    mode: str  # fwd, fwd+bwd, train
    precision: str  # fp32, bf16 (autocast)
    compile: bool
    quantization: str = "none"  # weight-only, forward only: none, int8, int4, fp8

    @property
    def key(self) -> str:
        """A file name: a model folder's own name, not its path."""
        name = os.path.basename(self.size.rstrip("/"))
        return (f"{name}-c{self.context}-b{self.batch}-{self.mode}-{self.precision}" + ("-compiled" * self.compile)
                + (f"-{self.quantization}" if self.quantization != "none" else ""))

    @property
    def weights(self) -> tuple[str, torch.dtype]:
        """The model a case runs on: fp32 weights (bf16 autocast) unquantized, else quantized in its precision."""
        if self.quantization == "none":
            return "none", torch.float32
        return self.quantization, torch.bfloat16 if self.precision == "bf16" else torch.float32


@dataclass
class Result:
    times: dict[str, list[float]] = field(default_factory=dict)  # phase -> seconds per measured step
    peak_bytes: int | None = None


def summary(values: list[float]) -> dict[str, float]:
    """mean, sample standard deviation, min, max."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(model: torch.nn.Module, case: Case, device: torch.device, warmup: int, steps: int,
             memory: PeakMemory, profile_dir: str | None = None, snapshot_dir: str | None = None) -> Result:
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(vocab, (case.batch, case.context + 1), device=device, generator=gen)
    inputs, targets = ids[:, :-1], ids[:, 1:].reshape(-1)
    forward = torch.compile(model) if case.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if case.mode == "train" else None
    grad = contextlib.nullcontext if case.mode != "fwd" else torch.no_grad

    def step(times: dict[str, list[float]] | None) -> None:
        clock = {}
        _sync(device)
        clock["start"] = time.perf_counter()
        with grad(), torch.autocast(device.type, dtype=torch.bfloat16,
                                             enabled=case.precision == "bf16" and case.quantization == "none"):
            logits = forward(input_ids=inputs, use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), targets)
        _sync(device)
        clock["forward"] = time.perf_counter()
        if case.mode != "fwd":
            loss.backward()
            _sync(device)
            clock["backward"] = time.perf_counter()
        del logits, loss
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            clock["optimizer"] = time.perf_counter()
        else:
            model.zero_grad(set_to_none=True)
        if times is not None:
            marks = list(clock.values())
            for phase, (a, b) in zip(list(clock)[1:], zip(marks, marks[1:])):
                times.setdefault(phase, []).append(b - a)

    try:
        for _ in range(warmup):
            step(None)
        result = Result()
        if snapshot_dir:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        memory.start()
        for _ in range(steps):
            step(result.times)
        result.peak_bytes = memory.peak()
        if snapshot_dir:
            os.makedirs(snapshot_dir, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(snapshot_dir, f"{case.key}.pickle"))
        if profile_dir:
            _profile_one_step(step, device, os.path.join(profile_dir, f"{case.key}.json"))
        return result
    finally:
        if snapshot_dir:
            torch.cuda.memory._record_memory_history(enabled=None)
        if optimizer is not None:
            optimizer.state.clear()
        model.zero_grad(set_to_none=True)


def _profile_one_step(step, device: torch.device, path: str) -> None:
    """One more step under torch.profiler, written as a Chrome trace (chrome://tracing, Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
        step(None)
    prof.export_chrome_trace(path)
