"""The Prometheus rules in deploy/rules: promtool checks and unit tests, and their agreement with the metric catalog.

Needs promtool (deploy/install-tools.sh installs it).
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service.telemetry.metrics import TTFT_BUCKETS

from tests.conftest import needs_tools

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "rules"
RULE_FILES = sorted(RULES.glob("*.yml"))
UNIT_TESTS = sorted((RULES / "tests").glob("*_test.yml"))
SLO_WINDOWS = ["5m", "30m", "1h", "2h", "6h", "1d", "3d"]

promtool = needs_tools("promtool")


def rules(path: Path | None = None) -> list[dict]:
    paths = [path] if path else RULE_FILES
    return [r for p in paths for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"]]


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for r in rules() if "alert" in r}


def run_promtool(*args: str, cwd: Path = RULES) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@promtool
def test_rule_files_pass_promtool_check():
    done = run_promtool("check", "rules", *map(str, RULE_FILES))
    assert done.returncode == 0, done.stdout + done.stderr


@promtool
def test_promtool_unit_tests_pass():
    done = run_promtool("test", "rules", *(str(p.relative_to(RULES)) for p in UNIT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_test_where_it_fires_and_one_where_it_stays_silent():
    fires, silent = set(), set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert set(alerts()) - fires == set(), "alerts never shown firing"
    assert set(alerts()) - silent == set(), "alerts never shown silent"


@promtool
def test_unit_tests_fail_when_the_thresholds_are_out_of_reach(tmp_path):
    """The firing cases really depend on the thresholds: raise every threshold and objective and they fail."""
    shutil.copytree(RULES, tmp_path / "rules")
    thresholds = tmp_path / "rules" / "llm-thresholds.yml"
    text = thresholds.read_text()
    # thresholds go up to 1e9 (nothing exceeds them); objectives to 0 (any budget is 100%: burn rates tiny)
    text = re.sub(r"(record: llm:threshold:\w+\n\s+expr: )vector\([0-9.]+\)", r"\1vector(1e9)", text)
    text = re.sub(r"(record: llm:slo_objective:ratio\n\s+expr: )vector\([0-9.]+\)", r"\1vector(0)", text)
    thresholds.write_text(text)
    # ... except the GPU idle threshold, which fires when utilization is *below* it: make it 0
    thresholds.write_text(text.replace("gpu_idle_utilization_ratio\n        expr: vector(1e9)",
                                       "gpu_idle_utilization_ratio\n        expr: vector(0)"))
    for path in UNIT_TESTS:  # only the cases where an alert fires (promtool's time goes by the groups it runs)
        copy = tmp_path / "rules" / path.relative_to(RULES)
        doc = yaml.safe_load(copy.read_text())
        groups = []
        for group in doc["tests"]:
            firing = [case for case in group.get("alert_rule_test", []) if case.get("exp_alerts")]
            if firing:
                group.pop("promql_expr_test", None)
                groups.append({**group, "alert_rule_test": firing})
        doc["tests"] = groups
        copy.write_text(yaml.safe_dump(doc, sort_keys=False))
    done = run_promtool("test", "rules", *(str(p.relative_to(RULES)) for p in UNIT_TESTS), cwd=tmp_path / "rules")
    assert done.returncode != 0
    failed = set(re.findall(r"alertname: (\w+), time", done.stdout + done.stderr))
    assert failed == set(alerts()) - {"LLMServiceDown"}  # the only alert without a tunable threshold


def test_every_threshold_constant_is_used_by_an_alert_and_every_alert_constant_is_defined():
    defined = {r["record"] for r in rules(RULES / "llm-thresholds.yml")}
    used = {name for a in alerts().values() for name in re.findall(r"llm:threshold:\w+", a["expr"])}
    used |= {"llm:slo_objective:ratio"} if any("llm:slo_objective:ratio" in r["expr"] for r in rules()) else set()
    assert used == defined


def test_slo_rules_are_the_same_expression_for_every_window():
    slo = {r["record"]: r["expr"] for r in rules(RULES / "llm-slo.yml") if "record" in r}
    for sli in ("availability", "ttft"):
        for kind in ("bad", "total"):
            base = slo[f"instance_model:llm_slo_{sli}_{kind}:rate5m"]
            for w in SLO_WINDOWS:
                assert slo[f"instance_model:llm_slo_{sli}_{kind}:rate{w}"] == base.replace("[5m]", f"[{w}]")
        for w in SLO_WINDOWS:
            assert f"llm_slo_{sli}_bad:rate{w})" in slo[f"model:llm_slo_{sli}_errors:ratio_rate{w}"]
            assert f":ratio_rate{w} /" in slo[f"model:llm_slo_{sli}_errors:burn_rate{w}"]
            assert f'slo="{sli}"' in slo[f"model:llm_slo_{sli}_errors:burn_rate{w}"]


def test_ttft_slo_bound_is_a_bucket_of_the_ttft_histogram():
    text = (RULES / "llm-slo.yml").read_text()
    bounds = set(re.findall(r'llm_time_to_first_token_seconds_bucket\{le="([^"]+)"\}', text))
    assert len(bounds) == 1, f"the TTFT SLO must use one bound everywhere, found {bounds}"
    assert float(bounds.pop()) in TTFT_BUCKETS


def test_burn_rate_alerts_use_the_workbook_windows_and_factors():
    pairs = {"ErrorBudgetBurn": [("1h", "5m", "14.4"), ("6h", "30m", "6")],
             "ErrorBudgetBurnSlow": [("1d", "2h", "3"), ("3d", "6h", "1")]}
    for sli, prefix in (("availability", "LLMAvailability"), ("ttft", "LLMTimeToFirstToken")):
        for suffix, windows in pairs.items():
            expr = " ".join(alerts()[prefix + suffix]["expr"].split())
            for long, short, factor in windows:
                assert (f"(model:llm_slo_{sli}_errors:burn_rate{long} > {factor} and "
                        f"model:llm_slo_{sli}_errors:burn_rate{short} > {factor})") in expr


def test_alerts_carry_severity_summary_and_dashboard_link():
    for name, a in alerts().items():
        assert a["labels"]["severity"] in ("critical", "warning"), name
        assert a["annotations"]["summary"] and a["annotations"]["description"], name
        assert a["annotations"]["dashboard"] in ("/d/llm-overview", "/d/llm-gpu", "/d/llm-slo"), name
