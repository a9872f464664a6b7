"""Memory known before it runs out (issue 31), on real `gasloc peer` processes on the CPU:
- a config whose round does not fit under a memory limit (run.memory_limit_mb, the CPU's stand-in for a GPU's
  free memory) is refused at start with one line that names what fits, and exit code 3;
- an out-of-memory error mid-round (the fault injector raises torch's OutOfMemoryError) ends the peer with one
  line and exit code 3, no checkpoint of the half-done round, and a restart with the same settings refuses at
  once (no second round trained: no crash loop), while changed settings start again."""
from __future__ import annotations

import pytest

from e2e.harness import LOOPBACK
from e2e.swarm_helpers import write_config


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


@pytest.mark.light  # one peer, alone
@pytest.mark.timeout(240)
def test_a_preset_that_does_not_fit_is_refused_at_start_in_one_line(harness):
    h = harness
    config = write_config(h)
    # medium's round needs ~0.9 GB above the runtime (tests/unit/test_memory.py); allow the runtime and 300 MB
    config.write_text(config.read_text().replace('preset = "tiny"', 'preset = "medium"')
                      .replace("[run]\n", "[run]\nmemory_limit_mb = 900\n"))
    res = h.run("peer", "--config", config, "--host-maddrs", LOOPBACK, "--run-dir", h.dir("peer"), timeout_s=180)
    assert res.returncode == 3, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1, res.stderr[-2000:]
    line = lines[0]
    assert "model.preset='medium'" in line and "run.memory_limit_mb=900" in line, line
    assert "data.batch_size=" in line and "fits" in line, line  # names what would fit
    assert not [r for r in h.metrics("peer") if r.get("event") == "round"]


@pytest.mark.light  # one peer, alone
@pytest.mark.timeout(300)
def test_out_of_memory_mid_round_ends_the_peer_and_a_restart_refuses_at_once(harness):
    h = harness
    config = write_config(h, inner_steps=3)
    config.write_text(config.read_text() + "[checkpoint]\nevery_rounds = 1\n[fault]\noom_at_round = 3\n")
    run_dir = h.dir("peer")
    res = h.run("peer", "--config", config, "--host-maddrs", LOOPBACK, "--run-dir", run_dir, timeout_s=200)
    assert res.returncode == 3, res.stderr[-3000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "out of memory in round 3" in lines[0], res.stderr[-3000:]
    recs = h.metrics("peer")
    assert [r["round"] for r in recs if r.get("event") == "round"] == [1, 2]
    assert [r["round"] for r in recs if r.get("event") == "checkpoint"] == [1, 2]  # none of the broken round
    assert recs[-1]["event"] == "stop" and recs[-1]["reason"] == "out_of_memory"
    assert (run_dir / "out-of-memory.json").exists()

    # what a restart policy does next: the same command again. It refuses before training anything
    again = h.run("peer", "--config", config, "--host-maddrs", LOOPBACK, "--run-dir", run_dir, timeout_s=120)
    assert again.returncode == 3, again.stderr[-3000:]
    lines = error_lines(again.stderr)
    assert len(lines) == 1 and "ran out of memory in round 3" in lines[0] and "data.batch_size" in lines[0], lines
    assert [r for r in h.metrics("peer") if r.get("event") == "start"].__len__() == 1  # never got as far as start

    # changed settings (a smaller batch): the marker no longer applies, the peer resumes and trains
    config.write_text(config.read_text().replace("batch_size = 4", "batch_size = 2")
                      .replace("oom_at_round = 3", "oom_at_round = 99").replace("[run]\n", "[run]\nmax_rounds = 1\n"))
    third = h.run("peer", "--config", config, "--host-maddrs", LOOPBACK, "--run-dir", run_dir, timeout_s=200)
    assert third.returncode == 0, third.stderr[-3000:]
    assert not (run_dir / "out-of-memory.json").exists()
    assert [r["round"] for r in h.metrics("peer") if r.get("event") == "round"][-1] == 3
