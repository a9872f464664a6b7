"""The hostile bias modes of the test fault injector (peer/fault.py): an offer that sits where the attacker means it
to, under the tau its own guard sees, along its gradients or one fixed direction, optionally in one tensor."""
from __future__ import annotations

import math

import pytest
import torch

from gasloc.peer.config import FaultConfig
from gasloc.peer.fault import guard_seen, make_fault
from gasloc.protocol.guard import DistanceHistory, GuardConfig, relative_distance

pytestmark = pytest.mark.timeout(60)


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 8, generator=gen)), torch.nn.Parameter(torch.ones(8)),
            torch.nn.Parameter(torch.randn(8, 8, generator=gen))]


def _step(fault, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    fault.after_step(1)


def test_uphill_offer_sits_at_bias_share_of_tau_along_the_summed_gradients():
    params = _params()
    fault = make_fault(FaultConfig(bias="uphill", bias_share=0.9), params, seen=lambda: (0.2, 0.1))
    g1 = [torch.randn_like(p) for p in params]
    g2 = [torch.randn_like(p) for p in params]
    _step(fault, params, g1)
    _step(fault, params, g2)
    sent = [p.detach().clone() for p in params]
    offer = fault.wire(sent)
    # sqrt((0.9 x 0.2)^2 - 0.1^2) = 0.1497 of ||y||: with the honest 0.1 on top, 0.18 = 0.9 tau
    assert relative_distance(sent, offer) == pytest.approx(math.sqrt(0.18 ** 2 - 0.1 ** 2), rel=1e-4)
    bias = torch.cat([(o - s).flatten() for o, s in zip(offer, sent)])
    summed = torch.cat([(a + b).flatten() for a, b in zip(g1, g2)])
    assert torch.nn.functional.cosine_similarity(bias, summed, dim=0) > 0.9999   # uphill: along +gradient
    assert all(torch.equal(s, p.detach()) for s, p in zip(sent, params))          # we keep (and mix) the true y


def test_one_tensor_bias_and_fixed_direction_shared_by_sybils():
    params = _params()
    one = make_fault(FaultConfig(bias="uphill", bias_tensor=2), params, seen=lambda: (0.2, None))
    _step(one, params, [torch.randn_like(p) for p in params])
    sent = [p.detach().clone() for p in params]
    offer = one.wire(sent)
    assert torch.equal(offer[0], sent[0]) and torch.equal(offer[1], sent[1]) and not torch.equal(offer[2], sent[2])
    assert relative_distance(sent, offer) == pytest.approx(0.18, rel=1e-4)
    # two Sybils with one bias_seed push the same way, round after round
    a = make_fault(FaultConfig(bias="fixed", bias_seed=7), params, seen=lambda: (0.2, None))
    b = make_fault(FaultConfig(bias="fixed", bias_seed=7), params, seen=lambda: (0.1, None))
    da = torch.cat([(o - s).flatten() for o, s in zip(a.wire(sent), sent)])
    db = torch.cat([(o - s).flatten() for o, s in zip(b.wire(sent), sent)])
    assert torch.nn.functional.cosine_similarity(da, db, dim=0) > 0.9999


def test_no_room_under_tau_means_an_honest_offer():
    params = _params()
    fault = make_fault(FaultConfig(bias="fixed"), params, seen=lambda: (0.2, 0.25))  # partners already past tau
    sent = [p.detach().clone() for p in params]
    assert all(torch.equal(o, s) for o, s in zip(fault.wire(sent), sent))


def test_guard_seen_reads_the_peer_guard():
    h = DistanceHistory(GuardConfig(min_history=3, clip_factor=2.0))
    assert guard_seen(h) == (h.cfg.first_rounds_tau, None)
    for d in (0.05, 0.07, 0.06):
        h.values.append(d)
    assert guard_seen(h) == (pytest.approx(0.12), pytest.approx(0.06))


def test_a_fork_moves_the_model_and_its_anchor_alike_once():
    """fork_at_round: the model parts from its group's (tests/e2e/test_swarm_diloco.py), its pseudo-gradient does
    not (anchor and parameters move by the same shift), and it happens once per process."""
    params = _params()
    anchor = [p.detach().clone() + 0.5 for p in params]
    before = [p.detach().clone() for p in params], [a.clone() for a in anchor]
    fault = make_fault(FaultConfig(fork_at_round=2, fork_scale=0.05), params, anchor=lambda: anchor)
    fault.after_step(1)
    assert all(torch.equal(p, b) for p, b in zip(params, before[0]))
    fault.after_step(2)
    for p, a, p0, a0 in zip(params, anchor, *before):
        assert torch.allclose(p - p0, a - a0, atol=1e-6)  # one shift (float32 rounding of either sum apart)
        rms = p0.pow(2).mean().sqrt()
        assert 0.02 * rms < (p - p0).pow(2).mean().sqrt() < 0.1 * rms
    moved = [p.detach().clone() for p in params]
    fault.after_step(2)
    fault.after_step(3)
    assert all(torch.equal(p, m) for p, m in zip(params, moved))
    # a state download took the peer from round 2 past round 3: it forks in the next round it trains (6 here)
    late = make_fault(FaultConfig(fork_at_round=3, fork_scale=0.05), params, anchor=lambda: anchor)
    late.after_step(2)
    assert all(torch.equal(p, m) for p, m in zip(params, moved))
    late.after_step(6)
    assert not any(torch.equal(p, m) for p, m in zip(params, moved))
