"""Untrusted volunteers (issues 11 part A and 29) on real `gasloc peer` processes, tiny model, fixed rounds.

1. Hostile volunteers: CLEAN_RUNS clean swarms of 4 honest peers, then the same with one hostile peer of each of
   CHECKED (bench/adversary.py runs the swarms and reads their metrics and logs: the same code as the bench):
   noisy (Gaussian noise on its parameters after every inner step) and scaled (sends 3y), the attackers the guard was
   built against; uphill (offers y plus a step up its own gradients, sized from its own guard's view to stay under
   tau) and echo (sends a partner's own payload back: distance ~0). The bias attackers are real peers made hostile
   by the [fault] config section, a TEST FAULT INJECTOR (peer/config.py FaultConfig); echo is `gasloc peer` with a
   hostile exchange (bench/adversary.py hostile-peer). What must hold: no honest peer crashes, the honest median
   final validation loss stays within BOUND of the worst clean swarm's, the noisy, scaled and echo offers are never
   accepted (a rejection searches on), and in the clean swarms honest peers do not reject each other after round 6.
   A lying donor, its own swarm: started first, the only peer claiming a round > 0, so every honest peer joins from
   it; its state says round 10^9, then "soon", then -7. No honest peer may crash or adopt its state.
2. Crash safety: a peer whose parameters turn NaN mid-round goes back to its last finite checkpoint and trains on;
   no checkpoint it leaves has a NaN; a SIGTERM that cuts a round short leaves the last full round's state.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e.harness import LOOPBACK
from e2e.swarm_helpers import start_event, val_losses, write_config
from gasloc.runtime.procs import read_stat

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from adversary import measure, run_swarm  # noqa: E402  (the adversary bench's swarms and figures)

# 12 rounds, one clean swarm: a swarm's start and stop cost about as much as 16 rounds of it, and this test was a
# fifth of `make test` with seven swarms of 16 rounds; the bench runs more of both against its 10 % bound
# (bench/adversary.py), this test only catches what BOUND's 30 % does
ROUNDS = 12
BOUND = 1.3  # the attacked swarms' honest median against the worst clean one (see the test for why not 1.05)
CLEAN_RUNS = 1
CHECKED = ("noisy", "scaled", "uphill", "echo")


def _problems(mode: str, row: dict, base: float) -> list[str]:
    """What went wrong in one attacked swarm (empty: it held)."""
    v, met = row["verdicts"], sum(row["verdicts"].values())
    out = []
    if row["crashes"]:
        out.append(f"{row['crashes']} honest peer(s) crashed or fell short of {ROUNDS} rounds")
    if row["adopted"]:
        out.append(f"{row['adopted']} honest join(s)/resync(s) adopted the hostile peer's state")
    if not row["val"] <= base * BOUND:
        out.append(f"honest median val loss {row['val']:.4f} > {BOUND} x worst clean {base:.4f}")
    if mode in ("noisy", "scaled", "uphill", "echo") and not met:
        out.append("no honest peer judged the attacker's tensors (the attack was not exercised)")
    if mode in ("noisy", "scaled", "echo") and v["accept"]:
        out.append(f"{v['accept']} of its offers accepted as they were ({v})")
    if mode in ("noisy", "scaled") and not row["searched_on"]:
        out.append("a rejection of the attacker never searched on for another partner")
    return out


@pytest.mark.timeout(1800)
def test_honest_peers_hold_against_hostile_volunteers(harness):
    h = harness
    # One bootstrap for every swarm, one after another: each swarm has a run id of its own, so they share no DHT
    # key, only the entry node (a fresh one per swarm cost ~6 s each to start and to stop)
    boot = h.bootstrap("boot").maddrs[0]
    cleans = [measure(h.run_dir, run_swarm(h.sup, h.run_dir, boot, f"clean{i}", None, ROUNDS), ROUNDS)
              for i in range(CLEAN_RUNS)]
    medians = [c["val"] for c in cleans]
    base = max(medians)
    print(f"clean swarm(s): honest median final val loss {[round(m, 4) for m in medians]}")
    assert base < 4.0, medians  # the clean swarms learned (a fresh tiny model is at ~5.2)
    for c in cleans:
        assert not c["crashes"], c
        # the guard leaves honest mixing alone once the first rounds are past
        assert not c["wrong_rejections_late"], c
    problems = {}
    for mode in CHECKED:
        row = measure(h.run_dir, run_swarm(h.sup, h.run_dir, boot, mode, mode, ROUNDS), ROUNDS)
        print(f"{mode}: honest median final val loss {row['val']:.4f} ({row['finals']}); verdicts on the attacker "
              f"{row['verdicts']}, searched on {row['searched_on']}, share {row['share']:.2f}, crashes "
              f"{row['crashes']}, adopted {row['adopted']}, served {row['hostile_served']}")
        if got := _problems(mode, row, base):
            problems[mode] = got
    # Unguarded, the noisy volunteer made it +109% and the scaled one NaN; the uphill attacker +74% past the first
    # guard (issue 29). Issue 11 asked for 5% of the clean swarms, but identical 4-peer swarms of 16 rounds differ
    # by more than that: in one fresh-clone run the scaled swarm's honest peers, which never met the attacker (every
    # exchange honest and accepted), ended at 2.76 against clean 2.17-2.27 (+22%). The bound is taken from the worst
    # clean swarm of this run; bench/adversary.py measures against the clean median with more rounds.
    assert not problems, problems


@pytest.mark.timeout(600)
def test_no_honest_joiner_adopts_a_lying_donors_state(harness):
    """A donor that started first is the only peer claiming a round > 0, so all four honest peers start as its
    joiners: it serves its starting state saying round 10^9 (reply header and metadata alike), then "soon", then -7
    (metadata), and its record claims a round 1000 ahead of its own. No honest peer may crash or take its state."""
    h = harness
    boot = h.bootstrap("boot").maddrs[0]
    row = measure(h.run_dir, run_swarm(h.sup, h.run_dir, boot, "donor", "donor-round", 8), 8)
    print(f"lying donor: served {row['hostile_served']} snapshot(s); honest adoptions {row['adopted']} at rounds "
          f"{row['adopted_rounds']}; crashes {row['crashes']}; honest median val loss {row['val']:.4f}")
    assert row["hostile_served"] >= 1, "no honest joiner asked the lying donor for its state"
    assert not row["crashes"], row
    # before "a donor that claims past what we believe is no donor" (a258c9c), 4 of 4 joiners adopted it at round 1012
    assert not row["adopted"], row


@pytest.mark.light  # one peer, alone
@pytest.mark.timeout(400)
def test_nan_mid_round_recovers_from_last_finite_checkpoint_and_a_cut_round_is_dropped(harness):
    h = harness
    cfg = write_config(h, inner_steps=6)
    cfg.write_text(cfg.read_text() + "[checkpoint]\nevery_rounds = 1\nkeep = 3\n[fault]\nnan_at_round = 4\n")
    run_dir = h.dir("peer")
    h.start("peer", "peer", "--config", cfg, "--host-maddrs", LOOPBACK, "--run-dir", run_dir, "--max-rounds", "8")
    assert h.wait_exit("peer", 200) == 0, h.log("peer")[-3000:]
    events = h.metrics("peer")
    rec = [e for e in events if e["event"] == "recovered"]
    assert len(rec) == 1 and rec[0]["round"] == 3 and rec[0]["from_round"] == 3, rec
    rs = [e for e in events if e["event"] == "round"]
    after = [r for r in rs if r["time"] > rec[0]["time"]]
    # it trained on from round 3's state: rounds 4 to 8 again (the broken round 4 was lost), finite losses
    assert [r["round"] for r in after] == [4, 5, 6, 7, 8][: len(after)] and len(after) >= 4, [r["round"] for r in rs]
    assert all(r["loss"] is not None for r in after)
    assert val_losses(after)[-1] < start_event(h, "peer")["initial_loss"] - 0.5, val_losses(after)
    ckpts = sorted((run_dir / "checkpoints").glob("ckpt-*"))
    assert ckpts
    for c in ckpts:  # never a non-finite checkpoint
        assert all(bool(torch.isfinite(t).all()) for t in load_file(str(c / "state.safetensors")).values()), c

    # a SIGTERM in the middle of a long inner phase: the cut round is dropped, the checkpoint is the last full one
    cfg.write_text(cfg.read_text().replace("inner_steps = 6", "inner_steps = 400").replace("nan_at_round = 4",
                                                                                          "noise_std = 0.0"))
    n_before = len(rs)
    h.start("peer-2", "peer", "--config", cfg, "--host-maddrs", LOOPBACK, "--run-dir", run_dir)
    h.wait_until(lambda: len([e for e in h.metrics("peer") if e["event"] == "start"]) == 2, 60, "the restart")
    # the stop must land inside the inner phase: a SIGTERM between the start event and the first step stops the peer
    # with no round begun, nothing to drop (seen once under the parallel suite). A second of the peer's own CPU past
    # its start event is some 50 of the 400 steps in
    pid = h.child("peer-2").pid
    started_cpu_s = read_stat(pid).cpu_s
    h.wait_until(lambda: read_stat(pid).cpu_s > started_cpu_s + 1.0, 60, "a second of the restart's inner phase")
    last_full = [e for e in h.metrics("peer") if e["event"] == "round"][-1]["round"]
    assert h.stop("peer-2") == 0
    rs2 = [e for e in h.metrics("peer") if e["event"] == "round"]
    assert len(rs2) == n_before, "the cut round was reported as a round"
    log = h.log("peer-2")
    assert "dropped it" in log, log[-2000:]
    newest = max(ckpts[0].parent.glob("ckpt-*"), key=lambda p: json.loads((p / "meta.json").read_text())["round"])
    assert json.loads((newest / "meta.json").read_text())["round"] == last_full
