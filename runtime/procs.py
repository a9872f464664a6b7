"""Child `gasloc` processes: start each in its own process group, wait for its READY line, stop it, and prove that
nothing of it is left (no process, no p2pd unix socket, no /dev/shm/torch_* file).

One implementation for `gasloc swarm` and the e2e test harness. Linux only: it reads /proc.

Why the care: a hivemind DHT is a forked child with its own p2pd grandchild; if the main Python dies by a signal
they can outlive it (docs/hivemind.md §5). So every child gets a session of its own (one signal reaches the whole
tree), the supervisor watches the tree while it runs (PIDs, start times, the unix sockets it binds) and, after
stopping, checks each recorded PID and path and removes what a hard kill left behind.
"""
from __future__ import annotations

import ctypes
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

READY_PREFIX = "READY "
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
PARENT_ENV = "GASLOC_SUPERVISOR_PID"  # set by Supervisor.start: the child asks for a death signal itself
# Loaded once, here: a dlopen in a child forked from a multi-threaded process (safeproc's DHT fork) can block on
# the loader lock another thread held at fork time.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


# ----------------------------------------------------------------------------------------------- READY line
def emit_ready(role: str, peer_id: str, maddrs: list[str], **extra: Any) -> None:
    """Print the one stdout line that says a long-running command is up (the contract with supervisors); `extra`
    adds role-specific keys (gasloc status --serve: its url)."""
    line = json.dumps({"role": role, "peer_id": peer_id, "maddrs": list(maddrs), "pid": os.getpid(), **extra})
    sys.stdout.write(READY_PREFIX + line + "\n")
    sys.stdout.flush()


def parse_ready(line: str) -> dict[str, Any] | None:
    if not line.startswith(READY_PREFIX):
        return None
    try:
        obj = json.loads(line[len(READY_PREFIX):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and "peer_id" in obj and "maddrs" in obj else None


def gasloc_argv(*args: str) -> list[str]:
    """Run gasloc with this interpreter, so a child sees the same venv as its parent whatever PATH says."""
    return [sys.executable, "-m", "gasloc.cli.main", *args]


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when the thread that forked it exits (see docs/hivemind.md §5)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_supervisor() -> None:
    """In a child of Supervisor.start, first thing after exec: SIGTERM when the supervisor's starting thread exits.
    Asked by the child, not in a preexec_fn: Python code between fork and exec in a multi-threaded parent (the
    soak bench, `gasloc swarm`) can deadlock, and without one subprocess may use vfork. Our parent may be a wrapper that exec'd us (`ip netns exec`) or
    forked us; reparented to init means the supervisor died before we asked: stop now."""
    expected = os.environ.pop(PARENT_ENV, None)
    if not expected:
        return
    set_pdeathsig(signal.SIGTERM)
    if os.getppid() != int(expected) and os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGTERM)


class StopSignals:
    """SIGINT/SIGTERM for a long-running command: the first asks for a clean shutdown, a later one for an exit at
    once. A repeat within `same_within_s` of the first is the same request: the kernel sends a parent-death signal
    (PR_SET_PDEATHSIG) each time a child passes from one thread of its dying multi-threaded parent to the next
    (measured: 2-4 SIGTERMs, against 1 from a single-threaded parent, when a parent with 4-8 threads was killed with
    -9), so a `gasloc swarm` killed with -9 could otherwise make its peers skip their clean shutdown and last
    checkpoint."""

    def __init__(self, same_within_s: float = 1.0, clock=time.monotonic):
        self.same_within_s, self._clock = same_within_s, clock
        self.first_at: float | None = None

    def classify(self) -> str:
        """Call once per signal received: "first" (shut down cleanly), "repeat" (the same request again: ignore
        it) or "force" (exit at once)."""
        now = self._clock()
        if self.first_at is None:
            self.first_at = now
            return "first"
        return "force" if now - self.first_at > self.same_within_s else "repeat"


# ----------------------------------------------------------------------------------------------------- /proc
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Stat:
    pid: int
    ppid: int
    pgid: int
    state: str
    start_ticks: int  # process start time since boot: with the PID it names one process, even after PID reuse
    comm: str
    cpu_s: float      # user + system CPU seconds so far (fields 14 and 15, in clock ticks)


def read_stat(pid: int) -> Stat | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm is in parentheses and may itself contain spaces or ')'
    comm = raw[raw.index("(") + 1: raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2:].split()
    return Stat(pid, int(rest[1]), int(rest[2]), rest[0], int(rest[19]), comm,
                (int(rest[11]) + int(rest[12])) / _CLK_TCK)


def process_table() -> dict[int, Stat]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st is not None:
                table[st.pid] = st
    return table


def descendants(roots: set[int], table: dict[int, Stat] | None = None) -> set[int]:
    """All PIDs below `roots` (not including them)."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for st in table.values():
        children.setdefault(st.ppid, []).append(st.pid)
    out, todo = set(), list(roots)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def is_alive(pid: int, start_ticks: int) -> bool:
    st = read_stat(pid)
    return st is not None and st.start_ticks == start_ticks and st.state not in ("Z", "X")


def unix_socket_paths() -> dict[str, str]:
    """inode -> filesystem path of every bound unix socket (from /proc/net/unix)."""
    out = {}
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and parts[7].startswith("/"):
            out[parts[6]] = parts[7]
    return out


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def become_subreaper() -> None:
    """Orphaned descendants (a p2pd whose DHT parent was killed) get re-parented to us, so we can reap them."""
    _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (or already reaped): its own parent or init reaps it


# ---------------------------------------------------------------------------------------------- supervisor
class ChildFailed(RuntimeError):
    """A child exited or missed its deadline before printing READY; the message carries the tail of its log."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    stdout_path: Path
    ready: dict[str, Any] | None = None
    term_sent_at: float | None = None  # monotonic time of our SIGTERM: sent once (a second may mean "force")

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def maddrs(self) -> list[str]:
        if self.ready is None:
            raise RuntimeError(f"{self.name} has not printed READY")
        return list(self.ready["maddrs"])

    @property
    def peer_id(self) -> str:
        if self.ready is None:
            raise RuntimeError(f"{self.name} has not printed READY")
        return str(self.ready["peer_id"])

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int, group: bool = False) -> None:
        """Send `sig` to the main process only (like `kill -9 PID`), or to its whole process group."""
        if self.popen.poll() is not None:
            return
        if group:
            os.killpg(self.popen.pid, sig)
        else:
            self.popen.send_signal(sig)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


@dataclass
class Leftovers:
    processes: list[str] = field(default_factory=list)  # "pid comm (of child)"
    sockets: list[str] = field(default_factory=list)
    shm: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.sockets or self.shm)

    def __str__(self) -> str:
        return f"processes={self.processes} sockets={self.sockets} shm={self.shm}"


class Supervisor:
    """Starts children and keeps a record of every process and unix socket of their trees until cleanup()."""

    def __init__(self, watch_interval_s: float = 0.5, subreaper: bool = True):
        if subreaper:
            become_subreaper()
        self.children: dict[str, Child] = {}
        self._seen: dict[int, tuple[int, str, str]] = {}  # pid -> (start_ticks, comm, child name)
        self._sockets: dict[str, str] = {}  # unix socket path -> child name
        self._lock = threading.RLock()  # re-entrant: a signal handler on the main thread may call in
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(watch_interval_s,), daemon=True,
                                         name="gasloc-supervisor-watch")
        self._watcher.start()

    # -- starting
    def start(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Child:
        if name in self.children and self.children[name].poll() is None:
            raise ValueError(f"a child named {name!r} is already running")
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        stdout_path = log_path.with_suffix(".stdout")
        # stdout to a file, not a pipe: a child never blocks on a full pipe nobody reads.
        # Own session: our signals reach its whole group, a terminal's Ctrl+C does not (we decide how to stop).
        # SIGTERM when we die, even by SIGKILL: the child then shuts down cleanly instead of running on orphaned.
        # The death signal is tied to the thread that forks: start children from a thread that lives as long as
        # the supervisor (the main thread). The child asks for it itself (die_with_supervisor).
        env = {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}
        with open(log_path, "ab") as err, open(stdout_path, "wb") as out:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd,
                                     start_new_session=True)
        child = Child(name, popen, log_path, stdout_path)
        with self._lock:
            self.children[name] = child
        self.snapshot()
        log.debug("started name=%s pid=%d argv=%s", name, popen.pid, " ".join(argv))
        return child

    def wait_ready(self, child: Child, timeout_s: float, cancel: threading.Event | None = None
                   ) -> dict[str, Any] | None:
        """Block until the child prints its READY line; ChildFailed if it exits first or `timeout_s` passes;
        None if `cancel` is set meanwhile (a Ctrl+C during startup)."""
        deadline = time.monotonic() + timeout_s
        while cancel is None or not cancel.is_set():
            try:
                text = child.stdout_path.read_text(errors="replace")
            except OSError:
                text = ""
            for line in text.splitlines():
                ready = parse_ready(line)
                if ready is not None:
                    child.ready = ready
                    self.snapshot()  # the tree (DHT fork, p2pd, sockets) exists now
                    return ready
            rc = child.poll()
            if rc is not None:
                raise ChildFailed(f"{child.name} exited with code {rc} before READY; log {child.log_path}:\n"
                                  f"{child.log_tail()}")
            if time.monotonic() > deadline:
                raise ChildFailed(f"{child.name} printed no READY line within {timeout_s:.0f} s; log "
                                  f"{child.log_path}:\n{child.log_tail()}")
            time.sleep(0.05)  # polling a file the child appends to; readiness still comes from the line
        return None

    # -- watching
    def snapshot(self) -> None:
        """Record every live process below our children and the unix sockets they hold."""
        table = process_table()
        with self._lock:
            roots = {c.pid: c.name for c in self.children.values()}
        owner = {}
        for pid, name in roots.items():
            if pid in table:
                owner[pid] = name
                for d in descendants({pid}, table):
                    owner[d] = name
        paths = unix_socket_paths()
        socks = {paths[i]: name for pid, name in owner.items() for i in socket_inodes(pid) if i in paths}
        with self._lock:
            for pid, name in owner.items():
                st = table.get(pid)
                if st is None or st.state in ("Z", "X"):
                    continue
                prev = self._seen.get(pid)
                # a process seen between fork and exec has its parent's name (python3.11 for a p2pd or a `sleep`
                # about to start): the same process (same start time) seen again keeps its newest name; a reused
                # PID (another start time) does not replace the process we recorded
                if prev is None or prev[0] == st.start_ticks:
                    self._seen[pid] = (st.start_ticks, st.comm, prev[2] if prev else name)
            for path, name in socks.items():
                self._sockets.setdefault(path, name)

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.snapshot()
            except Exception:  # a race with a dying process must never kill the watcher
                log.debug("snapshot failed", exc_info=True)

    def tree(self, name: str) -> list[tuple[int, str]]:
        """(pid, comm) of every process ever seen in child `name`'s tree."""
        with self._lock:
            return [(pid, comm) for pid, (_, comm, owner) in self._seen.items() if owner == name]

    # -- stopping
    def stop(self, name: str, grace_s: float = 10.0) -> int:
        """SIGTERM the child's process group, SIGKILL it after `grace_s`, wait for the whole tree; returns rc."""
        child = self.children[name]
        self.snapshot()
        if child.poll() is None:
            self._terminate(child)
            try:
                child.popen.wait(max(0.0, child.term_sent_at + grace_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("child=%s ignored SIGTERM for %.0f s; sending SIGKILL", name, grace_s)
                self.snapshot()  # a socket bound since the last watch would outlive the kill unrecorded
                _killpg(child.pid, signal.SIGKILL)
                child.popen.wait()
        # The leader is gone; the rest of its tree (DHT fork, p2pd - possibly in process groups of their own) gets
        # a moment to follow by itself, then SIGKILL by PID.
        if not self._wait_tree_gone(name, min(grace_s, 5.0)):
            self.signal_tree(name, signal.SIGKILL)
            self._wait_tree_gone(name, 5.0)
        return child.popen.returncode

    def _terminate(self, child: Child) -> None:
        if child.term_sent_at is None:
            child.term_sent_at = time.monotonic()
            _killpg(child.pid, signal.SIGTERM)
        self.signal_tree(child.name, signal.SIGCONT)  # a SIGSTOPped tree cannot act on SIGTERM otherwise

    def signal_tree(self, name: str, sig: int) -> list[int]:
        """Send `sig` to every live process of child `name`'s tree, by PID (a tree may span process groups)."""
        self.snapshot()
        sent = []
        for pid, _, _ in self._alive_of(name):
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
        return sent

    def stop_all(self, grace_s: float = 10.0, names: list[str] | None = None) -> dict[str, int]:
        names = list(self.children) if names is None else names
        for name in names:  # signal everyone first so shutdowns overlap
            c = self.children[name]
            if c.poll() is None:
                self._terminate(c)
        return {name: self.stop(name, grace_s) for name in names}

    def _alive_of(self, name: str | None) -> list[tuple[int, str, str]]:
        with self._lock:
            seen = list(self._seen.items())
            leaders = {c.pid: c for c in self.children.values()}
        out = []
        for pid, (start, comm, owner) in seen:
            if pid in leaders:
                leaders[pid].poll()  # Popen must reap its own child, or it loses the exit code
            else:
                _reap(pid)
            if (name is None or owner == name) and is_alive(pid, start):
                out.append((pid, comm, owner))
        return out

    def _wait_tree_gone(self, name: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._alive_of(name):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def leftovers(self, name: str | None = None) -> Leftovers:
        """What of our children's trees (or of child `name`'s) still exists: processes, unix socket files,
        /dev/shm/torch_<pid>_* files."""
        left = Leftovers()
        left.processes = [f"{pid} {comm} (of {owner})" for pid, comm, owner in self._alive_of(name)]
        with self._lock:
            left.sockets = sorted(p for p, o in self._sockets.items()
                                  if (name is None or o == name) and os.path.exists(p))
            pids = [pid for pid, (_, _, o) in self._seen.items() if name is None or o == name]
        for pid in pids:
            left.shm += sorted(glob.glob(f"/dev/shm/torch_{pid}_*"))
        return left

    def settle(self, timeout_s: float = 10.0) -> Leftovers:
        """Leftovers once torch_shm_manager had time to remove our /dev/shm files: it lingers ~3 s after its last
        client exits (measured), also after a kill -9, and then unlinks them itself."""
        deadline = time.monotonic() + timeout_s
        left = self.leftovers()
        while left.shm and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.leftovers()
        return left

    def cleanup(self) -> Leftovers:
        """Stop watching, SIGKILL any recorded process still alive (by PID), remove leftover files.

        Returns what was left *before* cleaning, so a caller can decide whether that was an error."""
        self._stop.set()
        self._watcher.join(timeout=5)
        left = self.settle()
        for pid, _, _ in self._alive_of(None):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while self._alive_of(None) and time.monotonic() < deadline:
            time.sleep(0.05)
        for path in left.sockets + left.shm:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return left


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
