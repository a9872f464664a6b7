"""bench/scale.py in its quick mode (10 and 100 members, real signed records in a real DHT): the JSON's shape, one
row per design and size, and the bucketed membership reading fewer bytes per search than the single key."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"
FIELDS = {"design", "members", "dht_bytes_per_round", "cpu_ms_per_round", "partner_found_s_median",
          "partner_found_share", "searches", "listings_per_round", "startup_bytes", "buckets", "error",
          "finds_per_round", "hint_checks_per_round", "signed_hints"}


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
        assert 0.0 <= x["partner_found_share"] <= 1.0
    by = {(x["design"], x["members"]): x for x in rows}
    assert by["buckets", 100]["dht_bytes_per_round"] < by["single-key", 100]["dht_bytes_per_round"] / 2
    assert by["buckets", 100]["buckets"] > 1 and by["buckets", 10]["buckets"] == 1
    assert by["buckets", 100]["signed_hints"] is True and by["single-key", 100]["signed_hints"] is None
    assert "| design | members |" in r.stdout


def test_bad_members_is_one_line_exit_2():
    r = subprocess.run([sys.executable, str(BENCH), "--members", "10,lots"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "not a comma-separated list of integers" in r.stderr and "Traceback" not in r.stderr
