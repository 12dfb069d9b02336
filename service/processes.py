"""What every child process of ours asks of Linux, and of Python's garbage collector."""

import gc
import signal


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG), as a container kill would: a front end
    or the engine when the supervisor dies, a tensor-parallel rank when rank 0 dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


frozen = 0  # objects freeze_heap froze in this process (read by llm_gc_frozen_objects; gc.get_freeze_count walks them)


def freeze_heap() -> None:
    """Move every object alive now (modules, the model's and tokenizer's tables, everything loaded at start) out of
    the cyclic garbage collector's reach (gc.freeze), after one last collection. Without it each full collection
    walks them all again: in a front end that imported transformers for its tokenizer, a third of its CPU under load
    went to collections. Call it once a process has loaded what it keeps for its life, and only in a process that
    serves until it ends (not in one that hosts engines in turn, as the tests do: whatever of them is alive and in a
    cycle would never be freed); later calls do nothing."""
    global frozen
    if frozen:
        return
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
