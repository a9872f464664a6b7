"""`gasloc doctor` on a healthy local setup (exit 0) and on broken ones (exit 1, a FAIL line with a concrete fix)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from e2e.harness import MADE_UP_PEER_ID, free_port

pytestmark = [pytest.mark.timeout(120), pytest.mark.light]


def doctor(harness, *args, name="doctor", expect_rc):
    harness.spawn(name, "doctor", "--timeout-s", "5", *args)
    rc = harness.wait_exit(name, 90)
    out = harness.child(name).stdout_path.read_text()
    assert rc == expect_rc, out + harness.log(name)
    assert "Traceback" not in harness.log(name)
    return out


def fail_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("FAIL ")]


def row(out: str, check: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(f"│ {check} ")]
    assert lines, out
    return lines[0]


def test_healthy_local_setup(harness, bootstrap, tmp_path):
    ckpt = tmp_path / "ckpt" / "run1"
    out = doctor(harness, "--initial-peers", bootstrap[0], "--port", free_port(), "--checkpoint-dir", ckpt,
                 expect_rc=0)
    assert "0 failed" in out and not fail_lines(out), out
    for check in ("listen port", "p2pd", "announced address", "initial peer", "clock skew", "checkpoint dir",
                  "disk space"):
        assert "│ OK " in row(out, check), (check, out)
    assert "GPU" in out  # OK with CUDA, WARN "no CUDA: will train on CPU" without: never a failure
    assert not ckpt.exists() and not ckpt.parent.exists()  # the writability probe cleans up after itself
    assert harness.wait_tree_gone("doctor", 10)  # its throwaway p2pd is gone too


def test_unreachable_initial_peer(harness, tmp_path):
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{MADE_UP_PEER_ID}"  # nothing listens there
    out = doctor(harness, "--initial-peers", maddr, "--checkpoint-dir", tmp_path / "ckpt", expect_rc=1)
    [line] = fail_lines(out)
    assert line.startswith(f"FAIL initial peer: {maddr}: cannot connect") or "no answer within" in line, line
    assert "fix: check that the peer runs and that this address" in line and "maddrs file" in line, line


def test_port_in_use(harness, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = doctor(harness, "--port", port, "--checkpoint-dir", tmp_path / "ckpt", expect_rc=1)
    [line] = fail_lines(out)
    assert f"FAIL listen port: tcp/{port} is in use by pid {os.getpid()}" in line, line
    assert f"fix: stop that process, or pick a free port: --port {port + 1}" in line, line


def test_checkpoint_dir_under_a_file(harness, tmp_path):
    """Tests run as root, and root ignores permission bits (chmod 0500 would not stop it); a path below a regular
    file cannot be created by anyone."""
    (tmp_path / "afile").write_text("not a directory")
    out = doctor(harness, "--checkpoint-dir", tmp_path / "afile" / "ckpt", expect_rc=1)
    [line] = fail_lines(out)
    assert f"{tmp_path / 'afile'} is a file" in line and "fix: choose another --checkpoint-dir" in line, line


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=10).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare --mount (root, Linux)")
def test_checkpoint_dir_on_read_only_mount(harness, tmp_path):
    """An existing directory that even root cannot write: a read-only tmpfs mounted in a private mount namespace
    (visible only to the doctor's process, gone with it)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    script = f'mount -t tmpfs -o ro none "{ro}" && exec "$@"'
    argv = ["unshare", "--mount", "sh", "-c", script, "sh", sys.executable, "-m", "gasloc.cli.main", "doctor",
            "--checkpoint-dir", str(ro / "ckpt")]
    child = harness.sup.start("doctor", argv, harness.run_dir / "doctor.log")
    assert child.popen.wait(90) == 1, harness.log("doctor")
    [line] = fail_lines(child.stdout_path.read_text())
    assert "Read-only file system" in line and "fix:" in line and "read-only file system" in line, line


def test_public_swarm_needs_a_public_address(harness, tmp_path):
    out = doctor(harness, "--public", "--checkpoint-dir", tmp_path / "ckpt", expect_rc=1)
    [line] = fail_lines(out)
    assert line.startswith("FAIL announced address: only loopback/private") and "--announce-maddrs" in line, line
    # a public announce address passes (only its scope is checked: nothing dials it)
    out = doctor(harness, "--public", "--announce-maddrs", "/ip4/8.8.8.8/tcp/31337", "--checkpoint-dir",
                 tmp_path / "ckpt", name="doctor2", expect_rc=0)
    assert "│ OK " in row(out, "announced address"), out


def test_bad_options(harness):
    r = harness.run("doctor", "--initial-peers", "/ip4/1.2.3.4/tcp/5", timeout_s=60)
    assert r.returncode == 2 and "must end with /p2p/<peer id>" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = harness.run("doctor", "--print-config", "--port", "4001", timeout_s=60)
    assert r.returncode == 0 and "port = 4001" in r.stdout
