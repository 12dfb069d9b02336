"""The results store's one schema (SQLAlchemy Core, for SQLite and PostgreSQL alike) and its version.

A run has many measurements (one value per metric and iteration) and many device samples (one value per
metric and time offset). Rows are only ever added: nothing here updates or deletes a stored measurement.
"""

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# Raise it with every schema change and add the step that brings the previous version up to it to UPGRADES.
SCHEMA_VERSION = 4

# JSONB on PostgreSQL, so that Grafana can filter on config->>'model'; plain JSON text on SQLite
Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

metadata = sa.MetaData()

meta = sa.Table(
    "bench_meta", metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
)

runs = sa.Table(
    "bench_runs", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("kind", sa.String(32), nullable=False),             # run, offline, serve, model, kernel ...
    sa.Column("name", sa.String(256), nullable=False),            # readable configuration name
    sa.Column("config", Json, nullable=False),
    sa.Column("config_hash", sa.String(16), nullable=False),      # "the same configuration" across commits
    sa.Column("label", sa.String(256)),
    sa.Column("status", sa.String(16), nullable=False),           # running, ok, failed
    sa.Column("error", sa.Text),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("ended_at", sa.DateTime(timezone=True)),
    sa.Column("git_commit", sa.String(64)),
    sa.Column("git_branch", sa.String(256)),
    sa.Column("git_subject", sa.Text),
    sa.Column("git_dirty", sa.Boolean),
    sa.Column("host", sa.String(256)),
    sa.Column("machine_id", sa.String(16)),                       # hash of host, CPU, GPU: "the same machine"
    sa.Column("machine", Json),
    sa.Column("versions", Json),
    # since version 3: a load run whose generator fell behind (its latencies include the client's own queueing);
    # null for runs that send no load
    sa.Column("client_saturated", sa.Boolean),
    # since version 4: one id per process that recorded (a `bench run` and all its repeats share it), the unit of
    # the drift between invocations that `bench regress` judges against; null for older runs (each its own)
    sa.Column("invocation", sa.String(32)),
    sa.Index("ix_bench_runs_config", "config_hash", "git_commit"),
    sa.Index("ix_bench_runs_started", "started_at"),
)

measurements = sa.Table(
    "bench_measurements", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.Integer, sa.ForeignKey("bench_runs.id"), nullable=False),
    sa.Column("metric", sa.String(128), nullable=False),
    sa.Column("unit", sa.String(32)),
    sa.Column("iteration", sa.Integer, nullable=False),
    sa.Column("value", sa.Float, nullable=False),
    sa.Index("ix_bench_measurements_run", "run_id", "metric"),
)

samples = sa.Table(
    "bench_samples", metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.Integer, sa.ForeignKey("bench_runs.id"), nullable=False),
    sa.Column("t", sa.Float, nullable=False),                     # seconds since the run started
    sa.Column("metric", sa.String(128), nullable=False),
    sa.Column("value", sa.Float, nullable=False),
    sa.Index("ix_bench_samples_run", "run_id", "metric"),
)

verdicts = sa.Table(  # since version 2: what `bench regress` concluded, for the dashboard and for the record
    "bench_verdicts", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),  # one value for one regress call
    sa.Column("baseline_ref", sa.String(256), nullable=False),
    sa.Column("candidate_ref", sa.String(256), nullable=False),
    sa.Column("baseline_run_id", sa.Integer, sa.ForeignKey("bench_runs.id"), nullable=False),
    sa.Column("candidate_run_id", sa.Integer, sa.ForeignKey("bench_runs.id"), nullable=False),
    sa.Column("metric", sa.String(128), nullable=False),
    sa.Column("baseline_median", sa.Float, nullable=False),
    sa.Column("candidate_median", sa.Float, nullable=False),
    sa.Column("ratio", sa.Float),
    sa.Column("ratio_low", sa.Float),
    sa.Column("ratio_high", sa.Float),
    sa.Column("verdict", sa.String(16), nullable=False),
    sa.Column("threshold", sa.Float, nullable=False),
    sa.Index("ix_bench_verdicts_created", "created_at"),
)


# version -> the step from that version to the next, run inside the same transaction as the version bump
UPGRADES = {
    1: lambda conn: verdicts.create(conn),
    2: lambda conn: conn.execute(sa.text("ALTER TABLE bench_runs ADD COLUMN client_saturated BOOLEAN")),
    3: lambda conn: conn.execute(sa.text("ALTER TABLE bench_runs ADD COLUMN invocation VARCHAR(32)")),
}


def prepare(conn: sa.Connection) -> None:
    """Create the schema in an empty database or upgrade an older one; refuse a foreign or newer one."""
    from service.bench.store.errors import StoreError

    tables = set(sa.inspect(conn).get_table_names())
    if meta.name not in tables:
        if tables & {t.name for t in metadata.sorted_tables}:
            raise StoreError("the database holds bench tables but no schema version; it was not made by this program")
        metadata.create_all(conn)
        conn.execute(meta.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))
        return
    row = conn.execute(sa.select(meta.c.value).where(meta.c.key == "schema_version")).first()
    found = int(row.value) if row else 0
    if found > SCHEMA_VERSION:
        raise StoreError(f"the database has schema version {found}, newer than this program's {SCHEMA_VERSION}; "
                         "upgrade llm-service to use it")
    if found < 1:
        raise StoreError(f"the database has an unknown schema version {found}")
    for version in range(found, SCHEMA_VERSION):
        UPGRADES[version](conn)
    if found != SCHEMA_VERSION:
        conn.execute(meta.update().where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION)))
