"""`--algorithm diloco`: the all-reduce baseline on the same kind of swarm (hivemind's DecentralizedAverager): every
round averages the pseudo-gradients of the live peers, and the peers learn; SIGTERM still exits cleanly."""
from __future__ import annotations

import pytest

from e2e.swarm_helpers import rounds, start_event, start_peers, val_losses, write_config

FRESH_LOSS = 5.0


@pytest.mark.timeout(300)
def test_diloco_swarm_averages_over_all_peers_and_learns(harness, bootstrap):
    h = harness
    cfg = write_config(h)
    names = ["d0", "d1", "d2"]
    start_peers(h, names, bootstrap, cfg, "--algorithm", "diloco")

    def averaged(n: str) -> list[dict]:
        return [r for r in rounds(h, n) if r["outcome"] == "ok"]

    h.wait_until(lambda: all(len(averaged(n)) >= 15 for n in names), 200, "15 averaged rounds per peer",
                 alive=tuple(names))
    for n in names:
        st = start_event(h, n)
        assert st["algorithm"] == "diloco", st
        ok = averaged(n)
        assert all(r["group_size"] >= 2 and r["partner"] for r in ok), ok
        # the group is the whole swarm (3) once everyone is up, not a pair
        assert sum(r["group_size"] == 3 for r in ok) >= 3, [r["group_size"] for r in ok]
        for r in rounds(h, n):
            assert r["outcome"] in ("ok", "solo", "timeout", "failed"), r
        vals = val_losses(rounds(h, n))
        assert len(vals) >= 3 and vals[-1] < FRESH_LOSS - 1.5 and vals[-1] < vals[0] - 0.2, (n, vals)

    h.terminate("d2")
    assert h.wait_exit("d2", 40) == 0, h.log("d2")
    assert h.wait_tree_gone("d2", 10), h.leftovers("d2")  # averager and DHT processes, p2pd: all gone
