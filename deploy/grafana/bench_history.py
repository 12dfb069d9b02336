"""The "Benchmark history" dashboard: the results store (PostgreSQL) read through the data source uid bench-postgres.

A metric across commits per configuration, the verdicts of the latest `bench regress`, and the device samples of
a chosen run. Every query is plain SQL over the tables of service/bench/store/schema.py; tests run each one
against a real PostgreSQL holding real runs.
"""

PG = {"type": "grafana-postgresql-datasource", "uid": "bench-postgres"}

# r: the runs the variables select (kind, machine, model, configuration)
PICKED = ("r.status = 'ok' AND r.kind IN (${kind:sqlstring}) AND r.host IN (${machine:sqlstring}) "
          "AND coalesce(r.config->>'model', '') IN (${model:sqlstring}) AND r.config_hash IN (${config:sqlstring})")


def sql(query: str, fmt: str = "table", ref: str = "A") -> dict:
    return {"datasource": PG, "refId": ref, "rawSql": " ".join(query.split()), "format": fmt, "rawQuery": True,
            "editorMode": "code"}


def variable(name: str, label: str, query: str, multi: bool = True) -> dict:
    query = " ".join(query.split())
    return {"name": name, "label": label, "type": "query", "datasource": PG, "query": query, "definition": query,
            "refresh": 2, "multi": multi, "includeAll": multi, "sort": 0,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {}}


def panel(kind: str, title: str, description: str, targets: list[dict], size: tuple[int, int], **extra) -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": PG, "targets": targets,
            "_size": size, "fieldConfig": {"defaults": extra.pop("defaults", {}), "overrides": []}, **extra}


def bench_history(dashboard, row) -> dict:
    variables = [
        variable("kind", "Kind", "SELECT DISTINCT kind FROM bench_runs ORDER BY 1"),
        variable("machine", "Machine", "SELECT DISTINCT host FROM bench_runs WHERE kind IN (${kind:sqlstring}) ORDER BY 1"),
        variable("model", "Model", "SELECT DISTINCT coalesce(config->>'model', '') FROM bench_runs "
                                   "WHERE kind IN (${kind:sqlstring}) ORDER BY 1"),
        variable("config", "Configuration", "SELECT DISTINCT name AS __text, config_hash AS __value FROM bench_runs "
                 "WHERE kind IN (${kind:sqlstring}) AND host IN (${machine:sqlstring}) "
                 "AND coalesce(config->>'model', '') IN (${model:sqlstring}) ORDER BY 1"),
        variable("metric", "Metric", "SELECT DISTINCT m.metric FROM bench_measurements m JOIN bench_runs r "
                 "ON r.id = m.run_id WHERE r.config_hash IN (${config:sqlstring}) ORDER BY 1", multi=False),
        variable("run", "Run (device samples)", "SELECT r.id AS __value, r.id || ' ' || r.name || ' ' || "
                 "coalesce(left(r.git_commit, 10), '') AS __text FROM bench_runs r "
                 "WHERE r.kind IN (${kind:sqlstring}) AND r.config_hash IN (${config:sqlstring}) "
                 "AND EXISTS (SELECT 1 FROM bench_samples s WHERE s.run_id = r.id) ORDER BY r.id DESC LIMIT 200",
                 multi=False),
        variable("sample", "Device reading", "SELECT DISTINCT metric FROM bench_samples WHERE run_id = ${run:raw} "
                 "ORDER BY 1"),
    ]
    medians = f"""SELECT r.started_at AS time, r.name AS metric,
        percentile_cont(0.5) WITHIN GROUP (ORDER BY m.value) AS value
        FROM bench_runs r JOIN bench_measurements m ON m.run_id = r.id
        WHERE {PICKED} AND m.metric = ${{metric:sqlstring}} AND $__timeFilter(r.started_at)
        GROUP BY r.id, r.started_at, r.name ORDER BY 1"""
    per_commit = f"""SELECT left(r.git_commit, 10) || CASE WHEN r.git_dirty THEN '+dirty' ELSE '' END AS commit,
        r.git_subject AS subject, r.name AS configuration, r.label, r.host AS machine, r.id AS run,
        min(r.started_at) AS started, count(*) AS iterations,
        percentile_cont(0.5) WITHIN GROUP (ORDER BY m.value) AS median, min(m.value) AS min, max(m.value) AS max
        FROM bench_runs r JOIN bench_measurements m ON m.run_id = r.id
        WHERE {PICKED} AND m.metric = ${{metric:sqlstring}} AND $__timeFilter(r.started_at)
        GROUP BY r.id ORDER BY r.id DESC"""
    latest_verdicts = """SELECT c.name AS configuration, v.metric, v.baseline_ref || ' (run ' || v.baseline_run_id || ')'
        AS baseline, v.candidate_ref || ' (run ' || v.candidate_run_id || ')' AS candidate,
        v.baseline_median, v.candidate_median, v.ratio, v.ratio_low, v.ratio_high, v.verdict, v.created_at AS judged
        FROM bench_verdicts v JOIN bench_runs c ON c.id = v.candidate_run_id
        WHERE v.created_at = (SELECT max(created_at) FROM bench_verdicts)
        ORDER BY CASE v.verdict WHEN 'regressed' THEN 0 WHEN 'maybe regressed' THEN 1 WHEN 'inconclusive' THEN 2
        WHEN 'improved' THEN 3 ELSE 4 END,
        c.name, v.metric"""
    samples = """SELECT s.t AS seconds, s.value AS "${sample}" FROM bench_samples s
        WHERE s.run_id = ${run:raw} AND s.metric = ${sample:sqlstring} ORDER BY 1"""
    run_info = """SELECT r.id AS run, r.name AS configuration, r.status, r.error, r.started_at, r.ended_at,
        left(r.git_commit, 10) AS commit, r.git_branch AS branch, r.host AS machine, r.machine->>'cpu' AS cpu,
        r.versions->>'torch' AS torch, r.label FROM bench_runs r WHERE r.id = ${run:raw}"""
    verdict_colours = {"type": "value", "options": {"regressed": {"color": "red", "index": 0},
                                                     "improved": {"color": "green", "index": 1},
                                                     "inconclusive": {"color": "yellow", "index": 2},
                                                     "maybe regressed": {"color": "orange", "index": 3},
                                                     "maybe improved": {"color": "light-green", "index": 4}}}
    panels = [
        row("Across commits"),
        panel("timeseries", "${metric} per run (median of its iterations)",
              "Each point is one stored run of a configuration, at the time it started: the median over its "
              "measured iterations. One line per configuration.", [sql(medians, "time_series")], (24, 9),
              defaults={"custom": {"drawStyle": "line", "showPoints": "always", "pointSize": 6, "spanNulls": True}}),
        panel("table", "${metric} by commit", "The same runs as a table, newest first: commit, subject, "
              "iterations, median and range.", [sql(per_commit)], (24, 8), options={"showHeader": True}),
        row("Latest verdicts"),
        panel("table", "Latest bench regress: candidate against baseline",
              "What the newest `bench regress` call concluded for every configuration and metric: the median "
              "ratio candidate/baseline with its bootstrap 95% interval. Regressions first.",
              [sql(latest_verdicts)], (24, 9), options={"showHeader": True},
              defaults={"mappings": [verdict_colours],
                        "custom": {"cellOptions": {"type": "color-text"}}}),
        row("Device samples of one run"),
        panel("table", "The run", "Where and when the chosen run ran.", [sql(run_info)], (24, 3),
              options={"showHeader": True}),
        panel("trend", "${sample}", "Device readings while the chosen run ran, against seconds since its start "
              "(sampled every 0.1 s by bench run).", [sql(samples)], (8, 7), repeat="sample",
              repeatDirection="h", options={"xField": "seconds", "legend": {"showLegend": True}}),
    ]
    dash = dashboard("llm-bench-history", "Benchmark history", "Stored benchmark runs (bench run, offline, serve "
                     "...): a metric across commits, the latest regression verdicts, device samples of a run.",
                     panels)
    dash["tags"] = ["llm", "benchmarks"]
    dash["templating"]["list"] = variables
    dash["annotations"]["list"] = []
    dash["refresh"] = ""
    dash["time"] = {"from": "now-30d", "to": "now"}
    return dash
