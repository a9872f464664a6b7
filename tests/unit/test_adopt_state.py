"""What a joiner (or a peer catching up) takes over from donors (peer/daemon.py `_adopt_swarm_state`, issue 29):
never the donor's outer state, never a round past what we believe, a state checked on batches only we know, and a
first donor cross-checked against a second. The network side is scripted: the states the donors would deliver
(the transfer and its metadata checks: tests/integration/test_state_transfer.py)."""
from __future__ import annotations

import threading

import pytest
import torch

from gasloc.peer.config import PeerConfig
from gasloc.peer.daemon import Peer
from gasloc.peer.train.data import build_data
from gasloc.peer.train.model import build_model
from gasloc.peer.train.outer import make_outer
from gasloc.protocol.guard import DistanceHistory, FarStreak

pytestmark = pytest.mark.timeout(120)


class _Net:
    """Donors in the order the network would try them: (donor, round, params)."""

    def __init__(self, donors, believed):
        self.donors, self.believed, self.asked, self.trust = list(donors), believed, [], []

    def download_state(self, params, outer, exclude=(), first=(), trust=None, stop=None):
        self.asked.append(set(exclude))
        self.trust.append(dict(trust or {}))
        for donor, rnd, state in self.donors:
            if donor not in exclude:
                return donor, {"round": rnd, "num_outer": 0, "peer_id": donor}, [t.clone() for t in state]
        return None

    def believed_rounds(self):
        return dict(self.believed)

    def round_caps(self):
        return dict(self.believed)


def _peer(donors, believed, **swarm) -> Peer:
    cfg = PeerConfig.model_validate({"model": {"preset": "tiny", "seq_len": 32}, "data": {"batch_size": 4},
                                     "swarm": swarm})
    p = Peer.__new__(Peer)
    p.cfg, p.device, p.round = cfg, torch.device("cpu"), 0
    p.data, tok = build_data(cfg.data, cfg.model.seq_len)
    p.val_batches = p.data.val_batches()
    p.model = build_model(cfg.model, tok.vocab_size, seed=0)
    p.params = list(p.model.parameters())
    p.outer = make_outer(cfg.outer, p.params)
    p.guard, p._far = DistanceHistory(cfg.guard), FarStreak(2)
    p.net = _Net(donors, believed)
    p.averaging = None
    p.stopping = threading.Event()
    return p


def _like(p: Peer, seed: int, scale: float = 0.0) -> list[torch.Tensor]:
    """The peer's own parameters, moved by `scale` x noise (relative to each tensor's size)."""
    g = torch.Generator().manual_seed(seed)
    return [t.detach().clone() + scale * t.detach().abs().mean() * torch.randn(t.shape, generator=g)
            for t in p.params]


def test_the_donors_outer_state_is_never_adopted_and_the_round_is_cut_to_what_we_believe():
    """Today a joiner loaded the donor's z_prev (an arbitrary jump at its next outer step) and its round
    (10^9 pinned the lr decay at its floor)."""
    p = _peer([], {})
    good = _like(p, 1, 0.01)
    p.net = _Net([("QmA", 10**9, good), ("QmB", 14, good)], believed={"QmA": 15, "QmB": 14})
    name = p.outer.state_names[0]                         # z_prev (form C) or y_prev: the outer momentum's
    setattr(p.outer, name, [t.detach() + 5.0 for t in p.params])   # whatever was there before: replaced
    assert p._adopt_swarm_state() == "QmA"
    assert all(torch.equal(a, b) for a, b in zip(p.params, good))
    assert all(torch.equal(z, a) for z, a in zip(getattr(p.outer, name), p.params))
    assert all(torch.equal(z, a) for z, a in zip(p.outer.anchor, p.params))
    assert p.round == 14                                 # the lower of the two checked rounds, within belief


def test_the_check_runs_on_private_batches_not_the_shared_validation_batches():
    p = _peer([], {})
    p.net = _Net([("QmA", 3, _like(p, 1, 0.01))], believed={"QmA": 3})
    seen = []
    real = p._evaluate_at

    def spy(point, batches=None):
        seen.append(batches)
        return real(point, batches)

    p._evaluate_at = spy
    assert p._adopt_swarm_state() == "QmA"
    shared = p.val_batches
    assert seen and all(b is not None for b in seen)
    assert not any(torch.equal(x, v) for b in seen for x in b for v in shared)


def test_a_far_first_donor_loses_the_cross_check_to_a_second_that_our_data_prefers():
    """A hostile first donor whose state passes the check against our own (fresh) model is found out by an honest
    second donor: far apart, and the honest state is better on our private batches."""
    p = _peer([], {})
    honest, hostile = _like(p, 1, 0.01), _like(p, 2, 0.6)
    p.net = _Net([("QmEvil", 9, hostile), ("QmGood", 9, honest)], believed={})
    # losses scripted by which state is evaluated (both pass the check against our own model's 5.5)
    p._evaluate_at = lambda point, batches=None: 5.5 if point is p.params else (
        5.4 if torch.allclose(point[0], hostile[0]) else 5.0)
    assert p._adopt_swarm_state() == "QmGood"
    assert all(torch.allclose(a, b) for a, b in zip(p.params, honest))
    assert p.net.asked == [set(), {"QmEvil"}]


def test_donors_that_agree_confirm_the_first_and_without_cross_check_one_download_is_enough():
    p = _peer([], {})
    a, b = _like(p, 1, 0.001), _like(p, 2, 0.001)
    p.net = _Net([("QmA", 4, a), ("QmB", 4, b)], believed={})
    assert p._adopt_swarm_state() == "QmA" and len(p.net.asked) == 2
    p = _peer([], {}, join_cross_check=False)
    p.net = _Net([("QmA", 4, _like(p, 1, 0.001)), ("QmB", 4, _like(p, 2, 0.001))], believed={})
    assert p._adopt_swarm_state() == "QmA" and len(p.net.asked) == 1


def test_a_state_worse_than_our_own_is_refused_and_nobody_left_means_none():
    p = _peer([], {})
    p.net = _Net([("QmNoise", 4, [torch.randn_like(t) * 10 for t in p.params])], believed={})
    before = [t.detach().clone() for t in p.params]
    assert p._adopt_swarm_state() is None
    assert all(torch.equal(a, b) for a, b in zip(p.params, before)) and p.round == 0


def test_a_diloco_joiner_takes_the_later_of_two_agreeing_states():
    """DiLoCo (one model; the round is its epoch): two donors a few epochs apart agree by distance, and the earlier
    state would leave the joiner behind at once (test_swarm_diloco: it adopted epoch 9 of a swarm at 12, then spent
    30 s rate-limited at every donor). gasloc keeps the first (its round is the lower of the two anyway)."""
    for algorithm, adopted in (("diloco", "QmLate"), ("gasloc", "QmEarly")):
        cfg = {"model": {"preset": "tiny", "seq_len": 32}, "data": {"batch_size": 4},
               "outer": {"algorithm": algorithm}}
        p = _peer([], {})
        p.cfg = PeerConfig.model_validate(cfg)
        p.outer = make_outer(p.cfg.outer, p.params)
        early, late = _like(p, 1, 0.001), _like(p, 2, 0.001)
        p.net = _Net([("QmEarly", 9, early), ("QmLate", 12, late)], believed={})
        assert p._adopt_swarm_state() == adopted, algorithm
        assert all(torch.equal(a, b) for a, b in zip(p.params, late if adopted == "QmLate" else early))
        assert p.round == (12 if algorithm == "diloco" else 9)


def test_a_fresh_joiner_takes_only_a_state_that_learned_something():
    """bench/adversary.py (2026-12-05, --repeats 3): donor-zprev serves its untouched start state as round 14 and
    was adopted 4 times, donor-tuned (fitted to the shared validation batch) once: both passed "no worse than our
    own model" because a joiner's own model is untrained. A fresh joiner now needs a state better than its own by
    guard.val_margin; a resync (a trained model) still takes one no worse by that margin."""
    p = _peer([], {})
    seed_state = [t.detach().clone() for t in p.params]
    p.net = _Net([("QmSeed", 14, seed_state)], believed={})
    assert p._adopt_swarm_state(fresh=True) is None and p.round == 0
    assert p._adopt_swarm_state() == "QmSeed"           # a resync: no worse than ours is enough
    p = _peer([], {})
    own = p._evaluate_at(p.params, None)
    trained = _like(p, 1, 0.0)
    p._evaluate_at = lambda point, batches=None: own if point is p.params else 0.6 * own
    p.net = _Net([("QmTrained", 3, trained)], believed={})
    assert p._adopt_swarm_state(fresh=True) == "QmTrained" and p.round == 3


def test_the_peers_whose_trust_our_guard_lowered_are_handed_to_the_donor_order():
    """A resync's donors were drawn from every peer alike, and CI saw an honest resync take over the state of the
    peer that offered 3x its parameters in every exchange. The peers whose trust our guard lowered (a clip or a
    rejection, not yet recovered) are handed to the network, whose donor order asks them last (pick_donors)."""
    import random
    import time
    from types import SimpleNamespace

    from gasloc.protocol.guard import TrustBook, Verdict
    from gasloc.protocol.partners import Backoff
    from gasloc.protocol.search import PartnerPolicy, SearchRules

    p = _peer([], {})
    p.net = _Net([("QmA", 3, _like(p, 1, 0.01))], believed={"QmA": 3})
    policy = PartnerPolicy(SearchRules(), Backoff(2.0, 60.0, 0.5), avoid_recent=3, rng=random.Random(0),
                           trust=TrustBook(p.cfg.guard))
    p.averaging = SimpleNamespace(policy=policy)
    now = time.monotonic()
    policy.judged("QmBad", Verdict("reject", 1.0, 0.1, 0.0), now)
    policy.judged("QmClipped", Verdict("clip", 0.15, 0.1, 0.6), now)
    policy.judged("QmFine", Verdict("accept", 0.05, 0.1), now)
    assert p._adopt_swarm_state() == "QmA"
    got = p.net.trust[0]
    assert set(got) == {"QmBad", "QmClipped"}, got        # an accepted partner keeps its full trust
    assert got["QmBad"] < p.cfg.guard.busy_below < got["QmClipped"] < 1.0


def test_a_stop_signal_gives_the_download_up_and_keeps_our_state():
    """A stop during a resync's download (CI saw one arrive during the cross-check's second download): no further
    donor is asked, and the state already checked is not adopted (one donor's word without the cross-check); our
    parameters and round stay, for the shutdown checkpoint."""
    class Stopping(_Net):
        def download_state(self, params, outer, exclude=(), first=(), trust=None, stop=None):
            assert stop is p.stopping       # the network gives the transfer itself up on it
            if len(self.asked) == stop_during:
                stop.set()                  # the signal arrives during this download, which still delivers
            return super().download_state(params, outer, exclude, first, trust)

    for stop_during in (0, 1):
        p = _peer([], {})
        p.round = 9
        own = [t.detach().clone() for t in p.params]
        good = _like(p, 1, 0.01)
        p.net = Stopping([("QmA", 14, good), ("QmB", 14, good), ("QmC", 14, good)],
                         believed={"QmA": 14, "QmB": 14, "QmC": 14})
        assert p._adopt_swarm_state() is None
        assert len(p.net.asked) == stop_during + 1                 # no donor asked after the stop
        assert all(torch.equal(a, b) for a, b in zip(p.params, own)) and p.round == 9
    p = _peer([], {})           # without a stop the same donors are adopted: the stop is what gave them up
    p.net = _Net([("QmA", 14, good), ("QmB", 14, good)], believed={"QmA": 14, "QmB": 14})
    assert p._adopt_swarm_state() == "QmA" and p.round == 14
