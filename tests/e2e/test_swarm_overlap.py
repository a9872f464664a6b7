"""`[outer] overlap = true` on real `gasloc peer` processes: each round's exchange runs during the next round's inner
steps and its mix is added one round late; the swarm still pairs randomly, learns and stays together, and a
SIGTERM settles the exchange in flight before the shutdown checkpoint."""
from __future__ import annotations

import pytest

from e2e.swarm_helpers import all_have, ok_partners, rounds, start_peers, state_round, val_losses, write_config

FRESH_LOSS = 5.0  # a fresh tiny model on bytes: ~5.2 nats


@pytest.mark.timeout(300)
def test_overlapped_swarm_pairs_learns_and_settles_on_sigterm(harness, bootstrap):
    h = harness
    cfg = write_config(h, inner_steps=30, overlap=True)
    names = ["p0", "p1", "p2"]
    ids = start_peers(h, names, bootstrap, cfg)

    h.wait_until(all_have(h, names, ok_rounds=8, partners=2), 180, "8 ok exchanges with >= 2 partners each",
                 alive=tuple(names))

    for n in names:
        rs = rounds(h, n)
        assert set(ok_partners(rs)) <= set(ids.values()) - {ids[n]}, ok_partners(rs)
        assert rs[0]["outcome"] == "solo"  # round 1 reports the exchange of round 0: there is none
        for r in rs:
            if r["outcome"] == "ok":  # the exchange ran during this round's inner steps: no transfer time
                assert r["transfer_s"] == 0 and r["exchange_s"] > 0 and r["bytes_received"] > 0, r
        vals = val_losses(rs)
        assert len(vals) >= 4 and vals[-1] < FRESH_LOSS - 2.0 and vals[-1] < vals[0] - 0.2, (n, vals)
        cons = sorted(r["consensus"] for r in rs if r["outcome"] == "ok")
        assert cons[-1] < 2.0 and cons[len(cons) // 2] < 1.0, (n, cons)

    # a peer that stops by itself (--max-rounds) leaves its last exchange in flight: it is settled, then checkpointed.
    # Its catch-up resyncs are off: a resync settles and drops the exchange in flight (it carries the old model), and
    # a joiner whose last round resynced had none left to settle (one fresh-clone run failed so)
    cfg3 = h.run_dir / "p3.toml"
    text = cfg.read_text()
    assert "[guard]\n" in text and "[swarm]\n" in text, text    # the sections the two settings go into
    cfg3.write_text(text.replace("[guard]\n", "[guard]\ncatch_up_after_rejections = 0\n")
                    .replace("[swarm]\n", "[swarm]\nresync_behind_rounds = 0\n"))
    start_peers(h, ["p3"], bootstrap, cfg3, "--max-rounds", "4")
    assert h.wait_exit("p3", 90) == 0, h.log("p3")
    log = h.log("p3")
    assert "shutdown_step_failed" not in log, log
    settled = log.index("overlap: settled the last exchange")
    last = rounds(h, "p3")[-1]["round"]  # a joiner takes over its donor's round count: not 4
    assert f"checkpoint round={last} " in log[settled:], log

    # SIGTERM ends the inner steps early; the round still ends (its exchange settled), then a checkpoint of the state
    # the peer holds: its last round's, or a resync's that ended before the signal (CI saw one take round 19 to 21)
    h.terminate("p0")
    assert h.wait_exit("p0", 30) == 0, h.log("p0")
    log = h.log("p0")
    assert "shutdown_step_failed" not in log, log
    last = state_round(h, "p0")
    after = log.split("stopping signal=SIGTERM", 1)[1]
    assert f"checkpoint round={last} " in after and f" round={last} reason=SIGTERM" in after, log
