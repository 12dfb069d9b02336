"""One flag style across the bench commands (docs/benchmarking.md#flags-shared-by-every-bench-command): the new
spellings set each setting; the old ones still do, for now, and say on stderr which spelling replaces them."""

from pathlib import Path

import pytest

from service.bench import soak
from service.bench.kernel import cli as kernel
from service.bench.loadgen import serve
from service.bench.loadgen.capacity import command as capacity
from service.bench.model import cli as model
from service.bench.offline import offline, run

SLO = ["--slo", "ttft:p95<=500ms"]


def soak_args(argv):
    return soak.parse_args(argv)[0]


def offline_args(argv):
    return offline.build_parser().parse_args(argv)


KERNEL = ["--ops", "reference", "--device", "cpu"]


# (parser, new spelling, old spelling, attribute, value both give, the old spelling's message)
CASES = [
    (serve.parse_args, ["--url", "http://h:1"], ["--base-url", "http://h:1"], "base_url", "http://h:1",
     "service bench serve: --base-url is deprecated and will be removed; use --url"),
    (serve.parse_args, ["--json", "r.json"], ["--result-json", "r.json"], "result_json", "r.json",
     "service bench serve: --result-json is deprecated and will be removed; use --json"),
    (serve.parse_args, ["--csv", "r.csv"], ["--result-csv", "r.csv"], "result_csv", "r.csv",
     "service bench serve: --result-csv is deprecated and will be removed; use --csv"),
    (serve.parse_args, ["--progress", "off"], ["--no-progress"], "progress", False,
     "service bench serve: --no-progress is deprecated and will be removed; use --progress off"),
    (serve.parse_args, ["--server-metrics", "off"], ["--no-crosscheck"], "server_metrics", False,
     "service bench serve: --no-crosscheck is deprecated and will be removed; use --server-metrics off"),
    (serve.parse_args, ["--ignore-eos", "off"], ["--no-ignore-eos"], "ignore_eos", False,
     "service bench serve: --no-ignore-eos is deprecated and will be removed; use --ignore-eos off"),
    (serve.parse_args, ["--ignore-eos", "on"], ["--ignore-eos"], "ignore_eos", True,
     "service bench serve: a bare --ignore-eos is deprecated and will be removed; use --ignore-eos on"),
    (capacity.parse_args, SLO + ["--url", "http://h:1"], SLO + ["--base-url", "http://h:1"], "base_url", "http://h:1",
     "service bench capacity: --base-url is deprecated and will be removed; use --url"),
    (capacity.parse_args, SLO + ["--warmup-seconds", "2.5"], SLO + ["--warmup", "2.5"], "warmup", 2.5,
     "service bench capacity: --warmup is deprecated and will be removed; use --warmup-seconds"),
    (capacity.parse_args, SLO + ["--server-metrics", "off"], SLO + ["--no-server-metrics"], "server_metrics", False,
     "service bench capacity: --no-server-metrics is deprecated and will be removed; use --server-metrics off"),
    (capacity.parse_args, SLO + ["--json", "c.json"], SLO + ["--result-json", "c.json"], "result_json", "c.json",
     "service bench capacity: --result-json is deprecated and will be removed; use --json"),
    (capacity.parse_args, SLO + ["--csv", "c.csv"], SLO + ["--result-csv", "c.csv"], "result_csv", "c.csv",
     "service bench capacity: --result-csv is deprecated and will be removed; use --csv"),
    (soak_args, ["--warmup-seconds", "5"], ["--warmup", "5"], "warmup", 5.0,
     "service bench soak: --warmup is deprecated and will be removed; use --warmup-seconds"),
    (soak_args, ["--out-dir", "d"], ["--out", "d"], "out", Path("d"),
     "service bench soak: --out is deprecated and will be removed; use --out-dir"),
    (offline_args, ["--compile", "off"], ["--no-compile"], "compile", False,
     "service bench offline: --no-compile is deprecated and will be removed; use --compile off"),
    (offline_args, ["--cuda-graphs", "off"], ["--no-cuda-graphs"], "cuda_graphs", False,
     "service bench offline: --no-cuda-graphs is deprecated and will be removed; use --cuda-graphs off"),
    (offline_args, ["--iterations", "3"], ["--repeats", "3"], "repeats", 3,
     "service bench offline: --repeats is deprecated and will be removed; use --iterations"),
    (run.parse_args, ["--progress", "off"], ["--no-progress"], "progress", False,
     "service bench run: --no-progress is deprecated and will be removed; use --progress off"),
    (kernel.parse_args, KERNEL + ["--iterations", "3"], KERNEL + ["--repeats", "3"], "repeats", 3,
     "service bench kernel: --repeats is deprecated and will be removed; use --iterations"),
    (kernel.parse_args, KERNEL + ["--flush-l2", "off"], KERNEL + ["--no-flush"], "flush_l2", False,
     "service bench kernel: --no-flush is deprecated and will be removed; use --flush-l2 off"),
    (model.parse_args, ["--iterations", "3"], ["--steps", "3"], "steps", 3,
     "service bench model: --steps is deprecated and will be removed; use --iterations"),
]


@pytest.mark.parametrize("parse, new, old, attribute, value, message", CASES, ids=[" ".join(c[2]) for c in CASES])
def test_old_spelling_sets_what_the_new_one_sets_and_says_it_is_deprecated(parse, new, old, attribute, value,
                                                                           message, capsys):
    assert getattr(parse(new), attribute) == value
    assert capsys.readouterr().err == ""
    assert getattr(parse(old), attribute) == value
    assert capsys.readouterr().err == message + "\n"


def test_switches_default_to_what_the_old_flags_left_on():
    args = serve.parse_args([])
    assert (args.progress, args.server_metrics, args.ignore_eos, args.base_url) == (True, True, None,
                                                                                   "http://127.0.0.1:8000")
    assert capacity.parse_args(SLO).warmup == 10.0 and soak_args([]).warmup == 30.0
    assert (offline_args([]).compile, offline_args([]).cuda_graphs) == (True, True)
    assert kernel.parse_args(KERNEL).flush_l2 is True and run.parse_args([]).progress is True


def test_workers_is_one_flag_with_one_default_for_every_command_that_sends_load():
    from service.bench.loadgen.send.workers import default_workers
    parsers = [serve.parse_args, lambda argv: capacity.parse_args(SLO + argv), soak_args]
    assert [parse(["--workers", "3"]).workers for parse in parsers] == [3, 3, 3]
    assert [parse([]).workers for parse in parsers] == [default_workers()] * 3


def test_a_switch_takes_only_on_or_off(capsys):
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--progress", "yes"])
    assert exc.value.code == 2
    assert "argument --progress: expected on or off, got 'yes'" in capsys.readouterr().err


def test_deprecated_spellings_stay_out_of_help(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    shown = capsys.readouterr().out
    assert "--url URL" in shown and "--json PATH" in shown and "--progress on|off" in shown
    assert "--base-url" not in shown and "--result-json" not in shown and "--no-progress" not in shown
