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

import contextlib
import glob
import os
import signal
import threading

import hivemind

from gasloc.runtime.dht_pipe import FuturePipe
from gasloc.runtime.procs import set_pdeathsig


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
        if self._p2pd_flags:
            add_p2pd_flags(self._p2pd_flags)
        super().run()


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
