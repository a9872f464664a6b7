"""gasloc.runtime.procs, the supervisor under the harness and `gasloc swarm`: its leak checks must be able to fail.
Plain Python children (no hivemind), so these run in seconds."""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from gasloc.runtime.procs import ChildFailed, Supervisor

pytestmark = [pytest.mark.timeout(60), pytest.mark.light]

# A child that leaves debris on purpose: a grandchild in a session of its own (out of reach of killpg), a bound
# unix socket it never removes, then READY.
LEAKY = textwrap.dedent("""
    import os, socket, subprocess, sys, time
    from gasloc.runtime.procs import emit_ready
    subprocess.Popen(["sleep", "300"], start_new_session=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(sys.argv[1])
    emit_ready("peer", "fake-id", ["/ip4/127.0.0.1/tcp/1/p2p/fake-id"])
    time.sleep(300)
""")


def test_tracks_tree_and_socket_and_cleans_what_a_hard_stop_leaves(tmp_path):
    sock = f"/tmp/hivemind-gasloc-test-{os.getpid()}.sock"
    sup = Supervisor(watch_interval_s=0.1)
    try:
        child = sup.start("leaky", [sys.executable, "-c", LEAKY, sock], tmp_path / "leaky.log")
        ready = sup.wait_ready(child, 30)
        assert ready["peer_id"] == "fake-id" and ready["pid"] == child.pid
        comms = {c for _, c in sup.tree("leaky")}
        assert "sleep" in comms, comms
        # SIGTERM kills the python (default action: no cleanup); the grandchild is in another session, so it is
        # stopped by PID; the socket file stays and is reported
        assert sup.stop("leaky", grace_s=5) == -15
        left = sup.leftovers()
        assert not left.processes, left
        assert left.sockets == [sock], left
        assert sup.cleanup().sockets == [sock]
        assert not os.path.exists(sock)
    finally:
        sup.cleanup()
        if os.path.exists(sock):
            os.unlink(sock)


def test_child_that_exits_before_ready_fails_with_its_log(tmp_path):
    sup = Supervisor()
    try:
        child = sup.start("bad", [sys.executable, "-c", "import sys; print('Error: no such thing', file=sys.stderr);"
                                  " sys.exit(2)"], tmp_path / "bad.log")
        with pytest.raises(ChildFailed, match=r"(?s)bad exited with code 2 before READY.*Error: no such thing"):
            sup.wait_ready(child, 30)
    finally:
        sup.cleanup()


def test_ready_deadline(tmp_path):
    sup = Supervisor()
    try:
        child = sup.start("slow", [sys.executable, "-c", "import time; print('not ready', flush=True); "
                                   "time.sleep(60)"], tmp_path / "slow.log")
        with pytest.raises(ChildFailed, match="printed no READY line within 1 s"):
            sup.wait_ready(child, 1)
        assert sup.stop("slow", grace_s=5) == -15
        assert not sup.leftovers()
    finally:
        sup.cleanup()


# A grandchild that waits between fork and exec: the watcher sees it first with its parent's name, then as `sleep`.
SLOW_EXEC = textwrap.dedent("""
    import os, sys, time
    from gasloc.runtime.procs import emit_ready
    pid = os.fork()
    if pid == 0:
        time.sleep(0.6)                       # several watcher snapshots (every 0.1 s) before the exec
        os.execvp("sleep", ["sleep", "300"])
    time.sleep(1.5)
    emit_ready("peer", "fake-id", ["/ip4/127.0.0.1/tcp/1/p2p/fake-id"])
    time.sleep(300)
""")


def test_a_process_seen_before_its_exec_is_named_by_what_it_runs_now(tmp_path):
    sup = Supervisor(watch_interval_s=0.1)
    try:
        child = sup.start("forker", [sys.executable, "-c", SLOW_EXEC], tmp_path / "forker.log")
        sup.wait_ready(child, 30)
        names = dict(sup.tree("forker"))
        # the child itself and its grandchild, which ran as python3.11 for 0.6 s and then became `sleep` (it
        # kept the first name it was seen with, so `gasloc swarm`'s and the harness's trees could miss a p2pd)
        assert sorted(names.values()) == sorted([os.path.basename(sys.executable)[:15], "sleep"]), names
        assert sup.stop("forker", grace_s=5) == -15
        assert not sup.leftovers()
    finally:
        sup.cleanup()
