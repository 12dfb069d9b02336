"""`bench history`: the stored runs, newest first, filtered by kind, configuration, commit, label or status."""

import argparse
import sys

from rich.console import Console
from rich.table import Table

from service.bench.regress import queries
from service.bench.store import StoreError, add_db_argument, open_store


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="service bench history", description=__doc__)
    ap.add_argument("--kind", help="run, offline, serve, model, kernel ...")
    ap.add_argument("--config", help="a configuration hash prefix or part of its name")
    ap.add_argument("--commit", help="a commit or its prefix")
    ap.add_argument("--label", help="only runs stored under this label")
    ap.add_argument("--status", choices=["ok", "failed", "running"], help="only runs with this status")
    ap.add_argument("--limit", type=int, default=50, help="newest N runs (default %(default)s)")
    add_db_argument(ap)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    console = Console() if Console().is_terminal else Console(width=160)
    try:
        store = open_store(args.db)
        rows = queries.history(store, args.kind, args.config, args.commit, args.label, args.status, args.limit)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    table = Table(title=f"{len(rows)} runs in {store.url}, newest first", title_justify="left")
    for col in ("id", "kind", "configuration", "hash", "label", "status", "started (UTC)", "s", "commit", "host"):
        table.add_column(col)
    for r in rows:
        took = f"{(r['ended_at'] - r['started_at']).total_seconds():.0f}" if r["ended_at"] else "-"
        commit = (r["git_commit"] or "-")[:10] + ("+dirty" if r["git_dirty"] else "")
        status = r["status"] if not r["error"] else f"{r['status']}: {r['error'][:60]}"
        table.add_row(str(r["id"]), r["kind"], r["name"], r["config_hash"], r["label"] or "", status,
                      r["started_at"].strftime("%Y-%m-%d %H:%M:%S"), took, commit, r["host"] or "")
    console.print(table)
    return rows
