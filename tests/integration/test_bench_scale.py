"""bench/scale.py in its quick mode (10 and 100 members, real signed records in a real DHT): the JSON's shape, one
row per design and size, and the bucketed membership reading fewer bytes per search than the single key."""
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gasloc.runtime.procs import descendants, is_alive, read_stat

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"
FIELDS = {"design", "members", "dht_bytes_per_round", "cpu_ms_per_round", "partner_found_s_median",
          "partner_found_share", "searches", "listings_per_round", "startup_bytes", "buckets", "error",
          "finds_per_round", "hint_checks_per_round", "signed_hints", "dht_wire_in_per_round",
          "dht_wire_out_per_round", "identity"}


@pytest.mark.timeout(420)
def test_quick_mode_rows_and_buckets_read_less_than_the_single_key(tmp_path):
    out = tmp_path / "scale.json"
    r = subprocess.run([sys.executable, str(BENCH), "--members", "10,100", "--searches", "4", "--dht-nodes", "3",
                        # 10 members hold one ready peer at most: searches without one end at the deadline
                        "--deadline-s", "2", "--keys", str(tmp_path / "keys.bin"), "--json", str(out)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(x["design"], x["members"]) for x in rows} == {(d, n) for d in ("buckets", "single-key")
                                                           for n in (10, 100)}
    for x in rows:
        assert FIELDS <= set(x), FIELDS - set(x)
        assert x["error"] is None and x["dht_bytes_per_round"] > 0 and x["cpu_ms_per_round"] > 0
        # the network carries at least the merged answer once (each replica asked sends its copy)
        assert x["dht_wire_in_per_round"] >= 0.9 * x["dht_bytes_per_round"] and x["dht_wire_out_per_round"] > 0
        assert 0.0 <= x["partner_found_share"] <= 1.0
    by = {(x["design"], x["members"]): x for x in rows}
    assert by["buckets", 100]["dht_bytes_per_round"] < by["single-key", 100]["dht_bytes_per_round"] / 2
    why = {n: {k: by["buckets", n][k] for k in ("buckets", "estimate", "records_visible_share", "stores_failed",
                                                 "listings_per_round", "wide_retries")} for n in (10, 100)}
    assert by["buckets", 100]["buckets"] > 1 and by["buckets", 10]["buckets"] == 1, why
    assert by["buckets", 100]["signed_hints"] is True and by["single-key", 100]["signed_hints"] is None
    assert {x["identity"] for x in rows} == {"ed25519"}      # what a peer makes
    assert "| design | members |" in r.stdout


def test_bad_members_is_one_line_exit_2():
    r = subprocess.run([sys.executable, str(BENCH), "--members", "10,lots"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "not a comma-separated list of integers" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("after_s", [0.0, 1.5])
def test_sigterm_stops_its_dht_processes_and_removes_their_files(tmp_path, after_s):
    """SIGTERM as the searcher's start-up probe runs (its gets gathered as tasks: once in CI a KeyboardInterrupt
    landed in one, and asyncio printed its traceback at shutdown) or while it searches: exit without a traceback,
    and every p2pd it started gone with its socket, and its key directory (named in the searcher's p2pd arguments)
    removed."""
    proc = subprocess.Popen([sys.executable, str(BENCH), "--members", "10", "--searches", "500", "--dht-nodes", "2",
                             "--deadline-s", "2", "--keys", str(tmp_path / "keys.bin")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # with SIGINT ignored, as a background job of a non-interactive shell inherits it (CI):
                            # a bench that turned SIGTERM into SIGINT never stopped there
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline, line = time.monotonic() + 180, ""
        while time.monotonic() < deadline:           # readiness: the records are stored, searches begin
            line = proc.stderr.readline()
            if "records visible" in line or not line:
                break
        assert "records visible" in line, line
        daemons = [st for st in map(read_stat, descendants({proc.pid})) if st is not None and st.comm == "p2pd"]
        args = " ".join(Path(f"/proc/{st.pid}/cmdline").read_text().replace("\0", " ") for st in daemons)
        sockets = [Path(m) for m in re.findall(r"-listen=/unix(/\S+\.sock)", args)]
        workdir = Path(re.search(r"-id=(\S+)/searcher\.key", args).group(1))
        assert len(daemons) == 4 and len(sockets) == 4 and all(s.exists() for s in sockets) and workdir.is_dir()
        time.sleep(after_s)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "Traceback" not in err, err[-2000:]
    assert not [st.pid for st in daemons if is_alive(st.pid, st.start_ticks)]
    assert not [s for s in sockets if s.exists()] and not workdir.exists()
