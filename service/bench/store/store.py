"""The results store: open a database (SQLite file or PostgreSQL), record runs into it, read them back.

Writes are buffered per run and flushed in small transactions, so a failure midway keeps what was measured;
a run that raises is stored as failed with its error, and the exception goes on up.
"""

import argparse
import contextlib
import datetime
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from service.bench.store import provenance, schema
from service.bench.store.errors import StoreError

FLUSH_ROWS, FLUSH_SECONDS = 500, 5.0


def default_url() -> str:
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return f"sqlite:///{data / 'llm-service' / 'bench.db'}"


def add_db_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=os.environ.get("LLM_BENCH_DB") or default_url(), metavar="URL",
                        help="results store: sqlite:///PATH, a plain file path, or postgresql://USER@HOST/DB "
                             "(env LLM_BENCH_DB; default %(default)s, i.e. $XDG_DATA_HOME/llm-service/bench.db). "
                             "Git commit/branch/subject/dirty come from the working tree; LLM_BENCH_COMMIT, "
                             "LLM_BENCH_BRANCH, LLM_BENCH_SUBJECT, LLM_BENCH_DIRTY override them")


def _url(text: str) -> sa.URL:
    if "://" not in text:  # a bare path is a SQLite file
        text = f"sqlite:///{Path(text).expanduser().resolve()}"
    try:
        url = sa.make_url(text)
    except sa.exc.ArgumentError as exc:
        raise StoreError(f"not a database URL: {text!r}") from exc
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def open_store(url: str | None = None, git: dict | None = None) -> "Store":
    """Connect, then create or upgrade the schema; StoreError (one line) when that is impossible.
    `git` overrides what is read from the working tree (keys commit, branch, subject, dirty)."""
    parsed = _url(url or os.environ.get("LLM_BENCH_DB") or default_url())
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = None
    try:
        engine = sa.create_engine(parsed, connect_args={"connect_timeout": 10}
                                  if parsed.get_backend_name() == "postgresql" else {})
        with engine.begin() as conn:
            schema.prepare(conn)
    except (StoreError, sa.exc.SQLAlchemyError, ImportError, OSError) as exc:
        if engine is not None:  # close the pooled connection of a store we refuse
            engine.dispose()
        if isinstance(exc, StoreError):
            raise StoreError(f"{shown}: {exc}") from None
        raise StoreError(f"cannot open the results database {shown}: {_one_line(exc)}") from None
    return Store(engine, shown, git)


def open_store_or_exit(url: str | None = None) -> "Store":
    """open_store for a command: a store that cannot be opened ends it with the one-line reason, exit status 2."""
    try:
        return open_store(url)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class Run:
    """One stored run. measure() and sample() may be called from different threads."""

    def __init__(self, store: "Store", run_id: int, started: float):
        self.store, self.id, self._started = store, run_id, started
        self.client_saturated: bool | None = None  # a load run sets it; stored when the run ends
        self._lock = threading.Lock()
        self._pending: dict[sa.Table, list[dict]] = {schema.measurements: [], schema.samples: []}
        self._flushed = time.monotonic()

    def measure(self, metric: str, value: float, unit: str | None = None, iteration: int = 0) -> None:
        self._add(schema.measurements, {"run_id": self.id, "metric": metric, "unit": unit,
                                        "iteration": int(iteration), "value": float(value)})

    def sample(self, values: dict[str, float], t: float | None = None) -> None:
        """Device readings at `t` seconds since the run started (default: now)."""
        t = time.perf_counter() - self._started if t is None else t
        for metric, value in values.items():
            if value is not None:
                self._add(schema.samples, {"run_id": self.id, "t": float(t), "metric": metric, "value": float(value)})

    def _add(self, table: sa.Table, row: dict) -> None:
        with self._lock:
            self._pending[table].append(row)
            due = sum(map(len, self._pending.values())) >= FLUSH_ROWS or time.monotonic() - self._flushed > FLUSH_SECONDS
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending = {t: rows for t, rows in self._pending.items() if rows}
            self._pending = {t: [] for t in self._pending}
            self._flushed = time.monotonic()
        if pending:
            try:
                with self.store.engine.begin() as conn:
                    for table, rows in pending.items():
                        conn.execute(table.insert(), rows)
            except sa.exc.SQLAlchemyError as exc:
                raise StoreError(f"cannot write to {self.store.url}: {_one_line(exc)}") from None


class Store:
    def __init__(self, engine: sa.Engine, shown_url: str, git: dict | None = None):
        self.engine, self.url, self.git = engine, shown_url, git
        # every run this store records carries it: a command opens one store, so its runs share one invocation
        self.invocation = uuid.uuid4().hex[:16]

    @contextlib.contextmanager
    def begin(self):
        """A transaction for readers of the store: a database error becomes a one-line StoreError."""
        try:
            with self.engine.begin() as conn:
                yield conn
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"cannot read or write {self.url}: {_one_line(exc)}") from None

    @contextlib.contextmanager
    def run(self, kind: str, config: dict, label: str | None = None, name: str | None = None):
        """Record one run: yields a Run; ok when the block ends, failed (with the error) when it raises."""
        git = provenance.git_info(self.git)
        machine = provenance.machine_info() | provenance.runtime()
        config_hash = provenance.stable_hash(config)
        row = {"kind": kind, "name": name or f"{kind}-{config_hash[:8]}", "config": config,
               "config_hash": config_hash, "label": label, "status": "running", "started_at": _now(),
               "git_commit": git["commit"], "git_branch": git["branch"], "git_subject": git["subject"],
               "git_dirty": git["dirty"], "host": machine["host"], "machine_id": provenance.machine_id(machine),
               "machine": machine, "versions": provenance.versions(), "invocation": self.invocation}
        try:
            with self.engine.begin() as conn:
                run_id = conn.execute(schema.runs.insert().values(**row)).inserted_primary_key[0]
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"cannot record a run in {self.url}: {_one_line(exc)}") from None
        run = Run(self, run_id, time.perf_counter())
        status, error = "ok", None
        try:
            yield run
        except BaseException as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}".strip()
            raise
        finally:
            lost = None
            try:
                run.flush()
            except StoreError as exc:  # still close the run, as failed, rather than leave it 'running'
                if status == "ok":  # no exception on its way up: this one goes instead, after the update
                    lost, status, error = exc, "failed", f"StoreError: {exc}"
            try:
                with self.engine.begin() as conn:
                    conn.execute(schema.runs.update().where(schema.runs.c.id == run_id)
                                 .values(status=status, error=error, ended_at=_now(),
                                         client_saturated=run.client_saturated))
            except sa.exc.SQLAlchemyError as exc:
                raise StoreError(f"cannot finish run {run_id} in {self.url}: {_one_line(exc)}") from None
            if lost is not None:
                raise lost

    def find_done(self, kind: str, config_hash: str, label: str | None = None) -> list[int]:
        """The ids of the finished runs of this configuration at the current commit on this machine, newest first."""
        git = provenance.git_info(self.git)
        r = schema.runs.c
        query = (sa.select(r.id).where(r.kind == kind, r.config_hash == config_hash, r.status == "ok",
                                       r.git_commit == git["commit"],
                                       r.machine_id == provenance.machine_id(provenance.machine_info()))
                 .order_by(r.id.desc()))
        query = query.where(r.label.is_(None) if label is None else r.label == label)
        with self.begin() as conn:
            return list(conn.execute(query).scalars())
