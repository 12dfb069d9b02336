"""The compose stack's secrets, made at its first start: no password ships with the stack, none must be typed.

Policy, for each name in SECRETS: a value set in the environment wins and is stored; else the stored value is
kept; else a new one is generated (32 URL-safe characters from `secrets`) and printed once, to this one-shot
container's log. Each secret is a file named after its variable in SECRETS_DIR (the `secrets` volume), read by
PostgreSQL (POSTGRES_PASSWORD_FILE, as root) and Grafana (`__FILE` variables and `$__file{}`, as user 472 of
group 0): files 0640 and the folder 0750, owned by root, readable by group 0 and nobody else.
`show` prints the stored values as NAME=value lines, `show NAME` one value alone (for `$(...)`).
Standard library only, so it runs in the plain Python image the alert sink uses.
"""

import os
import secrets
import sys
from pathlib import Path

SECRETS = ("POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD")
FOLDER = "/run/llm-secrets"  # where compose mounts the `secrets` volume; SECRETS_DIR moves it (the tests do)
DIR_MODE, FILE_MODE = 0o750, 0o640
SHOW = "docker compose run --rm -T secrets-init show"  # how a user reads them later (docs/deploy.md)


def store(path: Path, value: str) -> None:
    """Write atomically with FILE_MODE whatever the umask; no newline (PostgreSQL and Grafana take it as is)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), FILE_MODE)
        f.write(value)
    os.replace(tmp, path)


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def init(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(DIR_MODE)
    for name in SECRETS:
        path, given = folder / name, os.environ.get(name, "")
        stored = read(path)
        if given:
            if given != stored:
                store(path, given)
            note = (" (replaces the stored value: PostgreSQL and Grafana keep the password their data volumes were"
                    " created with until it is changed there, docs/deploy.md)") if stored and given != stored else ""
            print(f"{name}: from the environment{note}")
        elif stored:
            print(f"{name}: kept from the first start (read it: {SHOW} {name})")
        else:
            value = secrets.token_urlsafe(24)  # 24 bytes -> 32 characters of [A-Za-z0-9_-]: safe in a URL
            store(path, value)
            print(f"{name}: generated {value} (printed this once; read it later: {SHOW} {name})")


def show(folder: Path, names: list[str]) -> int:
    unknown = [n for n in names if n not in SECRETS]
    if unknown:
        print(f"unknown secret {unknown[0]}; the stack has {', '.join(SECRETS)}", file=sys.stderr)
        return 2
    values = {n: read(folder / n) for n in names or SECRETS}
    missing = [n for n, v in values.items() if not v]
    if missing:
        print(f"{missing[0]} is not stored yet: `docker compose up` makes it at the first start", file=sys.stderr)
        return 1
    for name, value in values.items():
        print(value if len(names) == 1 else f"{name}={value}")
    return 0


def main(argv: list[str]) -> int:
    folder = Path(os.environ.get("SECRETS_DIR", FOLDER))
    command, args = (argv[0], argv[1:]) if argv else ("init", [])
    if command == "init" and not args:
        init(folder)
        return 0
    if command == "show":
        return show(folder, args)
    print("usage: secrets_init.py [init | show [NAME]]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
