"""The live partner search weighs peers by what we measured, never by what their records claim."""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

from gasloc.peer.config import PeerConfig
from gasloc.peer.swarm.gossip import GossipAveraging
from gasloc.peer.swarm.membership import PeerRecord
from gasloc.protocol.partners import Backoff, pick_partner


def _record(pid: str, bandwidth_bps: float) -> PeerRecord:
    return PeerRecord(peer_id=pid, protocol=1, fingerprint="f", state="exchanging", round=3, throughput_tps=1.0,
                      bandwidth_bps=bandwidth_bps, time=time.time())


class _Net:
    def __init__(self, live):
        self.live = live

    def ready_peers(self):
        return {p for p, r in self.live.items() if r.state == "exchanging"}

    def in_sight(self):
        return set(self.live)   # no peer-exchange hints here: the records are the whole view

    def ready_at(self, now):
        return {}  # nobody training: every peer here announces "exchanging"

    def entered_at(self, now):
        return {}  # no "no free offer" answers here to lift

    def uncallable(self):
        return set()  # everyone is directly reachable here (NAT: protocol/reach.py)


class _Exchanger:
    engaged = None

    def __init__(self, rates):
        self.rates = rates

    def rate(self, peer):
        return self.rates.get(peer, 0.0)


def _sight(claimed_by_sybil: float, rates: dict[str, float]):
    cfg = PeerConfig.model_validate({"swarm": {"bandwidth_weighting": True}})
    g = GossipAveraging(cfg, _Net({p: _record(p, claimed_by_sybil if p == "sybil" else 1e6)
                                   for p in ("sybil", "h1", "h2")}), stopping=threading.Event(),
                        set_state=lambda s: None)
    g.exchanger = _Exchanger(rates)
    return g._sight(None)


def _shares(ready, n=3000) -> Counter:
    rng, b = random.Random(0), Backoff(1.0, 5.0, 0.5)
    return Counter(pick_partner(ready, b, 0.0, rng, weighted=True) for _ in range(n))


def test_a_record_claiming_1e30_bytes_per_second_does_not_change_partner_choice():
    measured = {"h1": 40e6, "h2": 20e6}           # nobody has exchanged with the sybil yet
    honest, lying = _sight(0.0, measured), _sight(1e30, measured)
    assert lying.ready == honest.ready == {"sybil": 0.0, "h1": 40e6, "h2": 20e6}
    assert _shares(lying.ready) == _shares(honest.ready)   # the same draws, pick for pick
    # the sybil is weighted like any unmeasured newcomer (the median of the measured rates): about a third
    assert 0.25 < _shares(lying.ready)["sybil"] / 3000 < 0.42


def test_what_we_measured_is_what_weighs():
    s = _sight(1e30, {"sybil": 1e3, "h1": 40e6, "h2": 40e6})   # we exchanged with it: its link is slow
    shares = _shares(s.ready)
    assert shares["sybil"] < 30 and shares["h1"] > 1300
