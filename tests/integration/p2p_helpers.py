"""Helpers for the in-process hivemind tests (loopback only, port 0 everywhere).

Each test runs its own event loop (`arun`) with a hard deadline. P2P instances are created and shut down inside it
(`p2p_nodes`), so their p2pd children exit with the test. Subprocess partners (`Partner`) are reaped by PID with
their p2pd, and their unix socket files removed, also when the test fails; conftest.py asserts at the end of the
session that none survived.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P, PeerID

PARTNER = Path(__file__).with_name("partner.py")
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
_reaped: list[tuple[int, int, list[str]]] = []      # (partner pid, p2pd pid, socket files) of every partner


def arun(coro, timeout: float = 55.0):
    """Run a test coroutine in a fresh event loop, failing (not hanging) past `timeout` seconds."""
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def p2p_nodes(n: int, initial_peers: list[str] | None = None):
    """n P2P daemons on loopback, each bootstrapped from the ones before it (and `initial_peers`)."""
    nodes: list[P2P] = []
    try:
        maddrs = list(initial_peers or [])
        for _ in range(n):
            node = await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs or None)
            nodes.append(node)
            maddrs += [str(m) for m in await node.get_visible_maddrs()]
        yield nodes
    finally:
        for node in nodes:
            await node.shutdown()


async def first_maddr(p2p: P2P) -> str:
    return str((await p2p.get_visible_maddrs())[0])


def _is_p2pd(pid: int) -> bool:
    try:
        return b"p2pd" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def check_partner_leftovers() -> list[str]:
    """Processes and socket files of finished partners that still exist (waits up to 5 s for reaping)."""
    deadline = time.monotonic() + 5
    leftovers = []
    for pid, p2pd_pid, sockets in _reaped:
        while _alive(p2pd_pid) and _is_p2pd(p2pd_pid) and time.monotonic() < deadline:
            time.sleep(0.05)    # a SIGKILLed p2pd is reaped by init; give it a moment
        leftovers += [f"pid {p}" for p in (pid, p2pd_pid) if _alive(p) and (p == pid or _is_p2pd(p))]
        leftovers += [s for s in sockets if os.path.exists(s)]
    return leftovers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()


class Partner:
    """tests/integration/partner.py in a subprocess; `async with Partner(mode, *args) as p` waits for READY."""

    def __init__(self, *args: str):
        self.args = [str(a) for a in args]
        self.proc: asyncio.subprocess.Process | None = None
        self.peer_id: PeerID | None = None
        self.maddr = ""
        self.p2pd_pid = -1
        self.sockets: list[str] = []

    async def __aenter__(self) -> Partner:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, str(PARTNER), *self.args,
                                                         stdout=asyncio.subprocess.PIPE,
                                                         stdin=asyncio.subprocess.DEVNULL)
        try:
            words = await self.expect("READY", timeout=30)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        self.peer_id = PeerID.from_base58(words[1])
        self.maddr, self.p2pd_pid, self.sockets = words[2], int(words[3]), words[4:]
        return self

    async def expect(self, first_word: str, timeout: float = 20) -> list[str]:
        """Read lines until one starts with `first_word`; its words."""
        async def scan():
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"partner exited (rc={self.proc.returncode}) before printing {first_word}")
                words = line.decode().split()
                if words and words[0] == first_word:
                    return words
        return await asyncio.wait_for(scan(), timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def __aexit__(self, *exc) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        # the orphaned p2pd exits by itself within ~1 s (its control connection closed); do not wait for that
        if self.p2pd_pid > 0 and _is_p2pd(self.p2pd_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.p2pd_pid, signal.SIGKILL)
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        _reaped.append((self.proc.pid, self.p2pd_pid, self.sockets))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
