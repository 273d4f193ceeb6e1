"""A child process of a replica lives exactly as long as its parent wants: the engine process
(its API process decides when it ends, by closing its socket) and the tensor-parallel ranks
(rank 0, the engine, closes them).

SIGTERM and SIGINT are the API process's to act on: a first SIGTERM drains, handing the running
streams on while this engine still computes them (replica.api.drain). A signal to the whole process
group (systemd's default control-group stop, Ctrl-C in a terminal, a test's teardown) reaches the
children too, and used to kill the engine under its drain ("engine process exited (code -15)").
So the children ignore both, and the kernel kills each with its parent (Linux's PR_SET_PDEATHSIG;
elsewhere the end of the socket or the process group ends them)."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it exits


def follow_parent() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
