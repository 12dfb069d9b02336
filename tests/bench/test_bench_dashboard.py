"""The Benchmark history dashboard against a real PostgreSQL holding real `bench run` and `bench regress` results:
every variable and panel query runs, with Grafana's variable formats and macros expanded, and returns rows."""

import json
import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.bench.offline import run
from service.bench.regress import cli

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/llm-bench-history.json"
PICK = {"metric": "wall_seconds", "sample": "cpu_percent"}  # single-value variables: the value a user picks


def expand(query: str, values: dict[str, list[str]]) -> str:
    """What Grafana sends: ${v:sqlstring} -> 'a','b'; ${v:raw} and ${v} -> a; $__timeFilter(c) -> a time range."""
    quoted = lambda vs: ",".join("'" + v.replace("'", "''") + "'" for v in vs)  # noqa: E731
    query = re.sub(r"\$\{(\w+):sqlstring\}", lambda m: quoted(values[m[1]]), query)
    query = re.sub(r"\$\{(\w+)(?::raw)?\}", lambda m: values[m[1]][0], query)
    assert "$" not in query.replace("$__timeFilter", ""), query
    return re.sub(r"\$__timeFilter\(([^)]*)\)", r"\1 BETWEEN now() - interval '30 days' AND now()", query)


def test_every_dashboard_query_returns_rows_from_real_runs(postgres_url, tmp_path):
    for commit in ("aaaa0000", "bbbb1111"):
        run.main(["--db", postgres_url, "--model", "random:tiny", "--batch-size", "2", "--input-len", "6",
                  "--output-len", "3", "--warmup", "0", "--iterations", "5", "--repeats", "2", "--commit", commit, "--progress", "off"])
    with pytest.raises(SystemExit) as exited:  # exit 0 or 1, whatever the noise says: the verdicts are stored
        cli.main(["--db", postgres_url, "--baseline", "aaaa0000", "--candidate", "bbbb1111"])
        raise SystemExit(0)
    assert exited.value.code in (0, 1)

    dash = json.loads(DASHBOARD.read_text())
    engine = sa.create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://"))
    values: dict[str, list[str]] = {}
    with engine.connect() as conn:
        for var in dash["templating"]["list"]:  # in order: each may use the ones before it
            assert var["datasource"]["uid"] == "bench-postgres"
            result = conn.execute(sa.text(expand(var["query"], values))).mappings().all()
            got = [str(r.get("__value", next(iter(r.values())))) for r in result]
            assert got, f"variable {var['name']} has no values"
            values[var["name"]] = [PICK[var["name"]]] if var["name"] in PICK else got
        assert values["kind"] == ["run"] and len(values["config"]) == 1
        queried = 0
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                assert target["datasource"]["uid"] == "bench-postgres"
                result = conn.execute(sa.text(expand(target["rawSql"], values))).mappings().all()
                assert result, f"panel {panel['title']!r} returned no rows"
                queried += 1
                if panel["title"].startswith("Latest bench regress"):
                    assert {r["verdict"] for r in result} <= {"regressed", "improved", "unchanged", "inconclusive",
                                                              "maybe regressed", "maybe improved"}
                    assert {r["metric"] for r in result} >= {"wall_seconds", "output_tokens_per_second"}
                if "per run" in panel["title"]:
                    assert [r["metric"] for r in result] == ["tiny-cpu-b2-in6-out3-torch-eager-fp32"] * 4  # 2 commits, 2 repeats
    assert queried == 5
