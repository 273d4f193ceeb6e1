"""Who listens on a port: free before a launch, and this launch's own process once it answers.

`busy(host, ports)`: the ports something already listens on (a bind test, with
SO_REUSEADDR as the servers themselves bind, so a port whose last connections sit
in TIME_WAIT counts as free). `owner_check(pid, port)`: whether every socket
listening on `port` belongs to the process `pid` or one of its descendants (a
proxy's workers, for instance), read from /proc/net/tcp{,6} and /proc/PID/fd; None
where /proc cannot say (another OS), so the caller falls back to trusting the port.
"""

from __future__ import annotations

import contextlib
import os
import socket


def busy(host: str, ports: list[int]) -> list[int]:
    """The ports of `ports` that cannot be bound on `host` right now."""
    taken = []
    for port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                taken.append(port)
    return taken


def listening_inodes(port: int) -> set[int] | None:
    """Inodes of the TCP sockets listening on `port` (any address), or None without /proc."""
    found: set[int] | None = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        found = found or set()
        for row in rows:
            cols = row.split()
            # sl local_address rem_address st ... inode: local "0100007F:1F90", state 0A = LISTEN
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(cols[9]))
    return found


def family(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc/PID/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def socket_inodes(pid: int) -> set[int]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out.add(int(target[8:-1]))
    return out


def owner_check(pid: int, port: int) -> tuple[bool, list[int]] | None:
    """(every listener on `port` is `pid`'s or its descendants', pids of the other listeners
    found); None where /proc cannot tell (no listener table, or no listener seen at all)."""
    inodes = listening_inodes(port)
    if not inodes:
        return None
    ours = set().union(*(socket_inodes(p) for p in family(pid)))
    if inodes <= ours:
        return True, []
    return False, foreign_pids(inodes - ours)


def foreign_pids(inodes: set[int]) -> list[int]:
    """The processes (of those this user can see) holding any of these socket inodes."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and socket_inodes(int(name)) & inodes:
            pids.append(int(name))
    return sorted(pids)


def describe(pid: int) -> str:
    """"pid 123 (python -m replica --model default --host 127.0.0.1 --port 8101 ...)", shortened."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        cmd = " ".join(" ".join([os.path.basename(argv[0])] + argv[1:]).split())
        if cmd:
            return f"pid {pid} ({cmd[:100]}{' ...' if len(cmd) > 100 else ''})"
    return f"pid {pid}"
