"""`--algorithm diloco` as its users know it: one model. Three peers start behind a start barrier (the first
all-reduce is all three), one forks (its model and anchor jump, [fault] fork_at_round) and comes back by downloading
the group's model, one is frozen (SIGSTOP) while the other two step on, a fourth joins late; after every all-reduce
the members' anchors agree to a relative 1e-6 (fp32 wire), the fork, the frozen peer and the joiner come back into
the one model, and no peer ever takes an outer step without its group's mean (a round that does not step does not
count: the round number moves on exactly with the ok all-reduces, and with state downloads)."""
from __future__ import annotations

import re
import time

import pytest

from e2e.swarm_helpers import rounds, start_event, start_peers, val_losses, write_config

FRESH_LOSS = 5.0
LOSSLESS = 1e-6  # relative difference of two anchors after an all-reduce on an fp32 wire


def events(h, name: str) -> list[dict]:
    return [r for r in h.metrics(name) if r.get("event") in ("start", "round", "resync", "recovered")]


def ok_rounds(h, name: str, since: float = 0.0, size: int | None = None) -> list[dict]:
    return [r for r in rounds(h, name) if r["outcome"] == "ok" and r["time"] >= since
            and (size is None or r["group_size"] == size)]


def check_one_model(h, name: str, tolerance: float = LOSSLESS) -> None:
    """The round number moves on only with an ok all-reduce (then by one) or a state download (to the donor's);
    every ok all-reduce found the members' anchors equal (within `tolerance`: the wire's rounding)."""
    expected = None
    for ev in events(h, name):
        kind = ev["event"]
        assert kind != "recovered", (name, ev)
        if kind in ("start", "resync"):
            expected = ev["round"]
        elif ev["outcome"] == "ok":
            assert ev["round"] == expected + 1, (name, ev)
            assert ev["group_size"] >= 2 and ev["partner"], (name, ev)
            assert ev["anchor_spread"] is not None and ev["anchor_spread"] <= tolerance, (name, ev)
            expected = ev["round"]
        else:  # no group mean: no outer step, the round does not count
            assert ev["outcome"] in ("behind", "stopping"), (name, ev)
            assert ev["round"] == expected, (name, ev)


@pytest.mark.timeout(420)
def test_diloco_stays_one_model_through_a_freeze_and_a_joiner(harness, bootstrap):
    h = harness
    cfg = write_config(h)
    # lossless all-reduce (the exchange's default codec is lossy): the anchors must agree to float32 rounding.
    # A donor serves one peer a state at most every min_request_interval_s (30 s): with rounds of half a second a
    # peer behind twice in a row waited that out in a loop of rounds (a real DiLoCo round takes minutes); 5 s here
    cfg.write_text(cfg.read_text().replace("[diloco]\n", "[diloco]\ninitial_group_size = 3\ncompression = \"none\"\n")
                   + "\n[state_transfer]\nmin_request_interval_s = 5.0\n")
    # d2's model and anchor jump by 5 % of each tensor's RMS in its round 3 (or the first after it that d2 trains): a
    # fork, as a bad restore would make
    fork = h.run_dir / "fork.toml"
    fork.write_text(cfg.read_text() + "\n[fault]\nfork_at_round = 3\n")
    names = ["d0", "d1", "d2"]
    ids = start_peers(h, names, bootstrap, cfg, "--algorithm", "diloco", per_peer={"d2": ("--config", fork)})
    h.wait_until(lambda: all(len(ok_rounds(h, n)) >= 5 for n in names), 150, "5 averaged rounds per peer",
                 alive=tuple(names))
    for n in names:
        assert start_event(h, n)["algorithm"] == "diloco"
        # the start barrier: the very first step was everyone's
        assert ok_rounds(h, n)[0]["group_size"] == 3, ok_rounds(h, n)[0]
    # the fork was caught at its first all-reduce: nobody stepped with it (check_one_model below), and it downloaded
    # the group's model from a member that holds it
    forked = [e for e in events(h, "d2") if e.get("code") == "FORKED"]
    # round 3, or the first d2 trained after it (a partial all-reduce may leave it behind and resyncing first)
    fired = re.search(r"in round (\d+) \(a fork\)", h.log("d2"))
    assert fired, ("d2 never forked", events(h, "d2"))
    assert forked and forked[0]["round"] == int(fired.group(1)) - 1, (fired.group(0), events(h, "d2"))
    back = next(e for e in events(h, "d2") if e["event"] == "resync" and e["time"] >= forked[0]["time"])
    assert back["reason"] == "behind" and back["joined_from"] in (ids["d0"], ids["d1"]), back
    assert "code=OTHER_MODEL" in h.log("d0") + h.log("d1")

    # d1 misses epochs: frozen while d0 and d2 step on as a pair
    h.pause("d1")
    t_pause = time.time()
    h.wait_until(lambda: all(len(ok_rounds(h, n, since=t_pause, size=2)) >= 3 for n in ("d0", "d2")), 90,
                 "3 steps of the two others while d1 is frozen", alive=("d0", "d2"))
    h.resume("d1")
    t_resume = time.time()
    start_peers(h, ["d3"], bootstrap, cfg, "--algorithm", "diloco")
    everyone = names + ["d3"]
    h.wait_until(lambda: all(len(ok_rounds(h, n, since=t_resume, size=4)) >= 3 for n in everyone), 150,
                 "3 steps of all four after the freeze and the join", alive=tuple(everyone))

    for n in everyone:
        check_one_model(h, n)
    # the frozen peer came back by downloading the state it missed (the listing's rounds, or its absence), not by
    # stepping on its old model
    back = [e for e in events(h, "d1") if e["time"] >= t_resume]
    assert any(e["event"] == "resync" for e in back), back
    assert start_event(h, "d3")["joined_from"], start_event(h, "d3")
    vals = val_losses(rounds(h, "d0"))
    assert vals[-1] < FRESH_LOSS - 1.5 and vals[-1] < vals[0] - 0.2, vals

    h.terminate("d2")
    assert h.wait_exit("d2", 40) == 0, h.log("d2")
    assert h.wait_tree_gone("d2", 10), h.leftovers("d2")  # averager and DHT processes, p2pd: all gone


@pytest.mark.timeout(300)
def test_a_lossy_all_reduce_keeps_the_members_within_its_bound(harness, bootstrap):
    """float16 (hivemind's Float16Compression, what exchange.codec float16 maps to): each member receives the
    rounded difference between the mean and its own part, so anchors part by the rounding; they stay within the
    bound the fork check allows for that codec, and nobody is taken for a fork. (A member may still download the
    state: a groupmate that fails mid-way leaves it without part of the mean, which it then refuses while the
    others step; peer/swarm/diloco.py allreduce_shortfall.)"""
    from gasloc.peer.swarm.diloco import TOLERANCE

    h = harness
    cfg = write_config(h)
    cfg.write_text(cfg.read_text().replace("[diloco]\n", "[diloco]\ninitial_group_size = 3\ncompression = \"float16\"\n"))
    names = ["f0", "f1", "f2"]
    start_peers(h, names, bootstrap, cfg, "--algorithm", "diloco")
    h.wait_until(lambda: all(len(ok_rounds(h, n)) >= 8 for n in names), 200, "8 averaged rounds per peer",
                 alive=tuple(names))
    for n in names:
        ok = ok_rounds(h, n)
        assert all("compression=float16" in r["detail"] for r in ok), ok[0]
        spreads = [r["anchor_spread"] for r in ok[1:]]
        assert spreads and all(0 <= s <= TOLERANCE["float16"] for s in spreads), (n, spreads)
        assert not [e for e in events(h, n) if e.get("code") == "FORKED"], n
        check_one_model(h, n, TOLERANCE["float16"])
