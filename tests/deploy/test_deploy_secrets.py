"""The compose stack's secrets: deploy/secrets_init.py run as its container runs it, and the compose wiring.

Compose cannot start containers here, so the generator runs as a plain process on a temporary folder (its
container runs the same file with the same environment), and `docker-compose config` shows that PostgreSQL,
Grafana and its data source read the files it writes.
"""

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import needs_tools
from tests.deploy.test_deploy_config import COMPOSE, DEPLOY, SECRETS, compose_config, datasources, mounts

SCRIPT = DEPLOY / "secrets_init.py"
NAMES = ("POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD")
URL_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def run(folder: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """One start of the init container (or a `show`), with a strict umask: the modes must not depend on it."""
    clean = {"PATH": os.environ["PATH"], "SECRETS_DIR": str(folder), **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=clean, capture_output=True, text=True,
                          timeout=30, umask=0o077)


def stored(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


@pytest.fixture
def folder(tmp_path) -> Path:
    return tmp_path / "secrets"  # the volume's mount point; the first start creates it here


def test_first_start_generates_each_unset_secret_strong_and_prints_it_once(folder):
    done = run(folder)
    assert done.returncode == 0, done.stderr
    values = stored(folder)
    assert sorted(values) == sorted(NAMES)
    for name, value in values.items():
        assert len(value) == 32 and set(value) <= URL_SAFE, value  # 192 random bits, no escaping in a URL
        assert done.stdout.count(value) == 1
        assert f"{name}: generated {value} (printed this once; read it later: " \
               f"docker compose run --rm -T secrets-init show {name})" in done.stdout.splitlines()
    assert len(set(values.values())) == 2  # one value per secret


def test_secrets_are_readable_by_owner_and_group_only(folder):
    run(folder)
    # group 0 is the group of Grafana's user in its image; PostgreSQL's entrypoint reads its file as root
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750
    assert {n: stat.S_IMODE((folder / n).stat().st_mode) for n in NAMES} == {n: 0o640 for n in NAMES}
    assert sorted(p.name for p in folder.iterdir()) == sorted(NAMES)  # no temporary file left behind


def test_a_second_start_keeps_the_stored_secrets_and_prints_no_value(folder):
    run(folder)
    first = stored(folder)
    again = run(folder)
    assert again.returncode == 0, again.stderr
    assert stored(folder) == first
    assert again.stdout.splitlines() == [f"{n}: kept from the first start (read it: docker compose run --rm -T "
                                         f"secrets-init show {n})" for n in NAMES]


def test_a_value_set_in_the_environment_wins_is_stored_and_never_printed(folder):
    done = run(folder, env={"POSTGRES_PASSWORD": "operator's own"})
    assert done.returncode == 0, done.stderr
    values = stored(folder)
    assert values["POSTGRES_PASSWORD"] == "operator's own"
    assert len(values["GRAFANA_ADMIN_PASSWORD"]) == 32  # the unset one is still generated
    assert "operator's own" not in done.stdout
    assert done.stdout.splitlines()[0] == "POSTGRES_PASSWORD: from the environment"
    # set later, it replaces the stored value, and the log says what that does not change
    later = run(folder, env={"GRAFANA_ADMIN_PASSWORD": "changed"})
    assert stored(folder) == {**values, "GRAFANA_ADMIN_PASSWORD": "changed"}
    assert later.stdout.splitlines()[1].startswith("GRAFANA_ADMIN_PASSWORD: from the environment (replaces the "
                                                   "stored value: PostgreSQL and Grafana keep the password")
    assert stat.S_IMODE((folder / "GRAFANA_ADMIN_PASSWORD").stat().st_mode) == 0o640


def test_show_prints_every_stored_secret_or_one_alone_for_command_substitution(folder):
    before = run(folder, "show", "POSTGRES_PASSWORD")
    assert before.returncode == 1 and before.stdout == ""
    assert before.stderr == "POSTGRES_PASSWORD is not stored yet: `docker compose up` makes it at the first start\n"
    run(folder)
    values = stored(folder)
    every = run(folder, "show")
    assert every.returncode == 0 and every.stdout == "".join(f"{n}={values[n]}\n" for n in NAMES)
    one = run(folder, "show", "POSTGRES_PASSWORD")
    assert one.returncode == 0 and one.stdout == values["POSTGRES_PASSWORD"] + "\n"
    unknown = run(folder, "show", "API_KEY")
    assert unknown.returncode == 2 and "unknown secret API_KEY" in unknown.stderr


@needs_tools("docker-compose")
def test_compose_runs_the_generator_before_everything_that_reads_the_secrets_and_ships_no_password():
    services = compose_config(COMPOSE)["services"]  # no password in the environment: the bare `up`
    init = services["secrets-init"]
    assert init["entrypoint"] == ["python", "/secrets_init.py"] and init["command"] == ["init"]
    assert mounts(init)["/secrets_init.py"] == SCRIPT
    assert mounts(init, named=True) == {SECRETS: "secrets"}
    assert init["environment"] == {n: "" for n in NAMES}  # empty: generate
    for name in ("postgres", "grafana"):
        assert services[name]["depends_on"]["secrets-init"] == {"condition": "service_completed_successfully"}
        assert f"secrets:{SECRETS}:ro" in services[name]["volumes"]
    # every reader names a file the generator writes, in the folder the volume is mounted on
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == f"{SECRETS}/POSTGRES_PASSWORD"
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == f"{SECRETS}/GRAFANA_ADMIN_PASSWORD"
    [source] = [ds for ds in datasources() if ds["uid"] == "bench-postgres"]
    assert source["secureJsonData"] == {"password": f"$__file{{{SECRETS}/POSTGRES_PASSWORD}}"}
    assert source["user"] == services["postgres"]["environment"]["POSTGRES_USER"]
    for name, service in services.items():  # no password value anywhere in the stack's configuration
        assert not any("PASSWORD" in k and v for k, v in service.get("environment", {}).items()
                       if not k.endswith("FILE")), name
    # a user's own value reaches the generator, which stores it for the others
    given = compose_config(COMPOSE, env={"POSTGRES_PASSWORD": "mine"})["services"]
    assert given["secrets-init"]["environment"]["POSTGRES_PASSWORD"] == "mine"
    assert "POSTGRES_PASSWORD" not in given["postgres"]["environment"]


def test_the_generator_knows_the_stacks_secrets_and_the_folder_compose_mounts():
    spec = importlib.util.spec_from_file_location("secrets_init", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SECRETS == NAMES and module.FOLDER == SECRETS
