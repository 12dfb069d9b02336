"""`--shard K/N` (tests/conftest.py), run over a generated test file in a pytest of its own: the N parts of a
collection partition it, each parametrized family spread over the parts, and a part does not depend on -k."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = '''
import pytest

@pytest.mark.parametrize("case", range(7))
def test_alpha(case):
    pass

@pytest.mark.parametrize("a, b", [(1, "x"), (2, "y"), (3, "z")])
@pytest.mark.parametrize("c", [True, False])
def test_beta(a, b, c):
    pass

def test_gamma():
    pass

class TestDelta:
    @pytest.mark.parametrize("n", [10, 20, 30, 40])
    def test_epsilon(self, n):
        pass
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest over the folder's test file with tests/conftest.py as a plugin (no other plugins, no cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's xdist worker
    env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(folder), "-c", str(folder / "pytest.ini"), "--collect-only", "-q",
                           str(folder / "test_many.py"), *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def _collected(folder: Path, *args: str) -> list[str]:
    run = _pytest(folder, *args)
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    (folder / "test_many.py").write_text(TESTS)
    (folder / "pytest.ini").write_text("[pytest]\n")
    return folder


def test_the_parts_partition_the_collection_and_spread_each_family(folder):
    everything = _collected(folder)
    assert len(everything) == 7 + 6 + 1 + 4
    parts = [_collected(folder, "--shard", f"{k}/3") for k in (1, 2, 3)]
    assert sorted(sum(parts, [])) == sorted(everything)  # every test in exactly one part
    assert [len(p) for p in parts] == [6, 6, 6]
    for family in ("test_alpha", "test_beta", "TestDelta"):  # a parametrized family's cases go round the parts
        counts = [sum(family in test for test in part) for part in parts]
        assert max(counts) - min(counts) <= 1, (family, counts)
    for part in parts:  # a part keeps the collection's order
        assert part == [test for test in everything if test in part]


def test_a_part_is_the_same_under_k_and_reports_the_rest_deselected(folder):
    part = _collected(folder, "--shard", "2/3")
    assert _collected(folder, "--shard", "2/3", "-k", "beta") == [test for test in part if "beta" in test]
    assert "6/18 tests collected (12 deselected)" in _pytest(folder, "--shard", "2/3").stdout


@pytest.mark.parametrize("shard", ["0/3", "4/3", "3", "a/b"])
def test_a_part_outside_1_to_n_is_a_usage_error(folder, shard):
    run = _pytest(folder, f"--shard={shard}")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR
    assert "is not K/N with 1 <= K <= N" in run.stderr
