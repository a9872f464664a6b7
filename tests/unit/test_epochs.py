"""DiLoCo's epoch rules (protocol/epochs.py): which finished all-reduce a member may step with, and when it is behind."""
from __future__ import annotations

import torch

from gasloc.protocol.epochs import anchor_sample, behind, judge_group, parse_claim, sample_size, sample_stride

TOL = 1e-4


def model(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 7, generator=g), torch.randn(50, generator=g)]


def claim(tensors, epoch: int, stride: int) -> dict:
    return {"round": epoch, "anchor": anchor_sample(tensors, stride).numpy().tobytes()}


def setup(seed: int = 0):
    m = model(seed)
    stride = sample_stride([t.numel() for t in m], values=64)
    return m, stride, anchor_sample(m, stride)


def test_sample_takes_every_stride_th_value_of_each_tensor():
    m, stride, s = setup()
    assert stride == 2150 // 64
    assert s.numel() == sample_size([t.numel() for t in m], stride)
    assert torch.equal(s[:3], m[0].reshape(-1)[::stride][:3]) and s[-1] == m[1][-(50 % stride or stride)]


def test_one_model_steps_and_reports_its_spread():
    m, stride, own = setup()
    near = [t * (1 + 1e-7) for t in m]  # rounding of an all-reduce
    g = {"a": claim(m, 5, stride), "b": claim(near, 5, stride), "c": claim(m, 5, stride)}
    v = judge_group("a", 5, own, g, TOL)
    assert v.apply and v.code is None and v.agree == 3 and v.size == 3
    assert 0 < v.spread < 1e-6


def test_a_member_of_another_epoch_makes_every_member_refuse_the_mean():
    m, stride, own = setup()
    g = {"a": claim(m, 5, stride), "b": claim(m, 6, stride), "c": claim(m, 5, stride)}
    for me in ("a", "c"):
        v = judge_group(me, 5, own, g, TOL)
        assert not v.apply and v.code == "OTHER_EPOCH"


def test_a_fork_in_the_group_makes_every_member_refuse_and_only_the_fork_downloads():
    """A mean applied with a fork in the group mixes two models' pseudo-gradients, and applied to two anchors it
    keeps them apart: nobody steps; the fork (FORKED) downloads from the holders, the others try again."""
    m, stride, own = setup()
    fork = [t + 0.01 * torch.randn_like(t) for t in m]
    g = {"a": claim(m, 5, stride), "b": claim(m, 5, stride), "c": claim(fork, 5, stride)}
    for me in ("a", "b"):
        v = judge_group(me, 5, own, g, TOL)
        assert not v.apply and v.code == "OTHER_MODEL" and v.holders == ("a", "b") and v.spread > TOL
    v = judge_group("c", 5, anchor_sample(fork, stride), g, TOL)
    assert not v.apply and v.code == "FORKED" and v.agree == 1 and v.spread > TOL and v.holders == ("a", "b")


def test_a_tie_goes_to_the_half_with_the_lowest_peer_id():
    """Two lineages of two (CI, 2026-12-05: test_swarm_diloco saw an all-reduce across anchors 4.9 % apart, both
    halves stepping): the half with the lowest id holds the group's model, the other half downloads it."""
    m, stride, own = setup()
    fork = [t + 0.01 for t in m]
    g = {"a": claim(m, 5, stride), "b": claim(fork, 5, stride)}
    assert judge_group("a", 5, own, g, TOL).code == "OTHER_MODEL"
    assert judge_group("b", 5, anchor_sample(fork, stride), g, TOL).code == "FORKED"
    g4 = {"d": claim(m, 5, stride), "b": claim(fork, 5, stride), "a": claim(m, 5, stride), "c": claim(fork, 5, stride)}
    for me, tensors in (("a", m), ("d", m)):
        assert judge_group(me, 5, anchor_sample(tensors, stride), g4, TOL).code == "OTHER_MODEL"
    for me in ("b", "c"):
        v = judge_group(me, 5, anchor_sample(fork, stride), g4, TOL)
        assert v.code == "FORKED" and v.holders == ("a", "d")


def test_unreadable_claims_count_as_disagreeing():
    m, stride, own = setup()
    raw = anchor_sample(m, stride).numpy().tobytes()
    nan = torch.full((own.numel(),), float("nan")).numpy().tobytes()
    for bad in (None, 7, {"round": "5", "anchor": raw}, {"round": True, "anchor": raw}, {"round": 5},
                {"round": 5, "anchor": raw[:-4]}, {"round": 5, "anchor": nan}, {"round": 5, "anchor": "x"}):
        assert parse_claim(bad, own.numel()) is None, bad
    # garbage agrees with nobody: it cannot make us the fork, and nobody steps with a mean it took part in
    g = {"b": {"round": 5}, "c": "junk", "a": claim(m, 5, stride)}
    v = judge_group("a", 5, own, g, TOL)
    assert not v.apply and v.code == "OTHER_MODEL" and v.agree == 1 and v.spread is None and v.holders == ("a",)


def test_anchors_all_apart_leave_one_lineage_the_lowest_ids():
    """No two members agree (a tolerance below what the wire's rounding leaves, or three lineages): the lowest id's
    anchor is the group's model, everyone else downloads it, so the group becomes one model again."""
    m, stride, own = setup()
    g = {p: claim([t + 0.01 * k for t in m], 5, stride) for k, p in enumerate("abc")}
    codes = {p: judge_group(p, 5, anchor_sample([t + 0.01 * k for t in m], stride), g, TOL).code
             for k, p in enumerate("abc")}
    assert codes == {"a": "OTHER_MODEL", "b": "FORKED", "c": "FORKED"}


def test_behind_by_the_median_claim_only():
    assert behind(3, [4, 4, 3])
    assert not behind(3, [3, 3, 10**9])  # one liar
    assert not behind(3, [])
    assert not behind(3, [3, 2])
