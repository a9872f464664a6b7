"""Find the /tmp/hivemind-*.sock files that given processes own, so a harness can remove exactly its own leftovers.

hivemind's DHT and averager do not remove their p2pd/p2pclient unix socket files on shutdown, and nothing does after
a kill (docs/hivemind.md §5). Other programs on the machine have their own such files, so "remove every stale socket"
is wrong; this module maps socket files to the processes that bound them (Linux procfs), while they are alive.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from gasloc.runtime.procs import descendants

PREFIX = "/tmp/hivemind-"


def subtree(pid: int) -> set[int]:
    """`pid` and every live process below it."""
    return {pid} | descendants({pid})


def owned_sockets(pids: Iterable[int]) -> set[str]:
    """Paths of hivemind unix sockets that any of `pids` holds open (each read in its own network namespace).

    A forked child holds the listening sockets it inherited: subtract what the parent holds before removing the
    files of a child's subtree that the parent still serves on.
    """
    out: set[str] = set()
    for pid in pids:
        try:
            inodes = {}
            for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) >= 8 and parts[7].startswith(PREFIX):
                    inodes[parts[6]] = parts[7]
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    out.add(inodes[target[8:-1]])
        except OSError:
            continue          # the process exited, or we may not look
    return out


def remove(paths: Iterable[str]) -> list[str]:
    """Remove these socket files if they still exist; the ones removed."""
    gone = []
    for p in paths:
        try:
            os.remove(p)
            gone.append(p)
        except FileNotFoundError:
            pass
    return gone
