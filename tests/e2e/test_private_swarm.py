"""A private swarm as real `gasloc` processes: a keyed bootstrap and three keyed peers train together and admit a
keyed joiner with their state; outsiders without the key or with another key get nothing from it - not a DHT
entry, not a listing, not a byte."""
from __future__ import annotations

import os
import stat
import time

import pytest

from e2e.harness import LOOPBACK
from e2e.swarm_helpers import all_have, ok_partners, rounds, start_event, start_peers, write_config


@pytest.mark.timeout(400)
def test_outsiders_without_the_key_or_with_another_get_nothing(harness):
    h = harness
    key, other = h.run_dir / "swarm.key", h.run_dir / "other.key"
    for path in (key, other):
        res = h.run("keygen", str(path))
        assert res.returncode == 0, res.stderr
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = h.run("keygen", str(key))        # never overwritten
    assert again.returncode == 2 and "already exists" in again.stderr and len(again.stderr.splitlines()) == 1

    boot = h.bootstrap("bootstrap", "--swarm-key", str(key)).maddrs
    cfg = write_config(h, inner_steps=10)
    names = ["p0", "p1", "p2"]
    ids = start_peers(h, names, boot, cfg, "--swarm-key", str(key))

    # outsiders dial the same bootstrap (and an honest peer): every DHT request they make is refused unanswered,
    # so their DHT node cannot join and the peer stops with one line instead of training beside the swarm (which
    # meanwhile trains on: their exits are checked below)
    outsiders = {"nokey": (), "wrongkey": ("--swarm-key", str(other))}
    t_spawn = time.monotonic()
    for name, extra in outsiders.items():
        h.spawn(name, "peer", "--config", cfg, "--initial-peers", boot[0], "--host-maddrs", LOOPBACK,
                "--run-dir", h.dir(name), *extra)

    h.wait_until(all_have(h, names, ok_rounds=5, partners=2), 240, "5 ok exchanges with >= 2 partners each",
                 alive=tuple(names))
    for name in outsiders:
        # gone within 120 s of their start, as when this waited right after it
        assert h.wait_exit(name, max(0.1, t_spawn + 120 - time.monotonic())) == 1, h.log(name)[-2000:]
        err = h.log(name)
        assert "could not start the DHT node" in err and "--swarm-key" in err, err[-2000:]
        assert not any(r.get("event") == "round" for r in h.metrics(name)), "an outsider trained a round"
    for n in names:
        got = ok_partners(rounds(h, n))
        assert set(got) <= set(ids.values()) - {ids[n]}, got      # nobody but the keyed peers, ever
        assert sum(got.values()) >= 5
        assert "NOT_AUTHORIZED" not in h.log(n)                   # keyed peers prove the key to each other

    # a keyed joiner downloads the state from a keyed donor: membership (a fresh listing when it is not yet in the
    # donor's), the proofs both ways and the checks of the download all pass
    start_peers(h, ["p3"], boot, cfg, "--swarm-key", str(key))
    st = start_event(h, "p3")
    assert st["joined_from"] in set(ids.values()) and st["round"] > 0, st
    assert any("state_serve" in h.log(n) and "outcome=OK" in h.log(n) for n in names)
