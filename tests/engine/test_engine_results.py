"""The engine's hand-over types: nameable without torch, and each step's statistics as the engine fills them."""

import subprocess
import sys
from pathlib import Path

import pytest

from service.engine import SamplingParams
from tests.conftest import make_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["service.engine.results", "service.engine", "service.engine.sequence",
                                    "service.telemetry.recorder", "service.telemetry.tracing"])
def test_naming_the_hand_over_types_loads_no_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'service.engine.llm_engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_step_stats_name_the_finished_requests_and_the_kv_blocks_in_use(tiny_model):
    engine = make_engine(tiny_model, num_blocks=512)
    steps = []
    engine.observer = steps.append
    engine.add_request(list(range(20)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), "a")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "b")
    while engine.has_unfinished():
        engine.step()
    assert [s.finished_ids for s in steps] == [(), ("a",), ("b",)]
    assert [s.kv_blocks_used for s in steps] == [3, 1, 0]  # a: 20 prompt tokens, 2 blocks; b: 1 block
    assert {s.kv_blocks_total for s in steps} == {511}  # block 0 is the scratch block
    assert [s.kv_usage for s in steps] == [3 / 511, 1 / 511, 0.0]
