"""CUDA paths of `bench model` and `bench kernel` (imported by tests/cuda/test_cuda.py; skipped without a GPU)."""

import json
import pickle

import pytest
import torch

from service.bench.kernel.cli import main as kernel_main
from service.bench.model import cli as model_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


def test_bench_kernel_on_cuda_gates_and_times_every_operation(tmp_path):
    """Shapes of Llama-3.2-1B (32/8 heads of 64) and of the 2.7b preset (32 heads of 80), bf16 and fp32."""
    rows = kernel_main(["--heads", "32", "--kv-heads", "8,32", "--head-dim", "64,80", "--context", "256",
                        "--batch", "2", "--dtype", "bf16,fp32", "--warmup", "2", "--iterations", "5",
                        "--db", str(tmp_path / "k.db"), "--csv", str(tmp_path / "k.csv")])
    assert not [r for r in rows if r["status"].startswith("wrong")], [r["status"] for r in rows]
    paged = [r for r in rows if r["op"] == "paged"]
    assert len(paged) == 16 and all(r["status"] == "ok" for r in paged)  # the Triton kernel runs every shape
    assert all(r["status"] == "ok" for r in rows if r["op"] in ("reference", "sdpa-math"))
    assert any(r["op"] == "sdpa-flash" and r["status"] == "ok" for r in rows)
    name = torch.cuda.get_device_name()
    if "H100" in name or "H200" in name:
        assert all(r["flops_share"] is not None and r["bandwidth_share"] is not None for r in paged)


def _wide(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000}))
    return str(tmp_path)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_model_on_cuda_peak_is_near_the_calculators(precision, tmp_path):
    """Within 20%: max_memory_allocated also holds cuBLAS workspaces and kernels' scratch, which the
    calculator does not model, and the fused attention kernels' saved state differs a little by backend."""
    rows = model_cli.main(["--sizes", _wide(tmp_path), "--context", "512", "--batch", "4",
                              "--modes", "fwd,fwd+bwd,train", "--precision", precision, "--warmup", "2",
                              "--iterations", "3", "--db", str(tmp_path / "m.db")])
    for r in rows:
        assert r["status"] == "ok"
        assert 0.8 < r["peak_bytes"] / r["estimate"].peak < 1.2, (r["case"].mode, r["peak_bytes"], r["estimate"].peak)


def test_bench_model_on_cuda_compiled_with_snapshot_and_profile(tmp_path):
    rows = model_cli.main(["--sizes", "tiny", "--context", "128", "--modes", "train", "--precision", "bf16",
                              "--compile", "on", "--warmup", "2", "--iterations", "2", "--db", str(tmp_path / "m.db"),
                              "--memory-snapshot", str(tmp_path / "snap"), "--profile", str(tmp_path / "prof")])
    assert rows[0]["status"] == "ok" and set(rows[0]["times"]) == {"forward", "backward", "optimizer"}
    snapshot = pickle.loads((tmp_path / "snap" / "tiny-c128-b4-train-bf16-compiled.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]
    trace = json.loads((tmp_path / "prof" / "tiny-c128-b4-train-bf16-compiled.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])


def test_bench_model_on_cuda_out_of_memory_is_a_row_and_the_run_goes_on(monkeypatch, tmp_path):
    monkeypatch.setattr(model_cli, "FIT_SHARE", 100.0)  # let llama-8b's training step past the calculator
    rows = model_cli.main(["--sizes", "llama-8b,tiny", "--context", "128", "--batch", "1", "--modes", "train",
                              "--warmup", "1", "--iterations", "1", "--db", str(tmp_path / "m.db")])
    assert [r["status"] for r in rows] == ["out of memory", "ok"]
    assert torch.cuda.memory_allocated() < 2**30  # the 8B model and its state are gone


def test_bench_model_on_cuda_reports_what_cannot_fit_without_allocating(tmp_path):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rows = model_cli.main(["--sizes", "llama-8b", "--context", "4096", "--modes", "train",
                              "--db", str(tmp_path / "m.db")])
    assert rows[0]["status"].startswith("does not fit (") and torch.cuda.max_memory_allocated() < 2**30
