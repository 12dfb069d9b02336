"""Reading the results store: runs picked by a REF (run id, commit or label), their measurements, the history.

Only successful runs are compared. Within a REF a configuration's runs are its newest run and every other run of
it there at the same commit on the same machine (`bench run --repeats`, or several invocations under one label).
A run id names that one run. The drift between invocations comes from drift_groups: runs where the code did not
change.
"""

import datetime

import sqlalchemy as sa

from service.bench.store import StoreError
from service.bench.store.schema import measurements, runs, samples, verdicts

r = runs.c


def _select_runs():
    return sa.select(runs).where(r.status == "ok")


def resolve(store, ref: str, kind: str | None = None) -> list[dict]:
    """The newest run of each configuration a REF names (a run id, a commit or its prefix, a label), newest first."""
    return [group[0] for group in resolve_groups(store, ref, kind)]


def resolve_groups(store, ref: str, kind: str | None = None) -> list[list[dict]]:
    """Per configuration, newest first: its newest run under the REF and the others at that commit and machine."""
    queries = []
    if ref.isdigit():
        queries.append(("run id", _select_runs().where(r.id == int(ref))))
    if len(ref) >= 4 and all(ch in "0123456789abcdef" for ch in ref.lower()):
        queries.append(("commit", _select_runs().where(r.git_commit.like(ref.lower() + "%"))))
    queries.append(("label", _select_runs().where(r.label == ref)))
    with store.begin() as conn:
        for what, query in queries:
            if kind:
                query = query.where(r.kind == kind)
            found = [row._asdict() for row in conn.execute(query.order_by(r.id.desc()))]
            if what == "commit" and len({f["git_commit"] for f in found}) > 1:
                raise StoreError(f"the commit prefix {ref!r} is ambiguous: "
                                 + ", ".join(sorted({f['git_commit'][:12] for f in found})))
            if found:
                groups: dict[str, list[dict]] = {}
                for row in found:
                    group = groups.setdefault(row["config_hash"], [row])
                    if row is not group[0] and (row["git_commit"], row["machine_id"]) == (
                            group[0]["git_commit"], group[0]["machine_id"]):
                        group.append(row)
                return list(groups.values())
    raise StoreError(f"no successful run matches {ref!r} (a run id, a commit or a label)"
                     + (f" of kind {kind!r}" if kind else ""))


def drift_groups(store, sides: list[dict]) -> list[list[dict]]:
    """The runs of the sides' configuration and kind on their machines, by label, commit and machine: groups in which
    the code did not change, whose invocations measure the drift between invocations. A commit alone is no such
    group (a slowdown injected without a commit, e.g. on PYTHONPATH, shares it), so unlabelled runs count only from
    a tree not known to be dirty; within a label, only one commit on one machine. Each group holds the runs' id, label, git_commit,
    machine_id and invocation (None before schema version 4: each such run is its own invocation)."""
    first = sides[0]
    query = (sa.select(r.id, r.label, r.git_commit, r.machine_id, r.invocation)
             .where(r.status == "ok", r.kind == first["kind"], r.config_hash == first["config_hash"],
                    r.machine_id.in_({s["machine_id"] for s in sides}),
                    sa.or_(r.label.is_not(None), r.git_dirty.is_(None), r.git_dirty == sa.false()))
             .order_by(r.id))
    groups: dict[tuple, list[dict]] = {}
    with store.begin() as conn:
        for row in conn.execute(query):
            groups.setdefault((row.label, row.git_commit, row.machine_id), []).append(row._asdict())
    return list(groups.values())


def values(store, run_ids: list[int]) -> dict[int, dict[str, tuple[str | None, list[float]]]]:
    """run id -> metric -> (unit, values in iteration order)."""
    m = measurements.c
    out: dict[int, dict] = {i: {} for i in run_ids}
    query = sa.select(m.run_id, m.metric, m.unit, m.value).where(m.run_id.in_(run_ids)).order_by(m.run_id, m.iteration, m.id)
    with store.begin() as conn:
        for row in conn.execute(query):
            out[row.run_id].setdefault(row.metric, (row.unit, []))[1].append(row.value)
    return out


def history(store, kind=None, config=None, commit=None, label=None, status=None, limit=50) -> list[dict]:
    """Runs newest first; `config` matches a hash prefix or a name substring."""
    query = sa.select(r.id, r.kind, r.name, r.config_hash, r.label, r.status, r.error, r.started_at, r.ended_at,
                      r.git_commit, r.git_branch, r.git_dirty, r.host)
    if kind:
        query = query.where(r.kind == kind)
    if config:
        query = query.where(sa.or_(r.config_hash.like(config + "%"), r.name.contains(config)))
    if commit:
        query = query.where(r.git_commit.like(commit + "%"))
    if label:
        query = query.where(r.label == label)
    if status:
        query = query.where(r.status == status)
    with store.begin() as conn:
        return [row._asdict() for row in conn.execute(query.order_by(r.id.desc()).limit(limit))]


def commit_series(store, config_hash: str, kind: str, commits: int) -> list[dict]:
    """The newest successful run of a configuration at each of its last `commits` commits, oldest first."""
    query = (_select_runs().where(r.config_hash == config_hash, r.kind == kind, r.git_commit.is_not(None))
             .order_by(r.id.desc()))
    per_commit = {}
    with store.begin() as conn:
        for row in conn.execute(query):
            if row.git_commit not in per_commit:
                per_commit[row.git_commit] = row._asdict()
            if len(per_commit) == commits:
                break
    return list(reversed(per_commit.values()))


def table_rows(store, table: sa.Table, run_ids: list[int] | None) -> list[dict]:
    query = sa.select(table)
    if run_ids is not None:
        query = query.where((table.c.id if table is runs else table.c.run_id).in_(run_ids))
    with store.begin() as conn:
        return [row._asdict() for row in conn.execute(query.order_by(table.c.id))]


TABLES = {"runs": runs, "measurements": measurements, "samples": samples}  # what bench export writes


def save_verdicts(store, rows: list[dict], baseline_ref: str, candidate_ref: str, threshold: float) -> None:
    """Keep what one regress call concluded (one created_at for all its rows), for the dashboard."""
    now = datetime.datetime.now(datetime.timezone.utc)
    with store.begin() as conn:
        conn.execute(verdicts.insert(), [
            {"created_at": now, "baseline_ref": baseline_ref, "candidate_ref": candidate_ref,
             "baseline_run_id": r["baseline_run"], "candidate_run_id": r["candidate_run"], "metric": r["metric"],
             "baseline_median": r["baseline"], "candidate_median": r["candidate"], "ratio": r["ratio"],
             "ratio_low": r["low"], "ratio_high": r["high"], "verdict": r["verdict"], "threshold": threshold}
            for r in rows])
