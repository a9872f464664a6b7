"""The live GASLoC swarm as real `gasloc` processes on loopback: it learns, pairs randomly, tolerates a frozen
peer, admits a joiner with the swarm's state, survives a kill -9 in mid-exchange and withdraws on SIGTERM."""
from __future__ import annotations

import os
import signal
import statistics
import time

import pytest
from hivemind.p2p import P2P

from e2e.swarm_helpers import (
    Listing,
    all_have,
    ok_partners,
    overhead_s,
    rounds,
    start_event,
    start_peers,
    val_losses,
    write_config,
)
from gasloc.peer.train.inner import InnerConfig, lr_at
from gasloc.protocol.codec import parse as parse_codec
from gasloc.runtime.procs import read_stat

EXCHANGE_TIMEOUT_S = 2.5  # [exchange] exchange_timeout_s in swarm_helpers.PEER_TOML
DEADLINE_S = 1.2          # write_config's partner_deadline_s
FRESH_LOSS = 5.0          # a fresh tiny model on bytes: ~5.2 nats (ln 256 = 5.55)
DECAY = 'warmup_steps = 10\ntotal_steps = 100000\ndecay_type = "linear"'  # over PEER_TOML's warmup_steps line
INNER = InnerConfig(lr=0.002, warmup_steps=10, inner_steps=30, total_steps=100_000, decay_type="linear")


def _resyncs(h, name):
    return [r for r in h.metrics(name) if r.get("event") == "resync"]


@pytest.mark.timeout(420)
def test_four_peers_learn_ride_out_a_frozen_peer_and_admit_a_joiner(harness, bootstrap):
    h = harness
    # rounds of ~3 s against a 1.2 s partner deadline: with 3 peers left, one is always the odd one out and may
    # wait the whole deadline; real rounds (hundreds of steps) make that share far smaller still
    cfg = write_config(h, inner_steps=30)
    # a slow lr decay (1.6% over the test): the joiner's lr must follow the swarm's position, not its own steps
    cfg.write_text(cfg.read_text().replace("warmup_steps = 10", DECAY))
    names = ["p0", "p1", "p2", "p3"]
    # p1 runs with an RSA identity file as gasloc made them before Ed25519 (and hivemind still does): it must pair
    # with the others as before; the others make fresh identities, Ed25519 (runtime/identity.py), whose libp2p peer
    # ids start with 12D3KooW (an RSA key's with Qm)
    rsa_key = h.dir("keys") / "p1-rsa.key"
    P2P.generate_identity(str(rsa_key))
    ids = start_peers(h, names, bootstrap, cfg, per_peer={"p1": ("--identity-path", rsa_key)})
    assert ids["p1"].startswith("Qm") and all(ids[n].startswith("12D3KooW") for n in ("p0", "p2", "p3")), ids

    # 1. random pairwise exchanges: everyone mixes with at least two different partners
    h.wait_until(all_have(h, names, ok_rounds=5, partners=2), 180, "5 ok exchanges with >= 2 partners each",
                 alive=tuple(names))
    for n in names:
        rs = rounds(h, n)
        assert set(ok_partners(rs)) <= set(ids.values()) - {ids[n]}, ok_partners(rs)
        for r in rs:  # the per-round record carries the documented fields
            assert {"time", "round", "inner_steps", "loss", "outcome", "partner", "bytes_sent", "bytes_received",
                    "exchange_s", "consensus", "compute_s", "wait_s", "transfer_s", "outer_s",
                    "peak_mem_mb"} <= set(r), r
            assert r["outcome"] in ("ok", "solo", "busy", "timeout", "rejected", "failed")
            assert r["exchange_s"] <= EXCHANGE_TIMEOUT_S + 0.5, r

    # 2. a peer frozen for 20 s (SIGSTOP of its whole tree, p2pd included) does not slow the others down
    survivors = names[:3]
    h.wait_until(lambda: all(rounds(h, n)[0]["time"] <= time.time() - 20 for n in survivors), 60,
                 "20 s of rounds before the pause", alive=tuple(names))
    # the pause outlasts p3's record (TTL 6 s) and resync_after_rounds (3) of its own rounds, measured in this run:
    # 20 s was 7 rounds on an idle machine and 2.5 at a load that made a round 8 s (no resync was due then)
    pause_s = max(20.0, 5 * statistics.median(r["round_s"] for r in rounds(h, "p3")))
    t_pause = time.time()
    h.pause("p3")
    time.sleep(pause_s)  # the fault's duration, not a readiness wait
    h.resume("p3")
    t_resume = time.time()
    for n in survivors:
        rs = rounds(h, n)
        # Three survivors: each round one of them is the odd one out, waits its whole partner deadline and goes
        # solo - the swarm's parity, not the frozen peer (measured extra per round: 0.1-0.5 s). Waiting for the
        # frozen peer (its TTL, libp2p's keepalive) would cost seconds per round, up to the whole 20 s.
        before, during = overhead_s(rs, t_pause - 20, t_pause), overhead_s(rs, t_pause, t_resume)
        extra = sum(during) / len(during) - sum(before) / len(before)
        assert extra <= DEADLINE_S + 0.5, (n, extra, "seconds outside the inner phase per round before, during:",
                                           before, during)
        late = [r for r in rs if r["time"] >= t_pause]
        assert all(r["exchange_s"] <= EXCHANGE_TIMEOUT_S + 0.5 for r in late), late
    # p3 was away longer than its record's TTL and ~8 of its rounds: it resyncs from a survivor instead of mixing
    # its stale model in (mixed in, it sat at 1.5-2.1x its norm from its partners for several rounds)
    # (only resyncs after the pause: an early one is legitimate - in 1 of 5 runs here p3's guard rejected two partners
    # in round 3, while the peers' models still move fast, and p3 resynced as the odd one out)
    def resyncs_after_pause():
        return [r for r in _resyncs(h, "p3") if r["time"] >= t_pause]
    h.wait_until(resyncs_after_pause, 60, "p3's resync after SIGCONT", alive=tuple(names))
    rs3 = resyncs_after_pause()[0]
    assert rs3["joined_from"] in {ids[n] for n in survivors}, rs3
    assert rs3["reason"] == "absent" and rs3["absent_s"] >= 15 and rs3["round"] > rs3["from_round"], rs3
    h.wait_until(all_have(h, ["p3"], ok_rounds=1, partners=1, since=rs3["time"]), 90,
                 "p3 exchanging again after its resync", alive=tuple(names))
    after = [r for r in rounds(h, "p3") if r["time"] >= rs3["time"]]
    first = next(r for r in after if r["outcome"] == "ok")
    # back among the swarm, like a joiner: as close to its partner as the survivors are to theirs (0.05-0.4 here,
    # up to ~0.7 between two pairs that had kept exchanging with each other), not 1.5-2.1 as when it mixed its
    # stale model in
    spread = [round(r["consensus"], 3) for n in survivors for r in rounds(h, n)
              if r["outcome"] == "ok" and t_pause <= r["time"] <= first["time"]]
    assert first["consensus"] < 1.0, (first, "p3 since its resync:", [(r["outcome"], r["consensus"]) for r in after],
                                      "survivors meanwhile:", spread)

    # 3. a joiner downloads the swarm's current state instead of starting from scratch, then exchanges. It runs
    #    exchange.codec int8 in a swarm of the default mod4-sd: its partners send it int8 (a modulo code is read only
    #    against the same code, protocol/codec.py sent_codec), so it pairs like any other
    swarm_val = [val_losses(rounds(h, n))[-1] for n in survivors]
    int8_cfg = h.run_dir / "peer-int8.toml"
    int8_cfg.write_text(cfg.read_text().replace("[exchange]\n", '[exchange]\ncodec = "int8"\n', 1))
    start_peers(h, ["p4"], bootstrap, int8_cfg)
    st = start_event(h, "p4")
    assert st["codec"] == "int8" and start_event(h, "p0")["codec"] == "mod4-sd", st
    assert st["joined_from"] in set(ids.values()), st
    assert st["initial_loss"] < FRESH_LOSS - 0.5, st
    assert abs(st["initial_loss"] - sum(swarm_val) / len(swarm_val)) < 0.5, (st, swarm_val)
    assert st["round"] > 0, st  # it took over the donor's round count
    h.wait_until(all_have(h, ["p4"], ok_rounds=1, partners=1), 90, "the joiner's first ok exchange",
                 alive=("p4",))
    # both directions carried int8: at least its payload each way (a mod4-sd exchange is half that)
    int8_bytes = parse_codec("int8").payload_bytes([st["num_params"]])
    ok4 = [r for r in rounds(h, "p4") if r["outcome"] == "ok"]
    assert all(r["bytes_sent"] >= int8_bytes and r["bytes_received"] >= int8_bytes for r in ok4), ok4
    first = rounds(h, "p4")[0]  # its lr: warmed up on its own 30 steps, decayed at the round it took over
    assert first["total_inner_steps"] == 30 and first["round"] == st["round"] + 1, first
    assert first["lr"] == pytest.approx(lr_at(29, INNER, 30 * first["round"] - 1), rel=1e-12), first
    assert first["lr"] != pytest.approx(lr_at(29, INNER), rel=1e-6), first

    # 4. over the whole run every original peer learned (well below a fresh model, and still improving) and the
    #    swarm stayed together: partners' models differ by a bounded fraction of their norm
    for n in names:
        rs = rounds(h, n)
        vals = val_losses(rs)
        assert len(vals) >= 5 and vals[-1] < FRESH_LOSS - 2.0 and vals[-1] < vals[0] - 0.2, (n, vals)
        # ~30 local AdamW steps move two peers apart by a few tenths of their norm; a swarm that splits or
        # diverges grows past it without bound
        cons = sorted(r["consensus"] for r in rs if r["outcome"] == "ok")
        assert cons[-1] < 2.0 and cons[len(cons) // 2] < 1.0, (n, cons)


@pytest.mark.timeout(300)
def test_kill_9_mid_exchange_is_survived_and_sigterm_withdraws_cleanly(harness, bootstrap):
    h = harness
    ttl_s = 8.0
    # partners drawn by measured bandwidth, live. guard.val_margin 0.5: step 3 resumes p1 behind p0 and checks that
    # it downloads p0's state. The tiny model plateaus near val loss 2.0 by then (p0 soloing after the kill), so on
    # p1's own batch its checkpoint can beat p0's state by more than the default 10 % (seen once: 2.00 against
    # 2.22), and the join guard rightly keeps p1's model; 0.5 still refuses garbage (a fresh model is ~5.5)
    cfg = write_config(h, ttl_s=ttl_s, bandwidth_weighting=True, val_margin=0.5)
    names = ["p0", "p1", "p2"]
    ids = start_peers(h, names, bootstrap, cfg)
    h.wait_until(all_have(h, names, ok_rounds=3, partners=1), 120, "3 ok exchanges each", alive=tuple(names))

    live = Listing(h, bootstrap)
    assert set(ids.values()) <= set(live())
    # each record carries the bandwidth its exchanges measured (what the others weigh it by)
    h.wait_until(lambda: all(live().get(i, {}).get("bandwidth_bps", 0) > 0 for i in ids.values()), 10,
                 "every record to carry a measured bandwidth", alive=tuple(names))

    # 1. kill -9 p2 while it offers its tensors (state "exchanging" in its record): its DHT child and p2pd
    #    must go too (death signal), the others must go on training without waiting past their deadlines
    h.wait_until(lambda: live().get(ids["p2"], {}).get("state") == "exchanging", 60,
                 "p2 in state exchanging", interval_s=0.02, alive=tuple(names))
    h.kill("p2")
    t_kill = time.time()
    assert h.wait_tree_gone("p2", 10), h.leftovers("p2")  # no orphan DHT/p2pd after kill -9 of the main
    h.wait_until(lambda: ids["p2"] not in live(), ttl_s + 5, "the dead peer to leave the listing")
    assert time.time() - t_kill <= ttl_s + 2.0  # its last announcement expired: liveness = TTL
    survivors = ["p0", "p1"]
    h.wait_until(lambda: all(sum(r["time"] > t_kill for r in rounds(h, n)) >= 5 for n in survivors), 90,
                 "5 rounds of each survivor after the kill", alive=tuple(survivors))
    for n in survivors:
        late = [r for r in rounds(h, n) if r["time"] > t_kill]
        assert all(r["exchange_s"] <= EXCHANGE_TIMEOUT_S + 0.5 for r in late), late
        assert any(r["outcome"] == "ok" for r in late), late  # still pairing with the other survivor

    # 2. SIGTERM: a clean exit 0 within seconds, the record withdrawn at once (not left to expire), nothing left.
    #    Sent twice at once, as the kernel does when a multi-threaded parent dies (one death signal per thread):
    #    the same request, not a forced exit
    h.terminate("p1")
    h.terminate("p1")
    assert h.wait_exit("p1", 30) == 0, h.log("p1")
    t_exit = time.time()
    after = h.wait_until(lambda: live(since=t_exit), 5, "a listing taken after p1 exited")
    assert ids["p1"] not in after and ids["p0"] in after, after  # withdrawn, not left to expire in up to ttl_s
    assert h.wait_tree_gone("p1", 10), h.leftovers("p1")
    left = h.leftovers("p1")
    assert not left.sockets and not left.shm, left
    stop = [r for r in h.metrics("p1") if r["event"] == "stop"]
    assert stop and stop[0]["reason"] == "SIGTERM", stop
    assert "withdrawn" in h.log("p1")

    # 3. restarted on its run directory, p1 resumes from the checkpoint it wrote at shutdown (resume beats a
    #    download from the live p0: it keeps its optimizer state and data position), sees that p0 went on for
    #    more than swarm.resync_behind_rounds, downloads p0's state instead of mixing its stale model in (which the
    #    guard would reject as far, round after round), and pairs with p0 again, accepted by p0's guard
    last_round = rounds(h, "p1")[-1]["round"]
    h.wait_until(lambda: rounds(h, "p0")[-1]["round"] >= last_round + 6, 60, "p0 six rounds past p1's checkpoint",
                 alive=("p0",))
    p1 = start_peers(h, ["p1"], bootstrap, cfg)["p1"]  # a new peer id: no --identity-path
    resumed = [r for r in h.metrics("p1") if r["event"] == "start"][-1]
    assert resumed["joined_from"] == "checkpoint" and resumed["round"] == last_round, resumed
    t_restart = time.time()
    h.wait_until(all_have(h, ["p1"], ok_rounds=1, partners=1, since=t_restart), 60, "the resumed p1's exchange",
                 alive=("p0", "p1"))
    caught_up = [r for r in _resyncs(h, "p1") if r["time"] >= t_restart]
    assert caught_up and caught_up[0]["reason"] == "behind" and caught_up[0]["joined_from"] == ids["p0"], caught_up
    assert caught_up[0]["round"] > last_round + 3, caught_up
    h.wait_until(lambda: any(r["partner"] == p1 and r["outcome"] == "ok" and r["time"] > t_restart
                             for r in rounds(h, "p0")), 30, "p0 mixing with the resumed p1", alive=("p0", "p1"))
    with_p1 = [r for r in rounds(h, "p0") if r["partner"] == p1 and r["time"] > t_restart and r.get("guard")]
    assert with_p1 and all(not r["rejected"] for r in with_p1), with_p1

    # 4. a shutdown stuck on an unresponsive DHT (its process frozen) is cut short by a second Ctrl+C: exit 130
    #    at once, and the death signal still takes the DHT child and its p2pd along (no orphan)
    main = read_stat(h.child("p0").pid)
    dht_pid = next(pid for pid, comm in h.tree("p0")  # the forked child with the main's name (not p2pd or shm)
                   if comm == main.comm and (st := read_stat(pid)) is not None and st.ppid == main.pid)
    os.kill(dht_pid, signal.SIGSTOP)
    h.interrupt("p0")
    h.wait_until(lambda: "stopping signal=SIGINT" in h.log("p0"), 10, "p0 to start its shutdown")
    h.interrupt("p0")  # at once: the same request
    time.sleep(1.5)    # an operator's second Ctrl+C, a moment later (the fault's timing, not a readiness wait)
    assert h.child("p0").poll() is None, h.log("p0")
    h.interrupt("p0")
    assert h.wait_exit("p0", 10) == 130, h.log("p0")
    assert h.wait_tree_gone("p0", 10), h.leftovers("p0")
