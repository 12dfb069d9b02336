"""The results store, each test on SQLite and on a real PostgreSQL (tests/bench_db.py)."""

import subprocess
import threading

import pytest
import sqlalchemy as sa

from service.bench.store import StoreError, open_store
from service.bench.store import schema
from service.bench.store.provenance import SOURCE_TREE, stable_hash


def rows(url, table, **where):
    with sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://")).connect() as conn:
        query = sa.select(table).where(*[table.c[k] == v for k, v in where.items()]).order_by(table.c.id)
        return [r._asdict() for r in conn.execute(query)]


def test_a_run_is_stored_with_its_measurements_samples_commit_and_machine(store_url):
    store = open_store(store_url)
    with store.run(kind="model", config={"model": "m", "batch": 4}, label="first") as run:
        run.measure("forward_seconds", 0.25, unit="s", iteration=0)
        run.measure("forward_seconds", 0.5, unit="s", iteration=1)
        run.sample({"cpu_percent": 12.0, "rss_bytes": 1e9}, t=1.5)
    [stored] = rows(store_url, schema.runs)
    assert stored["id"] == run.id
    assert (stored["kind"], stored["status"], stored["error"], stored["label"]) == ("model", "ok", None, "first")
    assert stored["config"] == {"model": "m", "batch": 4}
    assert stored["config_hash"] == stable_hash({"batch": 4, "model": "m"})
    head = subprocess.run(["git", "-C", str(SOURCE_TREE), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert stored["git_commit"] == head.strip()
    assert stored["machine"]["cpu_count"] > 0 and stored["host"] == stored["machine"]["host"]
    assert set(stored["versions"]) == {"python", "torch", "transformers", "llm-service"}
    assert stored["ended_at"] >= stored["started_at"]
    assert [(m["metric"], m["unit"], m["iteration"], m["value"]) for m in rows(store_url, schema.measurements)] == [
        ("forward_seconds", "s", 0, 0.25), ("forward_seconds", "s", 1, 0.5)]
    assert [(s["t"], s["metric"], s["value"]) for s in rows(store_url, schema.samples)] == [
        (1.5, "cpu_percent", 12.0), (1.5, "rss_bytes", 1e9)]


def test_a_run_that_raises_is_stored_as_failed_and_keeps_its_measurements(store_url):
    store = open_store(store_url)
    with pytest.raises(RuntimeError, match="out of blocks"):
        with store.run(kind="run", config={"b": 1}) as run:
            run.measure("wall_seconds", 1.0, unit="s", iteration=0)
            raise RuntimeError("out of blocks")
    [stored] = rows(store_url, schema.runs)
    assert (stored["status"], stored["error"]) == ("failed", "RuntimeError: out of blocks")
    assert [m["value"] for m in rows(store_url, schema.measurements, run_id=run.id)] == [1.0]


def test_reopening_keeps_earlier_history(store_url):
    for i in range(2):
        with open_store(store_url).run(kind="run", config={"i": i}) as run:
            run.measure("wall_seconds", float(i), iteration=0)
    assert [r["config"] for r in rows(store_url, schema.runs)] == [{"i": 0}, {"i": 1}]
    assert [m["value"] for m in rows(store_url, schema.measurements)] == [0.0, 1.0]


def test_config_hash_ignores_key_order_and_tells_settings_apart():
    assert stable_hash({"a": 1, "b": [1, 2]}) == stable_hash({"b": [1, 2], "a": 1})
    assert stable_hash({"a": 1}) != stable_hash({"a": 2})
    assert len(stable_hash({})) == 16


def test_samples_from_another_thread_land_in_the_same_run(store_url):
    store = open_store(store_url)
    with store.run(kind="run", config={}) as run:
        threads = [threading.Thread(target=lambda k=k: [run.sample({"cpu_percent": float(k)}, t=i * 0.1)
                                                       for i in range(300)]) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(rows(store_url, schema.samples, run_id=run.id)) == 900


def test_environment_sets_the_commit_when_there_is_no_working_tree(store_url, monkeypatch):
    monkeypatch.setenv("LLM_BENCH_COMMIT", "abc123")
    monkeypatch.setenv("LLM_BENCH_DIRTY", "1")
    with open_store(store_url).run(kind="run", config={}):
        pass
    [stored] = rows(store_url, schema.runs)
    assert (stored["git_commit"], stored["git_dirty"], stored["git_branch"]) == ("abc123", True, None)


def test_a_newer_schema_version_is_refused_and_nothing_is_changed(store_url):
    with open_store(store_url).run(kind="run", config={}) as run:
        run.measure("wall_seconds", 2.0)
    engine = sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(schema.meta.update().values(value=str(schema.SCHEMA_VERSION + 1)))
    with pytest.raises(StoreError) as caught:
        open_store(store_url)
    message = str(caught.value)
    assert f"schema version {schema.SCHEMA_VERSION + 1}, newer than this program's {schema.SCHEMA_VERSION}" in message
    assert "\n" not in message
    assert [m["value"] for m in rows(store_url, schema.measurements)] == [2.0]


def test_an_unreachable_database_is_one_line_without_the_password(unused_port):
    with pytest.raises(StoreError) as caught:
        open_store(f"postgresql://bench:s3cret@127.0.0.1:{unused_port}/bench")
    message = str(caught.value)
    assert message.startswith(f"cannot open the results database postgresql+psycopg://bench:***@127.0.0.1:{unused_port}/bench: ")
    assert "s3cret" not in message and "\n" not in message


def test_a_bare_path_is_a_sqlite_file(tmp_path):
    path = tmp_path / "sub" / "results.db"
    with open_store(str(path)).run(kind="run", config={}):
        pass
    assert path.exists()


@pytest.fixture
def unused_port():
    from tests.conftest import free_port
    return free_port()


def _old_database(store_url, version: int, dropped: set[str]) -> sa.Engine:
    """A database as `version` of the schema made it (bench_runs without the `dropped` columns), with one run."""
    engine = sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://"))
    old_runs = sa.Table(schema.runs.name, sa.MetaData(),
                        *[c._copy() for c in schema.runs.columns if c.name not in dropped])
    with engine.begin() as conn:
        for table in (schema.meta, old_runs, schema.measurements, schema.samples):
            table.create(conn)
        if version >= 2:
            schema.verdicts.create(conn)
        conn.execute(schema.meta.insert().values(key="schema_version", value=str(version)))
        conn.execute(old_runs.insert().values(kind="run", name="old", config={}, config_hash="0" * 16,
                                              status="ok", started_at=sa.func.now()))
    return engine


def test_a_version_1_database_is_upgraded_in_place_and_keeps_its_runs(store_url):
    # version 1: no verdicts table, no client_saturated column (version 3), no invocation column (version 4)
    engine = _old_database(store_url, 1, {"client_saturated", "invocation"})
    open_store(store_url)
    with engine.connect() as conn:
        assert conn.execute(sa.select(schema.meta.c.value)).scalar() == str(schema.SCHEMA_VERSION) == "4"
        assert "bench_verdicts" in sa.inspect(conn).get_table_names()
        assert {"client_saturated", "invocation"} <= {c["name"] for c in sa.inspect(conn).get_columns("bench_runs")}
    assert [(r["name"], r["client_saturated"], r["invocation"]) for r in rows(store_url, schema.runs)] == [
        ("old", None, None)]


def test_a_version_3_database_is_upgraded_to_4_and_its_old_runs_have_no_invocation(store_url):
    engine = _old_database(store_url, 3, {"invocation"})
    with open_store(store_url).run(kind="run", config={}):
        pass
    with engine.connect() as conn:
        assert conn.execute(sa.select(schema.meta.c.value)).scalar() == "4"
    old, new = rows(store_url, schema.runs)
    assert (old["name"], old["invocation"]) == ("old", None) and len(new["invocation"]) == 16


def test_the_runs_one_store_records_share_its_invocation_and_another_store_has_its_own(store_url):
    first, second = open_store(store_url), open_store(store_url)  # as two `bench run` processes open theirs
    for store in (first, first, second):
        with store.run(kind="run", config={}):
            pass
    assert [r["invocation"] for r in rows(store_url, schema.runs)] == [first.invocation] * 2 + [second.invocation]
    assert first.invocation != second.invocation


def test_a_run_whose_last_write_fails_is_closed_as_failed_not_left_running(store_url):
    with pytest.raises(StoreError) as caught:
        with open_store(store_url).run(kind="run", config={}) as run:
            run.measure(None, 1.0)  # metric is NOT NULL: the final flush is refused
    [stored] = rows(store_url, schema.runs)
    assert stored["status"] == "failed" and stored["ended_at"] is not None
    assert stored["error"] == f"StoreError: {caught.value}"
    assert str(caught.value).startswith("cannot write to ") and "\n" not in str(caught.value)


def test_a_sampler_that_cannot_write_stops_and_raises_one_store_error_on_exit(tmp_path, monkeypatch):
    from service.bench.store import store as store_module
    from service.bench.store.sampler import DeviceSampler
    monkeypatch.setattr(store_module, "FLUSH_ROWS", 1)  # every sample is written at once
    store = open_store(str(tmp_path / "results.db"))
    with pytest.raises(StoreError) as caught:
        with store.run(kind="run", config={}) as run:
            with store.engine.begin() as conn:
                schema.samples.drop(conn)
            sampler = DeviceSampler(run, interval=0.01)
            with sampler:
                sampler._thread.join(timeout=10)  # the loop ends on its own at the first refused write
    assert str(caught.value).startswith("cannot write to ") and "\n" not in str(caught.value)
    assert not sampler._thread.is_alive()
