"""Session-wide leak check: nothing the test run started may outlive it.

A watcher thread records, every second, every process below pytest (DHT forks, p2pd, gasloc subprocesses) and
the unix sockets they and pytest itself hold (hivemind's /tmp/hivemind-p2p*-*.sock). At the end of the session any
such process still alive, socket file still on disk or /dev/shm/torch_<pid>_* file of a finished process fails
the run (exit status 1) after being killed / removed, so one leaky test cannot leave debris for the next run.
A hivemind socket file made during the session that the watcher never saw held (its p2pd killed within a polling
interval of binding it) is removed and reported as a warning naming the tests running when it was made.
Per-test checks of gasloc subprocesses live in tests/e2e/conftest.py; this catches the rest (in-process swarms).
"""
from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest

from gasloc.runtime.procs import descendants, is_alive, process_table, socket_inodes, unix_socket_paths

HIVEMIND_SOCKETS = "/tmp/hivemind-*.sock"
SPAN_SLACK_S = 1.0


class SessionWatch:
    def __init__(self, interval_s: float = 1.0):
        self.root = os.getpid()
        self.seen: dict[int, tuple[int, str]] = {}  # pid -> (start ticks, comm)
        self.seen_during: dict[int, str] = {}  # pid -> the test running when it was first seen, for the leak report
        self.sockets: dict[str, str] = {}  # path -> who held it when first seen (pid, command, running test)
        self.test = "-"  # the test running now (pytest_runtest_logstart), for the leak report
        self.spans: dict[str, list[float]] = {}  # test -> [start, end] (end: inf while it runs), to name creators
        self.files_before = set(glob.glob(HIVEMIND_SOCKETS))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True, name="leak-watch")
        self._thread.start()

    def snapshot(self) -> None:
        table = process_table()
        pids = descendants({self.root}, table)
        paths = unix_socket_paths()
        for pid in pids | {self.root}:
            for i in socket_inodes(pid):
                if i in paths and "hivemind" in paths[i] and paths[i] not in self.sockets:
                    st = table.get(pid)
                    self.sockets[paths[i]] = f"pid {pid} {st.comm if st else '?'}, during {self.test}"
        for pid in pids:
            st = table.get(pid)
            # the newest name of the same process (same start time): one seen between fork and exec has its parent's
            # (python3.11 for a torch_shm_manager, which _alive lets linger)
            if st is None or st.state in ("Z", "X"):
                continue
            if pid not in self.seen or self.seen[pid][0] == st.start_ticks:
                self.seen[pid] = (st.start_ticks, st.comm)
                self.seen_during.setdefault(pid, self.test)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.snapshot()
            except OSError:
                pass  # a process vanished mid-read; the next pass sees the new state

    def finish(self, settle_s: float = 10.0) -> tuple[list[str], list[str]]:
        self._stop.set()
        self._thread.join(5)
        self.snapshot()
        deadline = time.monotonic() + settle_s
        alive = self._alive()
        # children may still be exiting (torch_shm_manager lingers ~3 s and then removes its /dev/shm files)
        while (alive or self._shm()) and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = self._alive()
        problems = []
        if alive:
            problems.append("processes still running: " + ", ".join(
                f"{p} {c} (seen first during {self.seen_during[p]})" for p, c in alive))
            for pid, _ in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        stale = sorted(p for p in self.sockets if os.path.exists(p) and p not in self._bound())
        shm = self._shm()
        if stale:
            problems.append(f"hivemind unix sockets left: {', '.join(f'{p} ({self.sockets[p]})' for p in stale)}")
        unseen = self._unseen_files()
        if shm:
            problems.append("/dev/shm files left: " + ", ".join(
                f"{f} (of pid {pid} {self.seen[pid][1]}, seen first during {self.seen_during[pid]})"
                for f in shm for pid in [int(f.split("_")[1])]))
        for path in stale + shm + [p for p, _ in unseen]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        # Warned, not failed: such a file turned up in about one run in ten of the first part of `make test` (two
        # seen) from a test not known yet; the warning names the tests that were running when it was made.
        warnings = [f"hivemind socket file {p} left by a process never seen holding it ({when})" for p, when in unseen]
        return problems, warnings

    def _alive(self) -> list[tuple[int, str]]:
        out = []
        for pid, (start, comm) in list(self.seen.items()):
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our direct child and a zombie
            except ChildProcessError:
                pass
            # torch_shm_manager serves pytest's own hivemind futures too and exits ~3 s after its last client
            if is_alive(pid, start) and comm != "torch_shm_manag":
                out.append((pid, comm))
        return out

    def _shm(self) -> list[str]:
        # pytest's own MPFuture buffer is still in use until it exits: only finished processes count
        return sorted(f for pid in self.seen for f in glob.glob(f"/dev/shm/torch_{pid}_*"))

    def _unseen_files(self) -> list[tuple[str, str]]:
        """hivemind socket files created during the session that no process holds and the watcher never saw held:
        a p2pd SIGKILLed (or crashed) less than a polling interval after it bound its socket; a stopped one
        removes its file. (path, when it was made and which tests were running then)."""
        bound = set(unix_socket_paths().values())
        out = []
        for path in sorted(set(glob.glob(HIVEMIND_SOCKETS)) - self.files_before - set(self.sockets) - bound):
            try:
                made = os.stat(path).st_ctime
            except FileNotFoundError:
                continue
            # under xdist the workers' start and finish reach us some milliseconds late
            tests = [t for t, (start, end) in self.spans.items() if start - SPAN_SLACK_S <= made <= end + SPAN_SLACK_S]
            out.append((path, f"made {time.strftime('%H:%M:%S', time.localtime(made))} while these tests ran: "
                              f"{', '.join(tests) or '-'}"))
        return out

    def _bound(self) -> set[str]:
        # a socket file still bound by a live process of pytest itself (a module-level hivemind object) is not stale
        paths = unix_socket_paths()
        return {paths[i] for i in socket_inodes(self.root) if i in paths}


_watch: SessionWatch | None = None


def pytest_sessionstart(session):
    global _watch
    # under pytest-xdist (make test runs the unit, in-process and light multi-process tests on three workers) the
    # controller watches: its tree holds the workers' children, and a worker that cleaned up its own leaks would hide
    # them from it
    if "PYTEST_XDIST_WORKER" not in os.environ:
        _watch = SessionWatch()


def pytest_runtest_logstart(nodeid, location):
    if _watch is not None:
        _watch.test = nodeid
        _watch.spans[nodeid] = [time.time(), float("inf")]


def pytest_runtest_logfinish(nodeid, location):
    if _watch is not None and nodeid in _watch.spans:
        _watch.spans[nodeid][1] = time.time()


# trylast: under pytest-xdist the controller's workers are our children until xdist's own sessionfinish shuts them
# down; checking before that flagged the workers themselves as leaks
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _watch is None:
        return
    problems, warnings = _watch.finish()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str, **markup) -> None:
        if reporter is not None:
            reporter.write_line(line, **markup)
        else:
            print(line)

    for w in warnings:
        say(f"LEAK CHECK WARNING: {w} (removed now)", yellow=True)
    for p in problems:
        say(f"LEAK CHECK FAILED: {p} (killed/removed now)", red=True)
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
