"""`bench export`: stored runs, measurements and device samples as CSV files or one JSON document.

CSV: DIR/runs.csv, DIR/measurements.csv, DIR/samples.csv (JSON columns as JSON text); JSON: one file with the
three lists. Filters pick runs as `bench history` does; measurements and samples follow their runs.
"""

import argparse
import csv
import datetime
import json
import sys
from pathlib import Path

from service.bench.regress import queries
from service.bench.store import StoreError, add_db_argument, open_store


def _plain(value):
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return value


def export(store, run_ids: list[int], fmt: str, out: str) -> list[str]:
    tables = {name: [{k: _plain(v) for k, v in row.items()} for row in queries.table_rows(store, table, run_ids)]
              for name, table in queries.TABLES.items()}
    if fmt == "json":
        Path(out).write_text(json.dumps(tables, indent=1))
        return [out]
    Path(out).mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in tables.items():
        path = Path(out) / f"{name}.csv"
        columns = [c.name for c in queries.TABLES[name].columns]
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()} for r in rows)
        written.append(str(path))
    return written


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(prog="service bench export", description=__doc__)
    ap.add_argument("--format", choices=["csv", "json"], default="csv",
                    help="CSV files in a folder, or one JSON file (default %(default)s)")
    ap.add_argument("--out", required=True, help="a directory for csv, a file for json")
    ap.add_argument("--kind", help="only runs of this kind: run, offline, serve, model, kernel ...")
    ap.add_argument("--config", help="a configuration hash prefix or part of its name")
    ap.add_argument("--commit", help="only runs of this commit or its prefix")
    ap.add_argument("--label", help="only runs stored under this label")
    ap.add_argument("--limit", type=int, default=None, help="newest N runs (default: all)")
    add_db_argument(ap)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        store = open_store(args.db)
        picked = queries.history(store, args.kind, args.config, args.commit, args.label, limit=args.limit)
        written = export(store, [r["id"] for r in picked], args.format, args.out)
    except (StoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"{len(picked)} runs -> " + ", ".join(written))
    return written
