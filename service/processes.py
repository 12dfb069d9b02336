"""What every child process of ours asks of Linux."""

import signal


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG), as a container kill would: a front end
    or the engine when the supervisor dies, a tensor-parallel rank when rank 0 dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
