"""GASLoC's outer step in place (issue 31): `apply` allocates no parameter-sized tensor (it reuses the anchor's and
the momentum buffer's storage), leaves `sent` and `mixed` as they were, and gives the values of the allocating
form bit for bit, for every form and a kappa below 1."""
from __future__ import annotations

import pytest
import torch

from gasloc.peer.train.outer import OuterConfig, make_outer


def params_of(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=g), torch.randn(11, generator=g)]


def reference(form: str, kappa: float, gamma: float, eta: float, theta0, thetas, partners):
    """The allocating form of algorithm.md, written out: a list of (theta, anchor, momentum buffer) per round."""
    anchor = [t.clone() for t in theta0]
    mom = [t.clone() for t in theta0]  # z_prev (C) or y_prev (A, B)
    out = []
    for theta, partner in zip(thetas, partners):
        y = [a + eta * (t - a) for a, t in zip(anchor, theta)]
        sent = [yy + gamma * (yy - m) for yy, m in zip(y, mom)] if form == "B" else y
        z = [(s + p) / 2 for s, p in zip(sent, partner)]
        if form == "A":
            new = [zz + gamma * (yy - m) for zz, yy, m in zip(z, y, mom)]
            mom = y
        elif form == "B":
            new, mom = z, y
        else:
            new = [zz + gamma * (zz - m - (1 - kappa) * (zz - yy)) for zz, m, yy in zip(z, mom, y)]
            mom = z
        anchor = [t.clone() for t in new]
        out.append((new, mom))
    return out


@pytest.mark.parametrize("form,kappa", [("A", 1.0), ("B", 1.0), ("C", 1.0), ("C", 0.5)])
def test_apply_in_place_matches_the_allocating_form(form, kappa):
    cfg = OuterConfig(form=form, momentum=0.8, outer_lr=0.7, mix_momentum=kappa)
    theta0 = params_of(0)
    params = [t.clone() for t in theta0]
    outer = make_outer(cfg, params)
    thetas, partners = [], []
    for r in range(4):
        thetas.append([t + 0.1 * d for t, d in zip(params, params_of(10 + r))])
        partners.append(params_of(100 + r))
        for p, t in zip(params, thetas[-1]):
            p.copy_(t)
        storages = {t.untyped_storage().data_ptr() for t in [*params, *outer.anchor,
                                                             *outer.state_dict().values()]}
        sent = outer.outgoing(params)
        mixed = [(s + p) / 2 for s, p in zip(sent, partners[-1])]
        sent_before, mixed_before = [t.clone() for t in sent], [t.clone() for t in mixed]
        outer.apply(params, mixed)
        after = {t.untyped_storage().data_ptr() for t in [*params, *outer.anchor, *outer.state_dict().values()]}
        assert after == storages, "apply allocated new parameter-sized state"
        assert all(torch.equal(a, b) for a, b in zip(sent, sent_before)), "apply wrote into sent"
        assert all(torch.equal(a, b) for a, b in zip(mixed, mixed_before)), "apply wrote into mixed"
        assert all(torch.equal(p, a) for p, a in zip(params, outer.anchor))
    ref = reference(form, kappa, 0.8, 0.7, theta0, thetas, partners)
    new, mom = ref[-1]
    assert all(torch.allclose(p, n, rtol=0, atol=1e-6) for p, n in zip(params, new))
    assert all(torch.allclose(s, m, rtol=0, atol=1e-6) for s, m in zip(outer.state_dict().values(), mom))


def test_a_solo_round_may_pass_sent_as_mixed():
    cfg = OuterConfig(form="C", momentum=0.7, outer_lr=0.7)
    params = params_of(1)
    outer = make_outer(cfg, params)
    for r in range(3):
        torch._foreach_add_(params, params_of(20 + r), alpha=0.05)
        sent = outer.outgoing(params)
        y = [t.clone() for t in sent]
        outer.apply(params, sent)
        assert all(torch.equal(z, yy) for z, yy in zip(outer.z_prev, y))  # z = y in a solo round


@pytest.mark.parametrize("form,kappa", [("A", 1.0), ("B", 1.0), ("C", 1.0), ("C", 0.5)])
@pytest.mark.parametrize("solo", [False, True])
def test_y_in_the_parameters_storage_gives_the_same_bits(form, kappa, solo):
    """outgoing(params, in_place=True), the daemon's plain round: y is built in the parameters' own storage (no
    parameter-sized allocation in forms A and C), and the round's result is bit for bit the allocating path's."""
    cfg = OuterConfig(form=form, momentum=0.8, outer_lr=0.7, mix_momentum=kappa)
    a_params, b_params = params_of(2), params_of(2)
    a, b = make_outer(cfg, a_params), make_outer(cfg, b_params)
    for r in range(4):
        for ps in (a_params, b_params):
            torch._foreach_add_(ps, params_of(30 + r), alpha=0.05)
        sent_a = a.outgoing(a_params)
        sent_b = b.outgoing(b_params, in_place=True)
        assert all(torch.equal(x, y) for x, y in zip(sent_a, sent_b))
        if form != "B":  # B sends u, a new tensor; y itself is in the parameters
            assert [t.data_ptr() for t in sent_b] == [p.data_ptr() for p in b_params]
        partner = params_of(200 + r)
        mixed_a = sent_a if solo else [(s + p) / 2 for s, p in zip(sent_a, partner)]
        mixed_b = sent_b if solo else [(s + p) / 2 for s, p in zip(sent_b, partner)]
        a.apply(a_params, mixed_a)
        b.apply(b_params, mixed_b)
        assert all(torch.equal(x, y) for x, y in zip(a_params, b_params))
        assert all(torch.equal(x, y) for x, y in zip(a.anchor, b.anchor))
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("form,kappa", [("A", 1.0), ("B", 1.0), ("C", 1.0), ("C", 0.5), ("C", 0.0)])
def test_the_mix_may_land_in_the_anchors_storage_with_the_same_bits(form, kappa):
    """The daemon's plain round on a CPU peer: after outgoing(in_place=True) the anchor is idle (idle_buffers), the
    exchange decodes the partner's tensors there and the mix is written there too; apply gives the allocating
    path's bits. Nothing is idle after an allocating outgoing, nor after apply."""
    cfg = OuterConfig(form=form, momentum=0.8, outer_lr=0.7, mix_momentum=kappa)
    a_params, b_params = params_of(3), params_of(3)
    a, b = make_outer(cfg, a_params), make_outer(cfg, b_params)
    for r in range(4):
        for ps in (a_params, b_params):
            torch._foreach_add_(ps, params_of(40 + r), alpha=0.05)
        sent_a = a.outgoing(a_params)
        assert a.idle_buffers() is None
        sent_b = b.outgoing(b_params, in_place=True)
        idle = b.idle_buffers()
        assert idle is not None and [t.data_ptr() for t in idle] == [t.data_ptr() for t in b.anchor]
        partner = params_of(300 + r)
        mixed_a = [(s + p) / 2 for s, p in zip(sent_a, partner)]
        torch._foreach_copy_(idle, [(s + p) / 2 for s, p in zip(sent_b, partner)])
        a.apply(a_params, mixed_a)
        b.apply(b_params, idle)
        assert b.idle_buffers() is None
        assert all(torch.equal(x, y) for x, y in zip(a_params, b_params))
        assert all(torch.equal(x, y) for x, y in zip(a.anchor, b.anchor))
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
