"""Where a run came from: the git commit of the code that ran, the machine, and the library versions.

Git is read from the working tree this package lives in; LLM_BENCH_COMMIT, LLM_BENCH_BRANCH, LLM_BENCH_SUBJECT
and LLM_BENCH_DIRTY (0/1) override it (a CI checkout without .git, or a run recorded on behalf of a commit).
"""

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import psutil

SOURCE_TREE = Path(__file__).resolve().parents[3]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(SOURCE_TREE), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_info(overrides: dict | None = None) -> dict:
    """commit, branch, subject and dirty; from `overrides`, then the environment, then the working tree."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    env = {"commit": os.environ.get("LLM_BENCH_COMMIT"), "branch": os.environ.get("LLM_BENCH_BRANCH"),
           "subject": os.environ.get("LLM_BENCH_SUBJECT"), "dirty": os.environ.get("LLM_BENCH_DIRTY")}
    info = {k: v for k, v in env.items() if v is not None} | overrides
    if "dirty" in info and isinstance(info["dirty"], str):
        info["dirty"] = info["dirty"].lower() in ("1", "true", "yes")
    if "commit" not in info and (commit := _git("rev-parse", "HEAD")):
        info["commit"] = commit
        info.setdefault("branch", _git("rev-parse", "--abbrev-ref", "HEAD"))
        info.setdefault("subject", _git("log", "-1", "--format=%s"))
        # untracked files count too: a new module can change what runs
        info.setdefault("dirty", bool(_git("status", "--porcelain")))
    return {k: info.get(k) for k in ("commit", "branch", "subject", "dirty")}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[dict]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no device
        return []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append({"name": pynvml.nvmlDeviceGetName(h), "driver": driver,
                         "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total})
        return gpus
    finally:
        pynvml.nvmlShutdown()


@functools.cache
def machine_info() -> dict:
    return {"host": platform.node(), "os": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "gpus": _gpus()}


def runtime() -> dict:
    """Settings of this process that change speed without being part of a configuration (recorded, not hashed)."""
    found = {"omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "load_average_1m": os.getloadavg()[0]}
    torch = sys.modules.get("torch")  # only when the benchmark imported it: recording never imports torch
    if torch is not None:
        found["torch_threads"] = torch.get_num_threads()
    return found


def machine_id(machine: dict) -> str:
    """The same host with the same CPU and GPUs is the same machine (its OS patch level is not part of it)."""
    key = {k: machine.get(k) for k in ("host", "cpu", "cpu_count", "memory_bytes")}
    key["gpus"] = [g["name"] for g in machine.get("gpus", [])]
    return stable_hash(key)


def versions() -> dict:
    """Read from the installed distributions, so that recording a run never imports torch."""
    found = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "llm-service"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def stable_hash(value) -> str:
    """16 hex digits of SHA-256 over canonical JSON: equal for equal settings, whatever their key order."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
