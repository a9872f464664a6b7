"""Child processes that die with their parent, and stay out of the way of signals meant for it.

hivemind's DHT and DecentralizedAverager are forked `mp.Process(daemon=True)` children. `daemon=True` only helps
on a clean interpreter exit: after SIGKILL or SIGTERM of the peer, the DHT child, its p2pd and torch_shm_manager
stay alive under init and keep serving (docs/hivemind.md §5). PR_SET_PDEATHSIG makes
the kernel send SIGKILL to the child when its parent goes; p2pd then exits on its own because its control
connection closes.

The death signal fires when the *thread* that forked the child exits, not the process, so these children must be
created from the main thread (which lives as long as the peer).

The children also move to a process group of their own, so Ctrl+C in a terminal or a supervisor's SIGTERM to the
peer's group reaches only the peer's main process, which then stops them in order (its DHT record can only be
withdrawn while the DHT child and its p2pd still run). A supervisor that must freeze or kill a whole peer signals
its process tree by PID (as tests/e2e/harness.py does), not its process group.
"""
from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import threading

import hivemind

from gasloc.runtime.dht_pipe import FuturePipe
from gasloc.runtime.procs import set_pdeathsig

FAILED_DAEMON_STOP_S = 5.0   # how long a failed start waits for its p2pd to stop (SIGTERM: milliseconds)


def detach_and_die_with_parent(parent_pid: int) -> None:
    """In a forked child, first thing: get SIGKILL when the parent dies, and leave the parent's process group
    (see the module docstring)."""
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    os.setpgid(0, 0)
    # the fork inherited the peer's Python SIGTERM handler (which only sets a flag in the peer): restore the default,
    # so DHT.shutdown()'s terminate() fallback works
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"{what} must be created from the main thread (PR_SET_PDEATHSIG is tied to the thread "
                           f"that forks the child)")


def remove_own_shm() -> None:
    """hivemind's MPFuture keeps a torch shared-memory file /dev/shm/torch_<our pid>_*; torch_shm_manager removes
    it only some seconds after we exit, or never if it is killed first. Unlinking it at shutdown is safe: our
    mapping stays valid until exit."""
    for path in glob.glob(f"/dev/shm/torch_{os.getpid()}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class DiesWithParent:
    """Mixin for a hivemind `mp.Process` class (DHT, DecentralizedAverager): its forked process is killed with the
    peer (see the module docstring). List it first: `class SafeX(DiesWithParent, hivemind.X)`."""

    def __init__(self, *args, **kwargs):
        require_main_thread(type(self).__name__)
        self._creator_pid = os.getpid()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        detach_and_die_with_parent(self._creator_pid)
        super().run()


class SafeDHT(DiesWithParent, hivemind.DHT):
    """hivemind.DHT whose background process is killed with the peer, and whose control pipe hands each call's
    result pipe over by reference (runtime/dht_pipe.py: no socket handshake per DHT call)."""

    def __init__(self, *args, p2pd_flags: dict[str, str] | None = None, **kwargs):
        self._p2pd_flags = dict(p2pd_flags or {})
        super().__init__(*args, **kwargs)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        # before the fork: the child inherits both wrapped ends and the result pipe they refer to (the one every
        # MPFuture of this process sends its result on; hivemind's __init__ made `_ready` with it)
        sender = self._ready._sender_pipe
        if not isinstance(self._outer_pipe, FuturePipe):
            self._outer_pipe = FuturePipe(self._outer_pipe, sender)
            self._inner_pipe = FuturePipe(self._inner_pipe, sender)
        super().run_in_background(await_ready=await_ready, timeout=timeout)

    def run(self) -> None:
        clean_up_failed_starts()
        read_ed25519_identity_files()
        if self._p2pd_flags:
            add_p2pd_flags(self._p2pd_flags)
        super().run()


def clean_up_failed_starts() -> None:
    """Leave no p2pd and no socket file behind when the DHT node of this process fails to start.

    Two ways to fail, both seen in the test suite as a /tmp/hivemind-p2pd-<uid>.sock file that outlived everything:
    - p2pd itself exits while it starts (it reached none of its initial peers) after it bound that socket, and
      hivemind's P2P.create raises without removing the file (its _terminate removes it only for a daemon still
      running): `gasloc status` against a dead bootstrap, or the status page of a `gasloc swarm` killed meanwhile.
    - p2pd starts, and DHTNode.create fails after it (no initial peer answers a DHT ping: a peer without the swarm
      key of a private swarm) without shutting that daemon down; it outlived its DHT process and went without
      removing its socket.
    The daemon lived too briefly for a watcher to see who owned the file. Here P2P.create removes the socket of a
    daemon that failed to start (the path from the argv hivemind builds, P2P._make_process_args `listen`; the uid
    is random per daemon, so the file is that daemon's alone), and DHTNode.create shuts down the daemons started
    for it when it fails. Called in the forked DHT child only (SafeDHT.run), like add_p2pd_flags."""
    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    make_args, p2p_create, node_create = P2P._make_process_args, P2P.create.__func__, DHTNode.create.__func__
    listened: list[str] = []
    started: list = []   # P2P instances started during a DHTNode.create that has not returned yet

    def recording(*args, **kwargs):
        with contextlib.suppress(Exception):  # a listen address without a unix path: nothing to remove later
            listened.append(kwargs["listen"]["unix"])
        return make_args(*args, **kwargs)

    async def p2p_cleaning(cls, *args, **kwargs):
        first = len(listened)
        try:
            p2p = await p2p_create(cls, *args, **kwargs)
        except Exception:
            for path in listened[first:]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        started.append(p2p)
        return p2p

    async def node_cleaning(cls, *args, **kwargs):
        first = len(started)
        try:
            return await node_create(cls, *args, **kwargs)
        except Exception:
            for p2p in started[first:]:
                with contextlib.suppress(Exception):  # already gone, or it does not stop: the error above is the news
                    async with asyncio.timeout(FAILED_DAEMON_STOP_S):
                        await p2p.shutdown()
            raise
        finally:
            del started[first:]

    P2P._make_process_args = staticmethod(recording)
    P2P.create = classmethod(p2p_cleaning)
    DHTNode.create = classmethod(node_cleaning)


def add_p2pd_flags(flags: dict[str, str]) -> None:
    """Pass extra command-line flags (e.g. -metricsAddr) to every p2pd this process starts from now on.

    hivemind's P2P.create has a fixed set of parameters and builds p2pd's argv in P2P._make_process_args, so the
    only way in is to wrap that function. Called in the forked DHT child only (SafeDHT.run), the wrap never touches
    the peer's own process (docs/hivemind.md §7)."""
    from hivemind.p2p import P2P

    original = P2P._make_process_args

    def with_flags(*args, **kwargs):
        return original(*args, **kwargs, **flags)

    P2P._make_process_args = staticmethod(with_flags)


def read_ed25519_identity_files() -> None:
    """Let hivemind's check that an identity is not taken (P2P.is_identity_taken, run by P2P.create for an existing
    identity file when there are initial peers) read Ed25519 identity files, as gasloc makes them now
    (runtime/identity.py): it derives the peer id with PeerID.from_identity, which parses the key as RSA and
    raised on every Ed25519 file, failing the start. RSA files go the original way. Called in the forked DHT
    child only (SafeDHT.run), like add_p2pd_flags."""
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    from gasloc.runtime.identity import Ed25519Identity, peer_id_of_public

    original = PeerID.from_identity.__func__

    def from_identity(cls, data: bytes):
        pb = crypto_pb2.PrivateKey.FromString(data)
        if pb.key_type == crypto_pb2.KeyType.Ed25519:
            return cls.from_base58(peer_id_of_public(Ed25519Identity.from_libp2p_data(pb.data).public))
        return original(cls, data)

    PeerID.from_identity = classmethod(from_identity)
