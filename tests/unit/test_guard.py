"""Robust mixing (protocol/guard.py) against hand-written references, and the trust score in the partner search
(protocol/search.py) on a virtual clock."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from gasloc.protocol.averaging import mix
from gasloc.protocol.codes import Code
from gasloc.protocol.guard import (
    DistanceHistory,
    FarStreak,
    GuardConfig,
    TrustBook,
    Verdict,
    catch_up_due,
    clip_toward,
    relative_distance,
    swarm_ahead,
)
from gasloc.protocol.partners import Backoff
from gasloc.protocol.search import Call, PartnerPolicy, SearchRules, Sight

CFG = GuardConfig(clip_factor=3.0, reject_factor=4.0, history=4, min_history=3, first_rounds_tau=0.3)


def history(*values: float, cfg: GuardConfig = CFG) -> DistanceHistory:
    h = DistanceHistory(cfg)
    for v in values:
        h.record(Verdict("accept", v, 1.0))
    return h


def test_first_rounds_use_the_fixed_tau_then_k_times_the_median_of_our_own_history():
    h = history()
    assert h.tau() == 0.3
    h = history(0.1, 0.05)
    assert h.tau() == 0.3  # 2 < min_history: still the first-rounds rule (a fresh joiner too)
    h = history(0.1, 0.05, 0.07)
    assert h.tau() == pytest.approx(3 * 0.07)
    h = history(0.1, 0.05, 0.07, 0.2, 0.06)  # window of 4: 0.05, 0.07, 0.2, 0.06 -> median 0.065
    assert h.tau() == pytest.approx(3 * 0.065)
    h.clear()
    assert h.tau() == 0.3
    assert history(0.0, 0.0, 0.0).tau() == CFG.min_tau


def test_verdicts_accept_check_clip_reject_by_hand():
    h = history(0.1, 0.1, 0.1)  # tau = 0.3, reject beyond 1.2
    assert h.judge(0.3) == Verdict("accept", 0.3, pytest.approx(0.3))
    v = h.judge(0.6)
    assert v.action == "check" and v.scale == pytest.approx(0.5)
    assert h.after_check(v, own_loss=2.0, partner_loss=2.1).action == "clip"  # within 10% of ours
    bad = h.after_check(v, own_loss=2.0, partner_loss=2.3)
    assert bad.rejected and bad.code is Code.DISTRUSTED and bad.scale == 0.0 and bad.by_check
    broken = h.after_check(v, own_loss=2.0, partner_loss=math.nan)
    assert broken.rejected and not broken.by_check
    far = h.judge(1.3)
    assert far.rejected and far.code is Code.DISTRUSTED
    assert h.judge(math.inf).code is Code.NOT_FINITE
    unchecked = DistanceHistory(CFG.model_copy(update={"val_check": False}))
    assert unchecked.judge(0.5).action == "clip"


def test_the_current_partner_never_moves_its_own_tau_and_rejections_are_not_remembered():
    h = history(0.1, 0.1, 0.1)
    h.record(h.judge(5.0))  # rejected: not in the history
    assert list(h.values) == [0.1, 0.1, 0.1]
    h.record(Verdict("clip", 0.9, 0.3, 1 / 3))  # clipped: remembered at its tau, not its distance
    assert list(h.values)[-1] == 0.3


def test_clip_toward_and_mix_match_a_hand_computed_reference():
    own = [torch.tensor([1.0, 0.0]), torch.tensor([[2.0]])]
    theirs = [torch.tensor([4.0, 4.0]), torch.tensor([[2.0]])]
    # distance: ||(3, 4, 0)|| / ||(1, 0, 2)|| = 5 / sqrt(5)
    assert relative_distance(own, theirs) == pytest.approx(5 / math.sqrt(5))
    clipped = clip_toward(own, theirs, 0.2)  # own + 0.2 * (3, 4, 0)
    assert torch.equal(clipped[0], torch.tensor([1.6, 0.8])) and torch.equal(clipped[1], torch.tensor([[2.0]]))
    z = mix(own, [clipped], 0.5)  # the pair mean with the clipped partner: own + 0.1 * (3, 4, 0)
    assert torch.allclose(z[0], torch.tensor([1.3, 0.4]))
    assert clip_toward(own, theirs, 1.0)[0] is theirs[0]  # accepted: the partner's tensors as they are
    # a clipped partner moves us at most w * tau * ||own||
    tau = 0.3
    v = history(0.1, 0.1, 0.1).judge(relative_distance(own, theirs))
    assert v.rejected  # 2.24 > 4 x 0.3
    moved = relative_distance(own, mix(own, [clip_toward(own, theirs, tau / relative_distance(own, theirs))], 0.5))
    assert moved == pytest.approx(0.5 * tau)


def test_trust_drops_with_offenses_and_recovers_with_its_half_life():
    cfg = GuardConfig(clip_penalty=0.3, reject_penalty=0.6, trust_half_life_s=100.0, busy_below=0.5)
    t = TrustBook(cfg)
    assert t.score("a", 0.0) == 1.0
    assert t.penalize("a", Verdict("accept", 0.1, 0.3), 0.0) == 1.0
    assert t.penalize("a", Verdict("clip", 0.5, 0.3, 0.6), 0.0) == pytest.approx(0.7)
    assert not t.distrusted("a", 0.0)
    assert t.penalize("a", Verdict("reject", 5, 0.3, 0.0), 0.0) == pytest.approx(0.28)
    assert t.distrusted("a", 0.0)
    # 1 - trust halves every 100 s: 0.72 -> 0.36 (trust 0.64) after 100 s
    assert t.score("a", 100.0) == pytest.approx(1 - 0.36)
    assert not t.distrusted("a", 100.0)
    t.forget_recovered(100.0)
    assert "a" in t._lost
    t.forget_recovered(10_000.0)
    assert "a" not in t._lost


def _policy(trust: TrustBook | None, seed: int = 0) -> PartnerPolicy:
    return PartnerPolicy(SearchRules(), Backoff(2.0, 60.0, 0.5), avoid_recent=0, rng=random.Random(seed),
                         trust=trust)


def test_a_distrusted_peer_is_not_called_and_is_answered_busy_until_it_recovers():
    cfg = GuardConfig(trust_half_life_s=100.0, busy_below=0.5)
    p = _policy(TrustBook(cfg))
    p.judged("bad", Verdict("reject", 5, 0.3, 0.0), now=0.0)  # trust 0.4
    seen = Sight(live={"bad", "good"}, ready={"bad": 1.0})
    assert not isinstance(p.begin(0.0).next(seen, 1.0), Call)
    assert p.distrusted("bad", 1.0, live={"bad", "good"})
    # 0.6 of distrust decays to below 0.5 after 100 * log2(0.6 / 0.5) = 26.3 s
    assert p.distrusted("bad", 26.0) and not p.distrusted("bad", 27.0)
    assert p.begin(30.0).next(seen, 30.0) == Call("bad")


def test_the_only_partner_is_never_turned_away_for_distrust():
    """A 2-peer swarm: turning the other peer away only makes solo rounds (the guard still judges its tensors)."""
    p = _policy(TrustBook(GuardConfig(trust_half_life_s=100.0, busy_below=0.5)))
    p.judged("other", Verdict("reject", 5, 0.3, 0.0), now=0.0)  # trust 0.4
    assert p.distrusted("other", 1.0) and not p.distrusted("other", 1.0, live={"other"})
    assert p.begin(0.0).next(Sight(live={"other"}, ready={"other": 1.0}), 1.0) == Call("other")
    # a second peer in sight that is distrusted too leaves nobody to turn to: both stay callable
    p.judged("third", Verdict("reject", 5, 0.3, 0.0), now=0.0)
    assert not p.distrusted("other", 1.0, live={"other", "third"})


def test_trust_lowers_a_clipped_peers_chance_to_be_picked():
    cfg = GuardConfig(clip_penalty=0.5, trust_half_life_s=1e9, busy_below=0.1)
    trust = TrustBook(cfg)
    trust.penalize("c", Verdict("clip", 0.5, 0.3, 0.6), 0.0)  # trust 0.5: half the weight of a and b
    p = _policy(trust, seed=1)
    seen = Sight(live={"a", "b", "c"}, ready={"a": 1.0, "b": 1.0, "c": 1.0})
    picks = Counter(p.begin(0.0).next(seen, 0.0).peer for _ in range(5000))
    assert picks["c"] / 5000 == pytest.approx(0.5 / 2.5, abs=0.02)
    assert picks["a"] / 5000 == pytest.approx(1 / 2.5, abs=0.03)
    # without a trust book every peer is as likely
    p0 = _policy(None, seed=1)
    picks0 = Counter(p0.begin(0.0).next(seen, 0.0).peer for _ in range(5000))
    assert picks0["c"] / 5000 == pytest.approx(1 / 3, abs=0.03)
    assert p0.judged("c", Verdict("reject", 5, 0.3, 0.0), 0.0) == 1.0 and not p0.distrusted("c", 0.0)


def test_guard_config_checks_its_orders():
    with pytest.raises(ValueError, match="min_history"):
        GuardConfig(history=2, min_history=3)


FAR = Verdict("reject", 0.9, 0.1, 0.0, Code.DISTRUSTED, "far")
NAN = Verdict("reject", math.nan, 0.1, 0.0, Code.NOT_FINITE, "nan")
CLIP = Verdict("clip", 0.3, 0.1, 1 / 3)
OK = Verdict("accept", 0.05, 0.1)


def _due(v, streak, *, own_round=10, own_id="m", partner="a", partner_round=10, listed=(10, 10, 11),
         better=False, behind=3):
    streak.note(v, partner, partner_round)
    return catch_up_due(v, own_round=own_round, own_id=own_id, partner_round=partner_round,
                        listed_rounds=listed, streak=streak, behind_rounds=behind, partner_better=better)


def test_swarm_ahead_is_the_listed_median_past_ours_by_more_than_the_margin():
    assert swarm_ahead(10, [14, 14, 2], 3) and not swarm_ahead(10, [13, 13, 40], 3)
    assert not swarm_ahead(10, [11, 12, 10**9], 3)  # one liar claiming round 1e9 moves the median by one peer
    assert not swarm_ahead(10, [], 3) and not swarm_ahead(0, [50], 0)  # nobody listed; 0 turns it off


def test_a_far_partner_with_the_swarm_well_ahead_of_us_says_we_are_behind():
    swarm = (30, 31, 29)  # resumed from round 10 while the swarm went on to round 30
    assert _due(FAR, FarStreak(2), partner_round=30, listed=swarm) == "behind"  # rejected (it rejects us too)
    # checked on our batch, clipped and clearly better than our model: also behind
    assert _due(CLIP, FarStreak(2), partner_round=30, listed=swarm, better=True) == "behind"
    # one far partner claiming a high round, the listed median not past us: it decides nothing
    assert _due(FAR, FarStreak(2), partner_round=10**9, listed=(10, 11, 10**9)) is None
    # a merely clipped partner, the swarm many rounds ahead (a peer on a slow link lags the fast ones): keep mixing
    assert _due(CLIP, FarStreak(2), partner_round=30, listed=swarm) is None
    # accepted, or a partner with NaN values (broken, not a sign that we drifted): nothing
    assert _due(OK, FarStreak(2), partner_round=30, listed=swarm) is None
    assert _due(NAN, FarStreak(2), partner_round=30, listed=swarm) is None
    assert _due(FAR, FarStreak(2), partner_round=30, behind=0, listed=swarm) is None  # 0 turns it off


def test_far_from_two_different_partners_in_a_row_makes_us_the_odd_one_out():
    s = FarStreak(2)
    assert _due(FAR, s, partner="a") is None  # one far partner: it may be the hostile one
    assert _due(FAR, s, partner="b") == "odd one out"
    s = FarStreak(2)
    _due(FAR, s, partner="a")
    assert _due(OK, s, partner="b") is None and s.partners == []  # an accepted partner ends the streak
    assert _due(FAR, s, partner="a") is None and _due(FAR, s, partner="a") is None  # the same one again and again
    s = FarStreak(2)
    _due(FAR, s, partner="a")
    assert _due(NAN, s, partner="b") is None and s.partners == []
    assert _due(FAR, FarStreak(0), partner="a") is None  # need 0: never


def test_a_split_two_peer_swarm_moves_exactly_one_peer():
    """Two honest peers that drifted apart reject each other for good (each rejection is a solo round): with one
    other peer listed, only the one behind in (round, peer id) downloads the other's state."""
    for rounds in ((20, 20), (20, 21), (21, 20)):
        moved = []
        for me, other, r_me, r_other in (("m", "q", *rounds), ("q", "m", *reversed(rounds))):
            s = FarStreak(2)
            verdicts = [_due(FAR, s, own_round=r_me, own_id=me, partner=other, partner_round=r_other,
                             listed=(r_other,)) for _ in range(2)]
            assert verdicts[0] is None
            moved.append(verdicts[1] == "odd one out")
        assert sum(moved) == 1, (rounds, moved)
        assert moved[0] == ((rounds[1], "q") > (rounds[0], "m"))
    # with more peers listed, the same partner twice is no reason (it is the odd one: trust handles it)
    s = FarStreak(2)
    assert [_due(FAR, s, own_round=20, partner="q", partner_round=21, listed=(21, 20)) for _ in range(2)] == [None, None]


def test_before_min_history_a_far_partner_is_rejected_on_distance_against_the_first_rounds_tau():
    h = history(0.1)  # one distance known: tau is first_rounds_tau 0.3, the reject bound 1.2
    assert h.judge(2.0).rejected and h.judge(2.0).code is Code.DISTRUSTED  # the noisy volunteer measured 1.9-2.6
    assert h.judge(0.6).action == "check"


def test_clips_alone_never_make_a_peer_busy_a_rejection_does():
    cfg = GuardConfig(clip_penalty=0.3, reject_penalty=0.6, trust_half_life_s=1e9, busy_below=0.5)
    t = TrustBook(cfg)
    clip = Verdict("clip", 0.5, 0.3, 0.6)
    scores = [t.penalize("h", clip, 0.0) for _ in range(4)]
    assert scores == pytest.approx([0.7, 0.5, 0.5, 0.5]) and not t.distrusted("h", 0.0)
    assert t.penalize("h", Verdict("reject", 5, 0.3, 0.0), 0.0) == pytest.approx(0.2) and t.distrusted("h", 0.0)
    assert t.penalize("h", clip, 0.0) == pytest.approx(0.2)  # already below: a clip does not lift it either


def test_a_rejection_by_the_batch_check_alone_makes_a_peer_busy_only_when_repeated():
    cfg = GuardConfig(clip_penalty=0.3, reject_penalty=0.6, trust_half_life_s=120.0, busy_below=0.5)
    h, t = history(0.1, 0.1, 0.1), TrustBook(cfg)                  # tau 0.3: 0.6 is near, checked
    worse = h.after_check(h.judge(0.6), own_loss=2.0, partner_loss=2.3)
    assert worse.rejected and t.penalize("h", worse, 0.0) == pytest.approx(0.7) and not t.distrusted("h", 0.0)
    assert t.penalize("h", worse, 5.0) < 0.5 and t.distrusted("h", 5.0)           # again 5 s later: BUSY
    late = TrustBook(cfg)
    late.penalize("h", worse, 0.0)
    assert late.penalize("h", worse, 60.0) >= 0.5                                 # a minute later: not yet
    assert late.penalize("h", worse, 120.0) < 0.5                                 # a third, a minute after that
    # far (by distance) or broken (a loss that is not finite): BUSY at once, as before
    for v in (h.judge(1.3), h.after_check(h.judge(0.6), own_loss=2.0, partner_loss=math.inf)):
        assert TrustBook(cfg).penalize("x", v, 0.0) == pytest.approx(0.4)
