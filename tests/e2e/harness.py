"""Real `gasloc` processes for end-to-end tests, on top of gasloc.runtime.procs (the same code `gasloc swarm` uses).

    h.start("boot", "bootstrap", "--host-maddrs", LOOPBACK)  -> Child, after its READY line
    h.spawn(...)                  -> Child, without waiting (then h.wait_ready(child) or h.wait_exit(name))
    h.kill / h.pause / h.resume / h.terminate / h.interrupt    fault injection by name
    h.metrics("peer-0")           -> records of <run_dir>/peer-0/metrics.jsonl
    h.wait_until(fn, timeout_s)   -> poll a condition on files/records (readiness from data, never a bare sleep)

Layout under run_dir: `<name>.log` (stderr), `<name>.stdout` (the READY line), `<name>/` (the child's own dir,
`h.dir(name)`, e.g. for `--run-dir`). The `harness` fixture (tests/e2e/conftest.py) stops and checks everything.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gasloc.runtime.jsonl import read_jsonl
from gasloc.runtime.procs import Child, Leftovers, Supervisor, gasloc_argv

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# a well-formed peer id (sha256 multihash) that no node on this machine has
MADE_UP_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
T = TypeVar("T")


def free_port() -> int:
    """A loopback TCP port nobody listens on at this moment (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process's environment minus any GASLOC_* setting of the developer, one thread per child (2 cores
    shared by many processes), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GASLOC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["GASLOC_LOG_LEVEL"] = "INFO"
    env.update(extra or {})
    return env


class Harness:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sup = Supervisor()
        self.hard_killed: set[str] = set()  # children we SIGKILLed: leftover sockets of theirs are expected

    # -- starting
    def dir(self, name: str) -> Path:
        d = self.run_dir / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> Child:
        return self.sup.start(name, gasloc_argv(*map(str, args)), self.run_dir / f"{name}.log", env=child_env(env),
                              cwd=self.run_dir)

    def wait_ready(self, child: Child, timeout_s: float = 90) -> dict[str, Any]:
        return self.sup.wait_ready(child, timeout_s)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None, ready_timeout_s: float = 90) -> Child:
        child = self.spawn(name, *args, env=env)
        self.wait_ready(child, ready_timeout_s)
        return child

    def bootstrap(self, name: str = "bootstrap", *extra: str) -> Child:
        """A `gasloc bootstrap` on loopback, port 0, with its identity and maddrs file in h.dir(name)."""
        d = self.dir(name)
        return self.start(name, "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", d / "identity.key",
                          "--maddrs-file", d / "maddrs.txt", *extra)

    def run(self, *args: str, timeout_s: float = 120, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """A short-lived gasloc command (doctor, export, --print-config): output captured, own session, killed
        with its group on timeout."""
        proc = subprocess.Popen(gasloc_argv(*map(str, args)), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=child_env(env), cwd=self.run_dir,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"gasloc {' '.join(map(str, args))} ran past {timeout_s} s; stderr:\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # -- faults and stopping
    def child(self, name: str) -> Child:
        return self.sup.children[name]

    def kill(self, name: str, group: bool = False) -> None:
        """kill -9 the main process (group=False: its DHT fork and p2pd must then go by themselves) or the group."""
        self.hard_killed.add(name)
        self.child(name).signal(signal.SIGKILL, group=group)

    def pause(self, name: str) -> None:
        """SIGSTOP the whole tree, by PID: a frozen machine (p2pd included, so connections stall, not reset)."""
        self.sup.signal_tree(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.sup.signal_tree(name, signal.SIGCONT)

    def terminate(self, name: str) -> None:
        self.child(name).signal(signal.SIGTERM)

    def interrupt(self, name: str) -> None:
        self.child(name).signal(signal.SIGINT)

    def wait_exit(self, name: str, timeout_s: float = 30) -> int:
        """Wait for the main process to exit; returns its code (negative: killed by that signal)."""
        try:
            return self.child(name).popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout_s} s; log tail:\n"
                                 f"{self.child(name).log_tail()}") from None

    def wait_tree_gone(self, name: str, timeout_s: float = 10) -> bool:
        """After the main process exited: wait until no process of its tree (DHT fork, p2pd) is left."""
        return self.sup._wait_tree_gone(name, timeout_s)

    def stop(self, name: str, grace_s: float = 15) -> int:
        return self.sup.stop(name, grace_s)

    def leftovers(self, name: str | None = None) -> Leftovers:
        return self.sup.leftovers(name)

    def tree(self, name: str) -> list[tuple[int, str]]:
        return self.sup.tree(name)

    def close(self, grace_s: float = 15) -> tuple[dict[str, int], Leftovers, Leftovers]:
        """Stop every child; returns (exit codes, leftovers of children that exited cleanly, all leftovers).
        Leftovers are removed / SIGKILLed before returning."""
        codes = self.sup.stop_all(grace_s)
        self.sup.settle()
        clean = Leftovers()
        for name, rc in codes.items():
            if rc == 0 and name not in self.hard_killed:
                part = self.sup.leftovers(name)
                clean.processes += part.processes
                clean.sockets += part.sockets
                clean.shm += part.shm
        return codes, clean, self.sup.cleanup()

    # -- observing
    def metrics(self, name: str, file: str = "metrics.jsonl") -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / name / file)

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")

    def wait_until(self, predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2,
                   alive: tuple[str, ...] = ()) -> T:
        """Poll `predicate` until it returns something truthy (returned), else fail naming `what` (with the tails of
        the logs of the children named in `alive`). Fails at once if one of those exits meanwhile (with its tail)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            for name in alive:
                rc = self.child(name).poll()
                if rc is not None:
                    raise AssertionError(f"{name} exited with code {rc} while waiting for {what}; log tail:\n"
                                         f"{self.child(name).log_tail()}")
            if time.monotonic() > deadline:
                dead = {n: c.poll() for n, c in self.sup.children.items() if c.poll() is not None}
                # the children we waited on say why, in the failure itself: CI keeps no run directory
                tails = "".join(f"\n--- {n} log tail:\n{self.child(n).log_tail(6)}" for n in alive)
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; exited children: {dead}"
                                     + tails)
            time.sleep(interval_s)
