"""Untrusted volunteers (issue 11 part A) on real `gasloc peer` processes, tiny model, fixed rounds.

1. Robust mixing: CLEAN_RUNS clean swarms of 4 honest peers, then the same with one noisy volunteer (Gaussian noise
   on its parameters after every inner step), then with one peer that sends its model scaled x3. The attackers are
   real peers made hostile by the [fault] config section, a TEST FAULT INJECTOR (peer/config.py FaultConfig). With
   the guard at its defaults (on), the honest peers' median final validation loss stays within BOUND of the worst
   clean swarm's (clean runs of the same seeds differ among themselves, measured in the same test)
   and their metrics show the attacker's mixes clipped or rejected, the round searching on for another partner.
2. Crash safety: a peer whose parameters turn NaN mid-round goes back to its last finite checkpoint and trains on;
   no checkpoint it leaves has a NaN; a SIGTERM that cuts a round short leaves the last full round's state.
"""
from __future__ import annotations

import json
import statistics

import pytest
import torch
from safetensors.torch import load_file

from e2e.harness import LOOPBACK
from e2e.swarm_helpers import rounds, start_event, val_losses, write_config

ROUNDS = 16
BOUND = 1.3  # the attacked swarms' honest median against the worst clean one (see the test for why not 1.05)
CLEAN_RUNS = 3
HONEST = ["h0", "h1", "h2", "h3"]
ATTACKS = {
    "noisy": "[fault]\nnoise_std = 0.02\n",   # large finite noise after every inner step
    "scaled": "[fault]\nsend_scale = 3.0\n",  # sends 3 y instead of y
}


def _swarm(h, boot: list[str], tag: str, fault: str | None) -> tuple[list[float], list[dict], str | None]:
    """One swarm of HONEST (+ an attacker with `fault`) for ROUNDS rounds, through the bootstrap at `boot`: (honest
    final val losses, honest round records, the attacker's peer id)."""
    cfg = write_config(h, inner_steps=10).rename(h.run_dir / f"peer-{tag}.toml")
    # every round evaluated: a peer that joined late ends on another round number than the others
    cfg.write_text(cfg.read_text().replace('run_id = "e2e"', f'run_id = "e2e-{tag}"')
                   .replace("eval_every_rounds = 2", "eval_every_rounds = 1"))
    names = [f"{tag}-{n}" for n in HONEST]
    configs = dict.fromkeys(names, cfg)
    if fault is not None:
        bad = h.run_dir / f"attacker-{tag}.toml"
        bad.write_text(cfg.read_text() + fault)
        configs[f"{tag}-bad"] = bad
    # the same data streams in every scenario (a peer's seed file, peer/daemon.py worker_seed): what differs
    # between the clean and the attacked swarm is the attacker, and random partner choice, not which data came first
    for n in configs:
        (h.dir(n) / "worker_seed").write_text(f"{n.split('-', 1)[1]}\n")
    # all at once: the attacker is one of the swarm's first members, not a late joiner
    children = {n: h.spawn(n, "peer", "--config", c, "--initial-peers", boot[0], "--host-maddrs", LOOPBACK,
                           "--run-dir", h.dir(n), "--max-rounds", ROUNDS, "--no-checkpoint")
                for n, c in configs.items()}
    ids = {n: h.wait_ready(c, 150)["peer_id"] for n, c in children.items()}
    attacker = ids.get(f"{tag}-bad")
    for n in names:
        code = h.wait_exit(n, 400)
        assert code == 0, (n, code, h.log(n)[-3000:])
    if attacker is not None:
        # the honest peers are done; the attacker, some rounds behind (distrusted) and now alone in its run, would wait
        # out its partner deadline in each round it has left (it ended 7-9 s after the last honest peer): stopped
        # instead, cleanly
        h.terminate(f"{tag}-bad")
        code = h.wait_exit(f"{tag}-bad", 400)
        assert code == 0, (f"{tag}-bad", code, h.log(f"{tag}-bad")[-3000:])
    finals, recs = [], []
    for n in names:
        rs = rounds(h, n)
        assert len(rs) == ROUNDS, (n, [r["round"] for r in rs])
        assert rs[-1]["val_loss"] is not None, rs[-1]
        finals.append(rs[-1]["val_loss"])
        recs += rs
    return finals, recs, attacker


@pytest.mark.timeout(1500)
def test_guard_keeps_honest_loss_against_a_noisy_and_a_scaled_volunteer(harness):
    h = harness
    # One bootstrap for the five swarms, one after another: each swarm has a run id of its own, so they share no DHT
    # key, only the entry node (a fresh one per swarm cost ~6 s each to start and to stop)
    boot = h.bootstrap("boot").maddrs
    cleans = [_swarm(h, boot, f"clean{i}", None) for i in range(CLEAN_RUNS)]
    medians = [statistics.median(finals) for finals, _, _ in cleans]
    base = max(medians)
    print(f"clean swarms: honest median final val loss {[round(m, 4) for m in medians]} "
          f"(spread {base / min(medians) - 1:+.1%})")
    assert base < 4.0, medians  # the clean swarms learned (a fresh tiny model is at ~5.2)
    clean_recs = [r for _, recs, _ in cleans for r in recs]
    # honest peers barely clip each other, and never reject each other: the guard leaves honest mixing alone
    verdicts = [r["guard"] for r in clean_recs if r.get("guard")]
    assert verdicts and sum(v == "accept" for v in verdicts) >= 0.7 * len(verdicts), verdicts
    assert not any(r["rejected"] for r in clean_recs if r.get("guard")), [r for r in clean_recs if r.get("rejected")]
    for tag, fault in ATTACKS.items():
        finals, recs, bad = _swarm(h, boot, tag, fault)
        with_bad = [r for r in recs if r["partner"] == bad and r.get("guard")]
        searched_on = [r for r in recs if r.get("rejected_partner") == bad]
        print(f"{tag}: honest median final val loss {statistics.median(finals):.4f} ({finals}); verdicts on the "
              f"attacker {[(r['guard'], round(r['clipped_by'], 3)) for r in with_bad]}; rounds that searched on "
              f"after rejecting it {[(r['outcome'], r['guard']) for r in searched_on]}")
        assert with_bad or searched_on, f"no honest peer received the {tag} attacker's tensors"
        assert all(r["guard"] in ("clip", "reject") for r in with_bad), with_bad
        assert all(r["outcome"] == "rejected" for r in with_bad if r["rejected"])
        assert searched_on, "a rejection of the attacker never searched on for another partner"
        # Unguarded, the noisy volunteer made it +109% and the scaled one NaN. Issue 11 asked for 5% of the clean
        # swarms, but identical 4-peer swarms of 16 rounds differ by more than that: in one fresh-clone run the
        # scaled swarm's honest peers, which never met the attacker (every exchange honest and accepted), ended
        # at 2.76 against clean 2.17-2.27 (+22%). The bound is taken from the worst clean swarm of this run.
        assert statistics.median(finals) <= base * BOUND, (tag, finals, medians)


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
    last_full = [e for e in h.metrics("peer") if e["event"] == "round"][-1]["round"]
    assert h.stop("peer-2") == 0
    rs2 = [e for e in h.metrics("peer") if e["event"] == "round"]
    assert len(rs2) == n_before, "the cut round was reported as a round"
    log = h.log("peer-2")
    assert "dropped it" in log, log[-2000:]
    newest = max(ckpts[0].parent.glob("ckpt-*"), key=lambda p: json.loads((p / "meta.json").read_text())["round"])
    assert json.loads((newest / "meta.json").read_text())["round"] == last_full
