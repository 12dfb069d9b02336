"""The flags every `bench` command spells the same way, added from this one place
(docs/benchmarking.md#flags-shared-by-every-bench-command).

Style: `--url` is the server; `--json PATH` and `--csv PATH` are where a command writes its result and its rows;
a setting that is on or off is `--NAME on|off`; `--warmup N` and `--iterations N` count iterations (left out and
measured), `--warmup-seconds S` is a duration.
An old spelling keeps working for now through `deprecated_alias`, which says on stderr what replaces it.
"""

import argparse
import sys

_UNSET = object()


def on_off(text: str) -> bool:
    """'on' -> True, 'off' -> False (the value of every --NAME on|off)."""
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value == "on"


class _BareSwitch(argparse.Action):
    """`--NAME on|off` that still takes a bare `--NAME` (the old spelling of `--NAME on`), with a deprecation."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            print(f"{parser.prog}: a bare {option_string} is deprecated and will be removed; use {option_string} on",
                  file=sys.stderr)
        setattr(namespace, self.dest, True if values is None else values)


def add_switch(ap, name: str, default: bool | None, help: str, dest: str | None = None,
               bare_deprecated: bool = False) -> argparse.Action:
    """`--NAME on|off`; default None leaves the choice to the command (help says what it then does).

    bare_deprecated: a bare `--NAME` used to mean on; it still does, with a deprecation message.
    """
    shown = "" if default is None else f" (default {'on' if default else 'off'})"
    extra = {"dest": dest} if dest else {}
    if bare_deprecated:
        extra |= {"nargs": "?", "action": _BareSwitch}
    return ap.add_argument(f"--{name}", type=on_off, default=default, metavar="on|off", help=help + shown, **extra)


def add_url(ap, default: str | None, help: str, dest: str | None = None) -> argparse.Action:
    return ap.add_argument("--url", default=default, metavar="URL", help=help, **({"dest": dest} if dest else {}))


def add_json(ap, help: str = "write the result here as JSON", dest: str | None = None) -> argparse.Action:
    return ap.add_argument("--json", default=None, metavar="PATH", help=help, **({"dest": dest} if dest else {}))


def add_csv(ap, help: str, dest: str | None = None) -> argparse.Action:
    return ap.add_argument("--csv", default=None, metavar="PATH", help=help, **({"dest": dest} if dest else {}))


def add_warmup(ap, default: int | None, help: str = "warm-up iterations, not measured") -> argparse.Action:
    shown = "" if default is None else " (default %(default)s)"
    return ap.add_argument("--warmup", type=int, default=default, metavar="N", help=help + shown)


def add_iterations(ap, default: int | None, help: str = "measured iterations",
                   dest: str | None = None) -> argparse.Action:
    shown = "" if default is None else " (default %(default)s)"
    return ap.add_argument("--iterations", type=int, default=default, metavar="N", help=help + shown,
                           **({"dest": dest} if dest else {}))


def add_warmup_seconds(ap, default: float, help: str, dest: str | None = None) -> argparse.Action:
    return ap.add_argument("--warmup-seconds", type=float, default=default, metavar="S",
                           help=help + " (default %(default)s)", **({"dest": dest} if dest else {}))


def add_workers(ap) -> argparse.Action:
    """--workers N: the load generator's processes (bench serve, capacity and soak)."""
    from service.bench.loadgen.send.workers import default_workers  # only the commands that send load need it

    return ap.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                           help="load generator processes, each with its own event loop and share of the "
                                "concurrency (default: one per CPU but one, here %(default)s)")


def add_progress(ap) -> None:
    """--progress on|off (a progress bar while running), and the old --no-progress."""
    deprecated_alias(ap, "--no-progress", add_switch(ap, "progress", True, "a progress bar while running"),
                     value=False)


class _Deprecated(argparse.Action):
    """An old spelling: sets what its replacement sets and says on stderr which spelling to use instead."""

    def __init__(self, option_strings, dest, instead: str, value=_UNSET, **kwargs):
        self.instead, self.value = instead, value
        super().__init__(option_strings, dest, nargs=0 if value is not _UNSET else None, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is deprecated and will be removed; use {self.instead}",
              file=sys.stderr)
        setattr(namespace, self.dest, values if self.value is _UNSET else self.value)


def deprecated_alias(ap, old: str, new: argparse.Action, value=_UNSET) -> None:
    """Accept `old` for now as `new` (the action an add_* call returned), with a deprecation message on stderr.

    Without `value`, `old` takes an argument as `new` does (`--result-json PATH` for `--json PATH`); with it,
    `old` is a bare flag that sets `value` (`--no-compile` for `--compile off`: value=False).
    """
    instead = new.option_strings[0]
    if value is not _UNSET:
        instead += " " + (("on" if value else "off") if isinstance(value, bool) else str(value))
    ap.add_argument(old, action=_Deprecated, dest=new.dest, instead=instead, value=value,
                    **({} if value is not _UNSET else {"type": new.type, "metavar": new.metavar}))
