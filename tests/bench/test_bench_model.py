"""`bench model` and its memory calculator: parameter counts, saved activations, measured peaks, bad input, store."""

import json
import subprocess
import sys

import pytest
import sqlalchemy as sa
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from service.bench.model import memory
from service.bench.model.cli import main
from service.bench.model.steps import build_model, model_config
from service.bench.store import schema
from service.engine.models import PRESETS


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_parameter_count_equals_the_instantiated_models_for_every_preset(preset):
    config = model_config(preset)
    model = build_model(config, torch.device("meta"), "sdpa")  # meta: shapes only, even llama-8b costs nothing
    counted = memory.parameter_counts(memory.Shape.from_config(config))["total"]
    assert counted == sum(p.numel() for p in model.parameters())


def test_the_references_2_7b_count_and_fp32_state():
    e = memory.estimate(memory.Shape.from_config(PRESETS["2.7b"]), 4, 256, "fp32", "train")
    assert e.parameters == 3_406_809_600  # the reference document's figure
    assert (round(4 * e.parameters / memory.GIB, 2), round(8 * e.parameters / memory.GIB, 2)) == (12.69, 25.38)


def saved_activation_bytes(config, attention, precision, batch, context) -> int:
    """Bytes autograd saves in one forward (distinct storages), leaving out parameters and their bf16 copies."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).train()
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape)))
        return t

    ids = torch.randint(config.vocab_size, (batch, context))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits.reshape(-1, config.vocab_size).float(), ids.reshape(-1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {s for p in model.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1])}
    return sum(n for ptr, (n, dtype, shape) in seen.items()
               if ptr not in params and not (dtype == torch.bfloat16 and shape in weight_shapes))


@pytest.mark.parametrize("attention", memory.ATTENTIONS)
@pytest.mark.parametrize("precision", memory.PRECISIONS)
@pytest.mark.parametrize("kv_heads, tied", [(4, False), (2, True)], ids=["mha", "gqa-tied"])
def test_calculated_activations_equal_what_autograd_saves(attention, precision, kv_heads, tied):
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=300, tie_word_embeddings=tied,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    e = memory.estimate(memory.Shape.from_config(config), 3, 20, precision, "fwd+bwd", attention)
    assert memory.activation_bytes(e) == saved_activation_bytes(config, attention, precision, 3, 20)


def test_calc_only_prints_the_breakdown_of_the_largest_size_without_allocating(capsys):
    from service.bench.model.measure import rss_bytes
    before = rss_bytes()
    main(["--sizes", "2.7b", "--context", "256", "--modes", "train", "--calc-only"])
    assert rss_bytes() - before < 200 * 2**20  # 2.7b's parameters alone would be 12.7 GiB
    out = capsys.readouterr().out
    assert "parameters: 3,406,809,600 = 12.69 GiB (fp32)" in out
    assert "AdamW state (exp_avg + exp_avg_sq = 2 x parameters): 25.38 GiB" in out
    row = "| 2.7b | 3,406,809,600 | 256 | train | fp32 | 12.69 | 12.69 | 25.38 | 8.20 | 50.86 | optimizer step |"
    assert row in out  # on CPU AdamW's for-loop step needs only the largest tensor as a temporary


def _rows(url, table):
    with sa.create_engine(url).connect() as conn:
        return [r._asdict() for r in conn.execute(sa.select(table).order_by(table.c.id))]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """Memory in parameters and FFN activations, little compute: the peak dwarfs RSS's fixed costs (~30 MB)."""
    folder = tmp_path_factory.mktemp("wide")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1000}))
    return str(folder)


def _bench_model_in_a_fresh_process(*argv: str) -> subprocess.CompletedProcess:
    """RSS late in a long test process carries allocator slack and other tests' leftovers, as large as these small
    models' whole step (seen: 1.40-1.47x the prediction late in a CI run, 0.98-1.08x alone): measure in a new one."""
    done = subprocess.run([sys.executable, "-m", "service", "bench", "model", *argv],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_measured_cpu_peak_is_within_tolerance_and_every_step_is_stored(wide_model, tmp_path):
    """RSS growth must be within -5% / +30% of the prediction: the calculator counts tensors, RSS also holds the
    allocator's slack, oneDNN's scratch buffers and Python objects (tens of MB), so it reads high, never low."""
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    done = _bench_model_in_a_fresh_process(
        "--sizes", wide_model, "--context", "32", "--batch", "2", "--modes", "fwd,fwd+bwd,train", "--warmup", "1",
        "--iterations", "2", "--threads", "1", "--db", db, "--label", "t", "--json", str(tmp_path / "m.json"))
    rows = json.loads((tmp_path / "m.json").read_text())
    assert [(r["mode"], r["status"]) for r in rows] == [("fwd", "ok"), ("fwd+bwd", "ok"), ("train", "ok")]
    for r in rows:
        ratio = r["peak_bytes"] / r["predicted_bytes"]
        print(f"{r['mode']}: measured / predicted = {ratio:.3f}")
        # the calculator itself is checked to +0.3..+10.6% against CUDA max allocated on the H100 (docs/benchmarks.md)
        assert 0.95 < ratio < 1.3, (r["mode"], r["peak_bytes"], r["predicted_bytes"])
    assert "| 32 | train | fp32 | off |" in done.stdout
    runs = _rows(db, schema.runs)
    assert [(r["kind"], r["status"], r["label"]) for r in runs] == [("model", "ok", "t")] * 3
    assert runs[2]["config"] == {"size": wide_model, "context": 32, "batch": 2, "mode": "train", "precision": "fp32",
                                 "compile": False, "attention": "sdpa", "device": "cpu", "warmup": 1, "steps": 2}
    stored = [(m["run_id"], m["metric"], m["unit"], m["iteration"], m["value"]) for m in _rows(db, schema.measurements)]
    expected = []
    for run, r in zip(runs, rows):
        expected.append((run["id"], "predicted_memory_bytes", "bytes", 0, float(r["predicted_bytes"])))
        for phase, values in r["seconds"].items():
            expected += [(run["id"], f"{phase}_seconds", "s", i, v) for i, v in enumerate(values)]
        expected.append((run["id"], "peak_memory_bytes", "bytes", 0, float(r["peak_bytes"])))
    assert stored == expected
    assert [list(r["seconds"]) for r in rows] == [["forward"], ["forward", "backward"],
                                                  ["forward", "backward", "optimizer"]]


def test_a_size_that_cannot_fit_is_reported_and_the_run_goes_on(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    rows = main(["--sizes", "llama-8b,tiny", "--context", "16", "--batch", "1", "--modes", "train",
                 "--warmup", "0", "--iterations", "1", "--threads", "1", "--db", db])
    assert rows[0]["status"].startswith("does not fit (") and rows[1]["status"] == "ok"
    assert "| llama-8b | 16 | train | fp32 | off | - | - | - | does not fit (" in capsys.readouterr().out
    runs = _rows(db, schema.runs)
    assert [(r["status"], r["error"] and r["error"].split("(")[0]) for r in runs] == [
        ("failed", "RuntimeError: does not fit "), ("ok", None)]
    assert runs[0]["error"] == f"RuntimeError: {rows[0]['status']}"


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "huge"], "bench model: unknown model size 'huge': use a preset (tiny, llama-1b"),
    (["--sizes", "tiny", "--memory-snapshot", "x", "--device", "cpu"], "bench model: --memory-snapshot needs a CUDA"),
])
def test_bad_input_is_a_one_line_error(argv, message, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--db", str(tmp_path / "b.db")])
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_a_model_folder_the_calculator_cannot_read_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SystemExit) as exc:
        main(["--sizes", str(tmp_path), "--calc-only"])
    assert str(exc.value) == ("bench model: the memory calculator needs a Llama-style config; "
                              "this one lacks intermediate_size")


def test_bad_lists_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--modes", "fwd,sideways"])
    assert exc.value.code == 2
    assert "--mode takes a comma list of fwd, fwd+bwd, train" in capsys.readouterr().err


def test_profile_writes_a_chrome_trace_per_case(tmp_path):
    main(["--sizes", "tiny", "--context", "8", "--batch", "1", "--modes", "fwd", "--warmup", "0", "--iterations", "1",
          "--threads", "1", "--profile", str(tmp_path / "traces"), "--db", str(tmp_path / "b.db")])
    trace = json.loads((tmp_path / "traces" / "tiny-c8-b1-fwd-fp32.json").read_text())
    assert any(e.get("name") == "aten::linear" for e in trace["traceEvents"])


def test_a_json_file_that_cannot_be_written_is_a_one_line_error(tmp_path):
    path = tmp_path / "missing" / "out.json"
    with pytest.raises(SystemExit) as exc:
        main(["--sizes", "tiny", "--calc-only", "--json", str(path)])
    assert str(exc.value) == f"bench model: cannot write {path}: No such file or directory"


def test_quantized_forward_is_measured_on_its_stored_weights_and_what_cannot_run_is_skipped(wide_model, tmp_path):
    """In a fresh process, as the peak test above."""
    db = f"sqlite:///{tmp_path / 'bench.db'}"

    def bench(modes: str, precision: str, quantization: str, name: str):
        done = _bench_model_in_a_fresh_process(
            "--sizes", wide_model, "--context", "32", "--batch", "2", "--modes", modes, "--precision", precision,
            "--quantization", quantization, "--warmup", "1", "--iterations", "2", "--threads", "1", "--db", db,
            "--json", str(tmp_path / name))
        return done, json.loads((tmp_path / name).read_text())
    # training in fp32 only: a bf16 backward pass on CPU takes seconds (a 2 x 10 s step at this size)
    done, rows = bench("fwd", "fp32,bf16", "none,int8,int4,fp8", "fwd.json")
    trained, train_rows = bench("train", "fp32", "none,int8", "train.json")
    rows += train_rows
    status = {(r["quantization"], r["precision"], r["mode"]): r["status"] for r in rows}
    assert [k for k, v in status.items() if v == "ok"] == [
        ("none", "fp32", "fwd"), ("none", "bf16", "fwd"), ("int8", "fp32", "fwd"), ("int8", "bf16", "fwd"),
        ("int4", "bf16", "fwd"), ("none", "fp32", "train")]
    assert status["int8", "fp32", "train"] == "skipped: quantized weights run forward only (--modes fwd)"
    assert status["int4", "fp32", "fwd"].startswith("skipped: int4 weights run in bfloat16")
    assert status["fp8", "bf16", "fwd"].startswith("skipped: fp8 weights need a CUDA GPU")
    # 2 layers x (4 x 1024^2 attention + 3 x 1024 x 4096 MLP) quantized; embedding and output head (1000 x 1024 each)
    linear, other = 2 * (4 * 1024**2 + 3 * 1024 * 4096), 2 * 1000 * 1024 + 5 * 1024
    ok = {(r["quantization"], r["precision"]): r for r in rows if r["status"] == "ok" and r["mode"] == "fwd"}
    weights = {k: r["weight_bytes"] for k, r in ok.items()}
    # int8: a byte per weight and a scale per output row; int4: half a byte and a scale and zero point per 32 weights
    assert 1.0 < (weights["int8", "fp32"] - 4 * other) / linear < 1.01
    assert 1.0 < (weights["int8", "bf16"] - 2 * other) / linear < 1.01
    assert 0.5 + 4 / 32 <= (weights["int4", "bf16"] - 2 * other) / linear < 0.5 + 4 / 32 + 0.01
    assert weights["none", "fp32"] is None
    for key in [("int8", "fp32"), ("int8", "bf16"), ("int4", "bf16")]:
        r = ok[key]
        assert "bf16 weight copies (autocast)" not in r["predicted"]
        assert r["predicted"]["parameters (as stored, quantized)"] == r["weight_bytes"]
        assert 0.95 < r["peak_bytes"] / r["predicted_bytes"] < 1.3, (key, r["peak_bytes"], r["predicted_bytes"])
    assert ok["int8", "fp32"]["predicted"]["dequantized weight (matmul temporary)"] == 4 * 1024 * 4096
    assert "dequantized weight (matmul temporary)" not in ok["int4", "bf16"]["predicted"]
    assert ok["int8", "fp32"]["predicted_bytes"] < 0.6 * ok["none", "fp32"]["predicted_bytes"]
    assert f"| 32 | fwd | bf16 | off | int4 | {weights['int4', 'bf16'] / 2**20:.1f} |" in done.stdout
    assert "| 32 | train | fp32 | off | none | - |" in trained.stdout
    runs = _rows(db, schema.runs)  # the skipped combinations are not runs
    assert [(r["status"], r["config"].get("quantization")) for r in runs] == [
        ("ok", None), ("ok", None), ("ok", "int8"), ("ok", "int8"), ("ok", "int4"), ("ok", None)]
    stored = {(m["run_id"], m["metric"]): m["value"] for m in _rows(db, schema.measurements)}
    assert stored[runs[4]["id"], "weight_bytes"] == weights["int4", "bf16"]
    assert stored[runs[4]["id"], "peak_memory_bytes"] == ok["int4", "bf16"]["peak_bytes"]


def test_calc_only_refuses_quantized_sizes(capsys):
    with pytest.raises(SystemExit):
        main(["--sizes", "tiny", "--quantization", "int8", "--calc-only"])
    assert "--calc-only predicts unquantized models" in capsys.readouterr().err
