"""Results-store databases for the tests: a SQLite file, and a real PostgreSQL started in a temporary directory.

The PostgreSQL cluster is Debian's (installed by deploy/install-tools.sh), run by the unprivileged `postgres`
user when the tests run as root, on a free loopback port, and removed afterwards. `store_url` gives each test
both databases, so one suite specifies the store on both.
"""

import glob
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from tests.conftest import free_port


def _pg_bin(tool: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"), key=lambda p: int(p.split("/")[4]))
    return found[-1] if found else shutil.which(tool)


@pytest.fixture(scope="session")
def postgres_server():
    """postgresql://postgres@127.0.0.1:PORT of a throwaway cluster (trust auth on loopback only)."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.fail("PostgreSQL missing: run deploy/install-tools.sh (make test does)")
    root = tempfile.mkdtemp(prefix="bench-pg-")
    as_user = []
    if os.geteuid() == 0:  # the server refuses to run as root
        shutil.chown(root, "postgres", "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), free_port()
    subprocess.run([*as_user, initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                   check=True, capture_output=True)
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={root} -c fsync=off"
    subprocess.run([*as_user, pg_ctl, "-D", data, "-o", options, "-l", os.path.join(root, "log"), "-w", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server):
    """A fresh database in the shared cluster."""
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_server.replace("postgresql://", "postgresql://") + "/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{postgres_server}/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'bench.db'}"
    return request.getfixturevalue("postgres_url")
