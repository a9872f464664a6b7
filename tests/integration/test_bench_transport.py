"""bench/transport.py end to end on a tiny payload: it runs every method, checks what arrived, writes its JSON, and
leaves no worker, namespace or socket file behind, also when it is interrupted."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gasloc.protocol.codec import parse
from gasloc.runtime.procs import Supervisor, descendants, is_alive, process_table

BENCH = Path(__file__).resolve().parents[2] / "bench" / "transport.py"
# one xdist worker for all: two benches at once would each take both cores' worth of workers
pytestmark = pytest.mark.xdist_group("bench_transport")


def workers_alive() -> list[int]:
    """PIDs of every transport worker process on the machine, whoever started it: intersect with a bench's own
    processes (in CI two workers of another bench, running beside ours, once failed the loopback test)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"transport_worker.py" in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def describe(pid: int) -> str:
    """A process's state, group, parent and kernel wait channel, for a failure message."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"gone ({e})"
    keep = ("State", "PPid", "NSpgid", "NSsid", "Threads", "SigPnd", "ShdPnd")
    return "; ".join(line for line in status.splitlines() if line.split(":")[0] in keep) + f"; wchan {wchan}"


@pytest.mark.timeout(150)
def test_bench_quick_loopback_all_methods(tmp_path):
    out = tmp_path / "rows.json"
    # the Supervisor records the bench's tree by PID and start time while it runs (only our own processes count:
    # CI once ran another bench beside this test, two session-leader workers whose parent outlived ours)
    sup = Supervisor(watch_interval_s=0.2, subreaper=False)
    try:
        bench = sup.start("bench", [sys.executable, str(BENCH), "--sizes", "1M", "--links", "loopback", "--reps", "1",
                                    "--warmup", "0", "--json", str(out)], tmp_path / "bench.log")
        try:
            rc = bench.popen.wait(timeout=140)
        except subprocess.TimeoutExpired:
            pytest.fail("the bench took over 140 s")
        stdout, stderr = bench.stdout_path.read_text(), bench.log_path.read_text()
        assert rc == 0, stdout[-2000:] + stderr[-2000:]
        rows = json.loads(out.read_text())["rows"]
        assert {(x["method"], x["wire_dtype"]) for x in rows} == {
            (m, w) for m in ("gasloc", "tcp", "hivemind_raw_stream", "hivemind_averager")
            for w in ("float32", "float16")}
        for x in rows:
            assert x["link"] == "loopback" and x["params"] == 1_000_000 and x["seconds"] > 0 \
                and x["mb_s_each_way"] > 0
        assert "vs averager" in stdout and "target >= 2.0x" in stdout
        # nothing of ours outlives the bench (it reaps its workers' whole trees, shm manager included)
        left = sup.leftovers("bench").processes
        assert not left, ({p: describe(int(p.split()[0])) for p in left}, stderr[-2000:])
        below = [pid for pid, _ in sup.tree("bench") if pid != bench.pid]
        assert len(below) > 4, below   # both workers, their DHT and averager processes, p2pd: seen while they ran
        # the averager's shared tensors: torch's shm manager removes them 2 s after the last worker is gone (a
        # sweep that SIGKILLed it left ten files per run)
        assert not sup.settle(15).shm
    finally:
        sup.stop_all(grace_s=60)     # a bench still running (a failed assertion) and its tree
        sup.cleanup()


def test_bench_rejects_bad_options():
    r = subprocess.run([sys.executable, str(BENCH), "--links", "10gbit"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown ['10gbit']" in r.stderr
    r = subprocess.run([sys.executable, str(BENCH), "--layout", "flat"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'flat' is not one of 'embedding', 'even'" in r.stderr


@pytest.mark.timeout(120)
def test_the_embedding_layout_pipelines_a_modulo_exchange_with_half_the_payload_in_its_first_tensor(tmp_path):
    """`--layout embedding`: the workers' tensors are half the parameters and nine of the rest (a language model's
    embedding first), what the default codec's pipelined exchange sends only as its encode advances; the partner's
    tensors arrive checked."""
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(BENCH), "--sizes", "1M", "--links", "loopback", "--reps", "1",
                        "--warmup", "0", "--methods", "gasloc", "--wires", "mod4-sd", "--layout", "embedding",
                        "--json", str(out)], capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["layout"] == "embedding" and row["method"] == "gasloc" and row["seconds"] > 0
    assert round(row["wire_mb_each_way"] * 1e6) == parse("mod4-sd").payload_bytes([500_000] + [55_555] * 9)


@pytest.mark.netns
@pytest.mark.timeout(160)
@pytest.mark.skipif(os.geteuid() != 0, reason="shaped links need root (ip netns, tc)")
def test_bench_sigterm_removes_namespaces_and_workers():
    proc = subprocess.Popen([sys.executable, str(BENCH), "--sizes", "1M", "--links", "100mbit", "--reps", "50",
                             "--methods", "tcp,gasloc", "--wires", "float32"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    prefix = f"gxb{proc.pid % 100000}"
    ours: dict = {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:           # readiness: the first timed run is printed
            line = proc.stdout.readline()
            if " rep " in line or not line:
                break
        assert " rep " in line, proc.stderr.read()[-2000:]
        assert f"{prefix}a" in netns_list().split()
        # this bench's workers and their p2pd, by PID and start time (other programs' processes are not its own)
        table = process_table()
        ours = {pid: table[pid] for pid in descendants({proc.pid}, table)}
        assert len(set(ours) & set(workers_alive())) == 2 and any(st.comm == "p2pd" for st in ours.values())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=100) == 130
        assert not {f"{prefix}a", f"{prefix}b"} & set(netns_list().split())
        left = [pid for pid, st in ours.items() if is_alive(pid, st.start_ticks)]
        assert not left, (proc.stderr.read()[-2000:], {pid: describe(pid) for pid in left})
    finally:
        clean_up(proc, prefix, ours)


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def clean_up(proc: subprocess.Popen, prefix: str, ours: dict) -> None:
    """Whatever a failed run left: the bench gets SIGTERM (it removes its workers and namespaces), then whatever
    is still there goes by force. A SIGKILL at once left two namespace pairs and three p2pd sockets behind here."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid, st in ours.items():
        if is_alive(pid, st.start_ticks):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(st.pgid, signal.SIGKILL)
    for name in {f"{prefix}a", f"{prefix}b"} & set(netns_list().split()):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


# A worker descendant that left the worker's process group and session (the killpg in WorkerProc.stop misses it),
# then lost its parent: reap_descendants must still find and kill it, since the subreaper inherited it.
_REAP_PROGRAM = """
import importlib.util, os, subprocess, sys
spec = importlib.util.spec_from_file_location("transport_bench", sys.argv[1])
tb = sys.modules["transport_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tb)
tb.become_subreaper()
escape = ("import os, time\\nif os.fork() == 0:\\n    os.setsid(); print(os.getpid(), flush=True)\\n"
          "    null = os.open(os.devnull, os.O_WRONLY); os.dup2(null, 1); os.dup2(null, 2); time.sleep(600)")
child = subprocess.Popen([sys.executable, "-c", escape], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
child.wait()
print(grandchild, tb.process_table()[grandchild].ppid == os.getpid(), flush=True)
tb.reap_descendants(10)
print(grandchild, flush=True)
"""


@pytest.mark.timeout(60)
def test_reap_descendants_kills_an_orphan_that_left_the_workers_session():
    r = subprocess.run([sys.executable, "-c", _REAP_PROGRAM, str(BENCH)], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    first, last = r.stdout.split("\n")[:2]
    pid, ours = first.split()
    try:
        assert ours == "True", "the orphan was not re-parented to the subreaper"
        assert last == pid and not Path(f"/proc/{pid}").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def test_the_workers_check_reads_a_modulo_partner_against_the_pairs_own_step():
    # a modulo codec's partner is decoded against our own tensors: within the pair's step of the partner (its code
    # range spans RANGE_RMS of the difference), not within a blockwise scale's step of the weights
    sys.path.insert(0, str(BENCH.parent))
    try:
        import torch
        from transport_worker import check, digest
    finally:
        sys.path.pop(0)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(4096, generator=g) for _ in range(2)]
    own = [b + 0.025 * torch.randn(4096, generator=g) for b in base]
    theirs = [b + 0.025 * torch.randn(4096, generator=g) for b in base]
    step = 8 * 0.025 * 2 ** 0.5 / 8   # RANGE_RMS x the difference's RMS / 2^(b-1)
    near = [t + step * (torch.rand(4096, generator=g) - 0.5) for t in theirs]
    assert check(near, digest(theirs), "mod4-sd", own_digest=digest(own)) == "ok"
    far = [t + 3 * step for t in theirs]   # three steps off: a wrong decode
    assert check(far, digest(theirs), "mod4-sd", own_digest=digest(own)).startswith("MISMATCH")
