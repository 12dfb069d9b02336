"""`bench kernel`: the float64 correctness gate, statistics and FLOP formulas against known answers, CSV and store."""

import csv
import math

import pytest
import sqlalchemy as sa
import torch

from service.bench.kernel import ops
from service.bench.kernel.cli import CSV_FIELDS, main
from service.bench.kernel.roofline import (attended_pairs, attention_bytes, attention_flops, device_peak, statistics,
                                        throughput)
from service.bench.store import schema

SMALL = ["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--context", "24", "--batch", "2", "--threads", "1"]


def test_statistics_of_known_samples():
    s = statistics([4.0, 1.0, 3.0, 2.0])
    assert s == {"mean": 2.5, "median": 2.5, "std": pytest.approx(math.sqrt(5 / 3)), "min": 1.0, "max": 4.0,
                 "p5": pytest.approx(1.15), "p95": pytest.approx(3.85)}
    assert statistics([0.5])["std"] == 0.0


def test_flop_and_byte_formulas_against_hand_counts():
    prefill = ops.Shape("prefill", batch=2, heads=3, kv_heads=1, head_dim=4, context=5, dtype="fp32")
    decode = ops.Shape("decode", batch=2, heads=3, kv_heads=1, head_dim=4, context=5, dtype="bf16")
    assert attended_pairs(prefill) == 15 and attended_pairs(decode) == 5  # 1+2+3+4+5 keys for the 5 queries
    assert attention_flops(prefill) == 4 * 4 * 2 * 3 * 15 == 1440  # two products, 2 FLOPs per multiply-add
    assert attention_flops(decode) == 480
    assert attention_bytes(prefill) == 4 * (2 * 2 * 3 * 5 * 4 + 2 * 2 * 1 * 5 * 4)  # Q and O, K and V
    assert attention_bytes(decode) == 2 * (2 * 2 * 3 * 1 * 4 + 2 * 2 * 1 * 5 * 4)


def test_attended_pairs_equal_the_causal_masks_true_entries():
    shape = ops.Shape("prefill", 1, 1, 1, 1, 37, "fp32")
    keep = torch.arange(37) <= torch.arange(37)[:, None]
    assert int(keep.sum()) == attended_pairs(shape)


def test_throughput_and_share_of_an_h100s_peak():
    shape = ops.Shape("decode", 1, 1, 1, 1000, 1000, "bf16")  # 4e6 FLOPs, 2 * (2*1000 + 2*10^6) bytes
    t = throughput(shape, 1e-6, "NVIDIA H100 80GB HBM3")
    assert t["tflops"] == pytest.approx(4.0) and t["flops_share"] == pytest.approx(4.0 / 989)
    assert t["gbps"] == pytest.approx(4004.0) and t["bandwidth_share"] == pytest.approx(4004.0 / 3350)
    assert device_peak("CPU, 1 threads", "fp32") == (None, None)


def _rows(url, table):
    with sa.create_engine(url).connect() as conn:
        return [r._asdict() for r in conn.execute(sa.select(table).order_by(table.c.id))]


def test_a_wrong_kernel_is_caught_and_never_timed(monkeypatch, tmp_path):
    calls = []

    def forgets_the_causal_mask(shape, q, k, v):
        def run():
            calls.append(1)
            return ops.reference(q, k, v, causal=False)
        return run

    monkeypatch.setitem(ops.OPS, "wrong", forgets_the_causal_mask)
    db = f"sqlite:///{tmp_path / 'k.db'}"
    rows = main(SMALL + ["--ops", "wrong,reference", "--phases", "prefill", "--iterations", "5", "--warmup", "2",
                         "--db", db, "--csv", str(tmp_path / "k.csv")])
    wrong, ref = rows
    assert wrong["status"].startswith("wrong: max abs error ") and wrong["status"].endswith(" > 0.001, not timed")
    assert wrong["max_abs_error"] > 0.1 and "seconds" not in wrong and len(calls) == 1  # the gate's call only
    assert ref["status"] == "ok" and len(ref["seconds"]) == 5
    runs = _rows(db, schema.runs)
    assert [(r["status"], r["error"]) for r in runs] == [("failed", f"RuntimeError: {wrong['status']}"), ("ok", None)]
    assert [(m["run_id"], m["metric"]) for m in _rows(db, schema.measurements) if m["run_id"] == runs[0]["id"]] == [
        (runs[0]["id"], "max_abs_error")]
    with open(tmp_path / "k.csv") as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == CSV_FIELDS
    assert lines[0]["status"] == wrong["status"] and lines[0]["median_ms"] == ""
    assert float(lines[1]["median_ms"]) == ref["median"] * 1e3 and float(lines[1]["relative_to_baseline"]) == 1.0


def test_every_cpu_operation_passes_the_gate_or_is_skipped_with_a_reason_and_the_store_holds_each_repeat(tmp_path):
    db = f"sqlite:///{tmp_path / 'k.db'}"
    rows = main(SMALL + ["--iterations", "3", "--warmup", "1", "--db", db, "--plot", str(tmp_path / "k.png")])
    status = {(r["op"], r["phase"]): r["status"].split(":")[0] for r in rows}
    for phase in ("prefill", "decode"):
        for op in ("paged", "sdpa-flash", "sdpa-math", "reference"):
            assert status[(op, phase)] == "ok"
        for op in ("sdpa-efficient", "sdpa-cudnn", "flex", "cudnn-paged", "flashinfer", "flashinfer-fa2"):
            assert status[(op, phase)] == "skipped"
    assert (tmp_path / "k.png").stat().st_size > 10_000
    runs = _rows(db, schema.runs)
    assert [(r["config"]["op"], r["config"]["phase"], r["status"]) for r in runs] == [
        (r["op"], r["phase"], "ok" if r["status"] == "ok" else "failed") for r in rows]
    assert runs[0]["config"] == {"op": "paged", "phase": "prefill", "batch": 2, "heads": 4, "kv_heads": 2,
                                 "head_dim": 16, "context": 24, "dtype": "fp32", "device": "cpu", "warmup": 1,
                                 "repeats": 3, "flush_l2": True}
    stored = [(m["run_id"], m["metric"], m["unit"], m["iteration"], m["value"]) for m in _rows(db, schema.measurements)]
    expected = []
    for r in rows:
        if "max_abs_error" in r:
            expected.append((r["run_id"], "max_abs_error", None, 0, r["max_abs_error"]))
        expected += [(r["run_id"], "kernel_seconds", "s", i, s) for i, s in enumerate(r.get("seconds", []))]
    assert stored == expected


@pytest.mark.parametrize("flag, value, status", [
    ("--kv-heads", "3", "skipped: query heads (4) must be a multiple of KV heads (3)"),
    ("--dtype", "fp8", "skipped: dtype must be one of fp32, fp16, bf16, got 'fp8'"),
])
def test_an_unsupported_shape_is_a_skipped_row_with_its_reason(flag, value, status, tmp_path):
    args = SMALL + ["--ops", "reference", "--phases", "decode", "--iterations", "1", "--db", str(tmp_path / "k.db")]
    [row] = main(args + [flag, value])  # the later flag wins
    assert row["status"] == status


def test_an_unknown_operation_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--ops", "sdpa-flash,warp-speed"])
    assert exc.value.code == 2
    assert "unknown operation 'warp-speed': use paged, sdpa-flash" in capsys.readouterr().err


def test_the_serving_preset_names_the_engines_shapes_under_load():
    from service.bench.kernel.cli import parse_args

    shapes = parse_args(["--preset", "serving", "--dtype", "bf16"]).shapes
    assert {(s.heads, s.kv_heads, s.head_dim) for s in shapes} == {(32, 8, 64), (32, 8, 128)}
    assert sorted({(s.phase, s.batch, s.context) for s in shapes}) == [
        ("decode", 256, 512), ("decode", 256, 1024), ("decode", 256, 2048), ("prefill", 4, 1024), ("prefill", 4, 4096)]
    assert len(shapes) == 10 and {s.dtype for s in shapes} == {"bf16"}


def test_the_preset_refuses_shape_flags_it_would_ignore(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--preset", "serving", "--batch", "8", "--context", "64"])
    assert exc.value.code == 2
    assert "--preset names the shapes itself: drop --batch, --context" in capsys.readouterr().err
