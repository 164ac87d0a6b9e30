"""Child processes that die with the process that started them (Linux ``PR_SET_PDEATHSIG``): job
workers (``hmi.services.workers``) and the gate's HAProxy (``hmi.dispatcher.gate``)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (Linux; the parent *thread*
    that started it, so start children from a thread that lives as long as they should), and
    exits now if the parent is already gone (it died between spawning us and this call)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent still terminates its children on shutdown
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
