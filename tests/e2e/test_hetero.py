"""bench/hetero.py leaves nothing behind: SIGTERM or SIGINT in the middle of a run removes its namespaces and every
process in them; after a SIGKILL of the benchmark, `--cleanup` does. A small swarm (2 peers) for speed. Needs
root and `ip netns`."""
from __future__ import annotations

import importlib.util
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gasloc.runtime.procs import is_alive, read_stat

BENCH = Path(__file__).resolve().parents[2] / "bench"
_spec = importlib.util.spec_from_file_location("netlab", BENCH / "netlab.py")
netlab = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("netlab", netlab)
_spec.loader.exec_module(netlab)

_why = netlab.unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_why is not None, reason=f"network namespaces: {_why}")]


def _start(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(BENCH / "hetero.py"), "--peers", "2", "--runs", "gasloc",
                             "--duration-s", "300", "--out-dir", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)


def _wait_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if needle in line:
                return
            if not line and proc.poll() is not None:
                break
    proc.kill()
    pytest.fail(f"no line with {needle!r} within {timeout_s:.0f} s (rc={proc.poll()}): {proc.stderr.read()[-2000:]}")


def _inside(prefix: str) -> dict[int, int]:
    """pid -> start ticks of every process in the run's namespaces."""
    out = {}
    for ns in netlab.list_namespaces():
        if ns.startswith(prefix):
            for pid in netlab.namespace_pids(ns):
                st = read_stat(pid)
                if st is not None:
                    out[pid] = st.start_ticks
    return out


def _assert_gone(prefix: str, procs: dict[int, int]) -> None:
    deadline = time.monotonic() + 15
    while [p for p, t in procs.items() if is_alive(p, t)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p, t in procs.items() if is_alive(p, t)] == []
    assert [ns for ns in netlab.list_namespaces() if ns.startswith(prefix)] == []


@pytest.mark.light  # the swarm is stopped as soon as it is ready: what is tested is the cleanup
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupt_removes_namespaces_and_processes(tmp_path, sig):
    proc = _start(tmp_path)
    prefix = netlab.run_prefix("ghx", pid=proc.pid)
    try:
        _wait_line(proc, "peers ready", 180)
        procs = _inside(prefix)
        # the bootstrap and both peers, each with its DHT child and p2pd
        assert len(procs) >= 3 * 3, f"expected the swarm's processes inside the namespaces, found {procs}"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert f"interrupted by {sig.name}" in err
    _assert_gone(prefix, procs)


@pytest.mark.light
@pytest.mark.timeout(240)
def test_cleanup_after_sigkill_of_the_benchmark(tmp_path):
    proc = _start(tmp_path)
    prefix = netlab.run_prefix("ghx", pid=proc.pid)
    try:
        _wait_line(proc, "peers ready", 180)
        procs = _inside(prefix)
        proc.kill()
        proc.wait()
        assert [ns for ns in netlab.list_namespaces() if ns.startswith(prefix)], "nothing left to clean up"
        r = subprocess.run([sys.executable, str(BENCH / "hetero.py"), "--cleanup"], capture_output=True, text=True,
                           timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        netlab.remove_namespaces([ns for ns in netlab.list_namespaces() if ns.startswith(prefix)])
    assert r.returncode == 0, r.stderr
    assert prefix in r.stdout
    _assert_gone(prefix, procs)


@pytest.mark.timeout(300)
def test_bandwidth_aware_fast_peers_pass_over_the_slow_one_which_still_gets_partners(tmp_path):
    """The bandwidth-aware run on 2 fast peers (p0, p2) and a slow one (p1): the fast peers try each other while
    they cannot tell the links apart, and once they have met both, they pass the slow one over early in their
    searches; the slow peer still gets partners (in the searches left open to all, and late in the others), and
    every peer learns."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(BENCH / "hetero.py"), "--peers", "3", "--runs", "gasloc-bw",
                        "--duration-s", "60", "--out-dir", str(out), "--json", str(tmp_path / "h.json")],
                       capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rounds = {p: [e for e in map(json.loads, (out / "gasloc-bw" / p / "metrics.jsonl").read_text().splitlines())
                  if e.get("event") == "round"] for p in ("p0", "p1", "p2")}
    passed = {p: sum(e["passed_over"] for e in rs) for p, rs in rounds.items()}
    assert passed["p1"] == 0, passed                    # nobody is on a slower link than the slow peer
    assert passed["p0"] + passed["p2"] >= 1, passed    # the fast ones did, once they had met it
    doc = json.loads((tmp_path / "h.json").read_text())
    pairs = doc["pairs"]["gasloc-bw"]
    # (how often fast peers pair with each other is the benchmark's business: with three peers it depends on timing)
    assert pairs["fast-fast"] >= 1, pairs
    # the slow peer is not starved of partners: exchanges it completed with a fast peer, as its own rounds say. Not
    # the benchmark's ok pairs, which need both sides' guards to accept: the slow peer has done fewer inner steps
    # by any instant, and a fast peer's guard rejected its model on the loss check in some runs (its loss 2.53 on
    # their batch against a bound of 2.35), which is the guard's verdict on a partner the search did find
    ids = {e["peer_id"]: p for p in ("p0", "p1", "p2")
           for e in map(json.loads, (out / "gasloc-bw" / p / "metrics.jsonl").read_text().splitlines())
           if e.get("event") == "start" and e.get("peer_id")}
    met = [e for e in rounds["p1"] if e["outcome"] in ("ok", "rejected") and ids.get(e.get("partner")) in ("p0", "p2")]
    assert len(met) >= 2, ([(e["outcome"], ids.get(e.get("partner"))) for e in rounds["p1"]], pairs)
    # the better of the last two evaluations: a fast peer's loss jumps for a round when it mixes with a partner that
    # drifted away (+0.2 to +0.7 seen, docs/hetero-results.md); one such jump at the very end is not "did not learn"
    for p, rs in rounds.items():
        losses = [e["val_loss"] for e in rs if e.get("val_loss") is not None]
        assert len(losses) >= 2 and min(losses[-2:]) < losses[0] - 0.3, (p, losses)
