"""Processes that die with the server: the gate's HAProxy with the process that started it (Linux
``PR_SET_PDEATHSIG``, ``die_with_parent``); job workers, forked by the server's fork server rather
than by the server itself, with the server's process (``die_with``)."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time

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


def die_with(pid: int) -> None:
    """Kills this process (SIGKILL, as ``die_with_parent`` has the kernel do) as soon as the process
    ``pid`` ends, whatever its relation to this one: a daemon thread waits on a pidfd of ``pid``
    (Linux 5.3 and later; elsewhere it looks every half second).  When ``pid`` is already gone, it
    exits now."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfds here: look whether the process is still there
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has ended
        else:
            while _alive(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="hmi-die-with", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True
