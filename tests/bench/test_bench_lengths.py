"""Length distributions shared by bench offline and bench run: fixed or uniform:LOW-HIGH, seeded."""

import json

import pytest

from service.bench.offline import offline
from service.bench.offline.lengths import Lengths


def test_a_fixed_length_gives_every_request_that_length():
    assert Lengths.parse("128").sample(3, seed=0) == [128, 128, 128]
    assert Lengths.parse(64) == Lengths(64, 64) and str(Lengths.parse(64)) == "64"


def test_uniform_lengths_stay_in_bounds_cover_them_and_repeat_with_the_seed():
    spec = Lengths.parse("uniform:100-1024")
    drawn = spec.sample(256, seed=7)
    assert min(drawn) >= 100 and max(drawn) <= 1024
    assert len(set(drawn)) > 150  # spread out, not one value
    assert spec.sample(256, seed=7) == drawn
    assert spec.sample(256, seed=8) != drawn
    assert Lengths.parse("uniform:5-6").sample(200, seed=0).count(6) > 50  # HIGH is included
    assert str(spec) == "uniform:100-1024"


@pytest.mark.parametrize("text", ["", "abc", "uniform:10", "uniform:20-10", "0", "uniform:0-5", "normal:1-2"])
def test_bad_lengths_are_refused_with_the_value_named(text):
    with pytest.raises(ValueError, match="length"):
        Lengths.parse(text)


def test_bench_offline_gives_each_request_its_drawn_lengths(tmp_path, capsys, monkeypatch):
    # transformers sizes its continuous-batching cache to the machine (44 s of tensor fills on this CPU): small here
    from transformers.generation.continuous_batching import continuous_api
    class Small(continuous_api.ContinuousBatchingConfig):
        def __init__(self, **kwargs):
            super().__init__(**{"num_blocks": 16, "max_batch_tokens": 64, **kwargs})

    monkeypatch.setattr(continuous_api, "ContinuousBatchingConfig", Small)
    out = tmp_path / "offline.json"
    rows = offline.main(["--model", "random:tiny", "--device", "cpu", "--num-requests", "6", "--input-len",
                         "uniform:3-20", "--output-len", "uniform:2-9", "--seed", "3", "--json", str(out),
                         "--num-blocks", "64"])
    expected = sum(Lengths(2, 9).sample(6, seed=4))
    # transformers' continuous batching gets each request's length too; a static batch cannot vary them
    assert [(r["key"], r["output_tokens"]) for r in rows] == [("engine", expected), ("generate_batch", expected)]
    assert "static peer skipped: it needs one prompt and one output length, not uniform:3-20 / uniform:2-9" in \
        capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert (saved["input_len"], saved["output_len"], saved["seed"]) == ("uniform:3-20", "uniform:2-9", 3)


def test_bench_offline_rejects_a_bad_length_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        offline.main(["--input-len", "uniform:9-2"])
    assert exited.value.code == 2
    assert "LOW <= HIGH, got 'uniform:9-2'" in capsys.readouterr().err


def test_telemetry_overhead_is_the_median_of_paired_ratios(tiny_model, monkeypatch):
    """Each 'on' run is held against the 'off' run just before it; the median of those ratios, and their range."""
    from tests.conftest import make_engine

    seconds = iter([1.0, 1.5, 2.0, 2.0, 1.0, 1.1])  # off, on, off, on, off, on: ratios 1.5, 1.0, 1.1
    monkeypatch.setattr(offline, "run_engine", lambda *a: {"seconds": next(seconds)})
    off, on = offline.telemetry_overhead(make_engine(tiny_model), [[1, 2]], [4], repeats=3)
    assert (off["runs"], on["runs"]) == ([1.0, 2.0, 1.0], [1.5, 2.0, 1.1])
    assert on["pair_ratio_median"] == pytest.approx(1.1) and on["pair_ratio_range"] == pytest.approx([1.0, 1.5])
