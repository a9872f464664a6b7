"""Outer updates against hand-written references (algorithm.md). Pure tensor math, no I/O."""
import random

import pytest
import torch

from gasloc.peer.train.outer import OuterConfig, make_outer
from gasloc.protocol.averaging import exact_mean, mix

SHAPES = [(5, 3), (7,), (2, 2, 2)]


def fresh_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def fake_inner(params, worker, rnd, scale=0.1):
    """A deterministic stand-in for H AdamW steps: a worker- and round-dependent drift."""
    g = torch.Generator().manual_seed(1000 * rnd + worker)
    for p in params:
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale - 0.05 * p)


def run_complete(cfg, k=4, rounds=25):
    """k workers, every round mixing with the exact mean of all (the complete topology)."""
    workers = [fresh_params() for _ in range(k)]
    outers = [make_outer(cfg, w) for w in workers]
    for r in range(rounds):
        for i, w in enumerate(workers):
            fake_inner(w, i, r)
        sent = [o.outgoing(w) for o, w in zip(outers, workers)]
        mean = exact_mean(sent)
        for o, w in zip(outers, workers):
            o.apply(w, mean)
    return workers


def diloco_reference(eta, gamma, k=4, rounds=25, inner=fake_inner):
    """DiLoCo by hand: torch.optim.SGD(nesterov) on the mean pseudo-gradient, workers restart from x each round."""
    x = [p.clone().requires_grad_(True) for p in fresh_params()]
    opt = torch.optim.SGD(x, lr=eta, momentum=gamma, nesterov=True)
    for r in range(rounds):
        deltas = []
        for i in range(k):
            local = [p.detach().clone() for p in x]
            inner(local, i, r)
            deltas.append([a.detach() - b for a, b in zip(x, local)])
        for p, *ds in zip(x, *deltas):
            p.grad = torch.stack(ds).mean(0)
        opt.step()
    return [p.detach() for p in x]


@pytest.mark.parametrize("form", ["B", "C"])
@pytest.mark.parametrize("eta,gamma", [(0.7, 0.9), (1.0, 0.5), (0.3, 0.2)])
def test_gasloc_forms_b_c_equal_diloco_on_complete_graph(form, eta, gamma):
    ref = diloco_reference(eta, gamma)
    for w in run_complete(OuterConfig(algorithm="gasloc", form=form, outer_lr=eta, momentum=gamma)):
        for a, b in zip(w, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_diloco_class_equals_torch_sgd_nesterov():
    ref = diloco_reference(0.7, 0.9)
    for w in run_complete(OuterConfig(algorithm="diloco")):
        for a, b in zip(w, ref):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_form_a_keeps_the_mean_on_diloco_path_but_workers_drift_apart():
    ref = diloco_reference(0.7, 0.9, rounds=10)
    workers = run_complete(OuterConfig(form="A", momentum=0.9), rounds=10)
    mean = exact_mean(workers)
    for a, b in zip(mean, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert max(float((w[0] - workers[0][0]).norm()) for w in workers) > 1e-3


def test_pairwise_mixing_preserves_the_mean():
    xs = [fresh_params(s) for s in range(4)]
    before = exact_mean(xs)
    pairs = {0: 2, 2: 0, 1: 3, 3: 1}
    after = [mix(xs[i], [xs[pairs[i]]]) for i in range(4)]
    for a, b in zip(exact_mean(after), before):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # w = 1/3 with two partners: the uniform mean of three; symmetric weights keep the mean too
    z = mix(xs[0], [xs[1], xs[2]])
    for a, b in zip(z, exact_mean(xs[:3])):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_mix_rejects_weights_that_leave_no_convex_combination():
    xs = [fresh_params(s) for s in range(3)]
    with pytest.raises(ValueError, match="convex"):
        mix(xs[0], [xs[1], xs[2]], weight=0.6)


def test_gamma0_eta1_h1_equals_gossip_adamw():
    """GASLoC(gamma=0, eta=1) with one AdamW step per round == D-PSGD-style gossip-AdamW written by hand."""
    torch.manual_seed(0)
    k, rounds = 4, 12
    data = [torch.randn(16, 3) for _ in range(k)]

    def make():
        torch.manual_seed(1)
        ms = [torch.nn.Linear(3, 1) for _ in range(k)]
        for m in ms[1:]:
            m.load_state_dict(ms[0].state_dict())
        return ms, [torch.optim.AdamW(m.parameters(), lr=0.05) for m in ms]

    def step(m, opt, x):
        opt.zero_grad()
        (m(x) ** 2).mean().backward()
        opt.step()

    rng = random.Random(0)
    matchings = [rng.sample(range(k), k) for _ in range(rounds)]
    gas, gopts = make()
    ref, ropts = make()
    outers = [make_outer(OuterConfig(algorithm="gossip"), list(m.parameters())) for m in gas]
    for r in range(rounds):
        order = matchings[r]
        partner = {order[0]: order[1], order[1]: order[0], order[2]: order[3], order[3]: order[2]}
        for i in range(k):
            step(gas[i], gopts[i], data[i])
            step(ref[i], ropts[i], data[i])
        sent = [o.outgoing(list(m.parameters())) for o, m in zip(outers, gas)]
        for i in range(k):
            outers[i].apply(list(gas[i].parameters()), mix(sent[i], [sent[partner[i]]]))
        with torch.no_grad():  # the reference: plain pairwise averaging after the local step
            snap = [[p.clone() for p in m.parameters()] for m in ref]
            for i in range(k):
                for p, a, b in zip(ref[i].parameters(), snap[i], snap[partner[i]]):
                    p.copy_((a + b) / 2)
    for a, b in zip(gas, ref):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.mark.parametrize("form", ["A", "B", "C"])
def test_solo_round_applies_only_the_momentum(form):
    eta, gamma = 0.7, 0.9
    p = fresh_params()
    o = make_outer(OuterConfig(form=form, outer_lr=eta, momentum=gamma), p)
    # round 1, solo: prev = theta_0, so theta_1 = y_1 + gamma (y_1 - theta_0)
    theta0 = [t.clone() for t in p]
    fake_inner(p, 0, 0)
    y1 = [a + eta * (b - a) for a, b in zip(theta0, p)]
    o.apply(p, o.outgoing(p))
    for got, y, t0 in zip(p, y1, theta0):
        torch.testing.assert_close(got, y + gamma * (y - t0), atol=1e-12, rtol=0)
    # round 2, solo: the step is y_2 plus gamma times the difference to the previous round's point
    theta1 = [t.clone() for t in p]
    fake_inner(p, 0, 1)
    y2 = [a + eta * (b - a) for a, b in zip(theta1, p)]
    o.apply(p, o.outgoing(p))
    for got, y, yp in zip(p, y2, y1):
        torch.testing.assert_close(got, y + gamma * (y - yp), atol=1e-12, rtol=0)


@pytest.mark.parametrize("algorithm", ["gasloc", "diloco", "noloco", "gossip"])
def test_identical_workers_stay_identical(algorithm):
    workers = [fresh_params() for _ in range(4)]
    outers = [make_outer(OuterConfig(algorithm=algorithm), w) for w in workers]
    for r in range(10):
        for w in workers:
            fake_inner(w, 0, r)  # the same drift for everyone
        sent = [o.outgoing(w) for o, w in zip(outers, workers)]
        for i, (o, w) in enumerate(zip(outers, workers)):
            o.apply(w, mix(sent[i], [sent[(i + 1) % 4]]) if algorithm != "diloco" else exact_mean(sent))
    for w in workers[1:]:
        for a, b in zip(w, workers[0]):
            assert torch.equal(a, b)


def test_noloco_update_by_hand():
    beta, eta = 0.5, 0.7
    a, b = fresh_params(1), fresh_params(2)
    oa, ob = make_outer(OuterConfig(algorithm="noloco"), a), make_outer(OuterConfig(algorithm="noloco"), b)
    phi_a, phi_b = [t.clone() for t in a], [t.clone() for t in b]
    fake_inner(a, 0, 0)
    fake_inner(b, 1, 0)
    sa, sb = oa.outgoing(a), ob.outgoing(b)
    theta_a = [t.clone() for t in a]
    oa.apply(a, mix(sa, [sb]))
    for got, pa, pb, ta, tb in zip(a, phi_a, phi_b, theta_a, b):
        delta_bar = ((ta - pa) + (tb - pb)) / 2
        m = eta * delta_bar + eta * ((pa + pb) / 2 - pa)  # beta * 0 on the first round
        torch.testing.assert_close(got, pa + m, atol=1e-12, rtol=0)
    assert beta == oa.gamma


def test_local_sends_nothing_and_changes_nothing():
    p = fresh_params()
    o = make_outer(OuterConfig(algorithm="local"), p)
    fake_inner(p, 0, 0)
    before = [t.clone() for t in p]
    assert o.outgoing(p) == []
    o.apply(p, [])
    assert all(torch.equal(a, b) for a, b in zip(p, before))


@pytest.mark.parametrize("algorithm,form", [("gasloc", "A"), ("gasloc", "C"), ("diloco", "C"), ("noloco", "C")])
def test_state_dict_round_trip_continues_identically(algorithm, form):
    cfg = OuterConfig(algorithm=algorithm, form=form)
    p = fresh_params()
    o = make_outer(cfg, p)
    for r in range(3):
        fake_inner(p, 0, r)
        o.apply(p, o.outgoing(p))
    q = [t.clone() for t in p]
    o2 = make_outer(cfg, q)
    o2.load_state_dict({k: v.clone() for k, v in o.state_dict().items()}, q)
    for r in range(3, 6):
        fake_inner(p, 0, r)
        fake_inner(q, 0, r)
        o.apply(p, o.outgoing(p))
        o2.apply(q, o2.outgoing(q))
    assert all(torch.equal(a, b) for a, b in zip(p, q))


def test_gossip_rejects_other_hyperparameters():
    with pytest.raises(ValueError, match="gossip"):
        OuterConfig(algorithm="gossip", momentum=0.9)


def shift_inner(params, worker, rnd, scale=0.1):
    """An inner phase whose displacement does not depend on where it starts: delayed mixing is then exact."""
    g = torch.Generator().manual_seed(7000 * rnd + worker)
    for p in params:
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _pairs_run(form, overlap, k=5, rounds=12, correct=True, kappa=1.0):
    """k workers (one odd one out: a solo round) on random pairs; with `overlap` each round is applied as solo and
    its mix one round later (OuterUpdate.late_mix), flushed after the last round."""
    cfg = OuterConfig(form=form, momentum=0.9, mix_momentum=kappa)
    workers = [fresh_params() for _ in range(k)]
    outers = [make_outer(cfg, w) for w in workers]
    rng = random.Random(3)
    pending = [None] * k
    for r in range(rounds):
        for i, w in enumerate(workers):
            shift_inner(w, i, r)
            if overlap and correct and pending[i] is not None:
                outers[i].late_mix(w, *pending[i])
        sent = [o.outgoing(w) for o, w in zip(outers, workers)]
        order = rng.sample(range(k), k)
        partner = {a: b for a, b in zip(order[0::2], order[1::2])} | {b: a for a, b in zip(order[0::2], order[1::2])}
        mixed = [mix(sent[i], [sent[partner[i]]]) if i in partner else sent[i] for i in range(k)]
        for i, (o, w) in enumerate(zip(outers, workers)):
            o.apply(w, sent[i] if overlap else mixed[i])
            pending[i] = (sent[i], mixed[i])
    if overlap and correct:
        for i, w in enumerate(workers):
            outers[i].late_mix(w, *pending[i])
    return workers


@pytest.mark.parametrize("form,kappa", [("A", 1.0), ("B", 1.0), ("C", 1.0), ("C", 0.0), ("C", 0.4)])
def test_overlap_equals_undelayed_mixing_when_the_inner_phase_does_not_depend_on_its_start(form, kappa):
    ref = _pairs_run(form, overlap=False, kappa=kappa)
    got = _pairs_run(form, overlap=True, kappa=kappa)
    for wr, wg in zip(ref, got):
        for a, b in zip(wr, wg):
            torch.testing.assert_close(b, a, atol=1e-9, rtol=0)
    # without the late correction the run is a swarm of solo workers: far from the mixed one
    solo = _pairs_run(form, overlap=True, correct=False, kappa=kappa)
    assert max(float((a - b).abs().max()) for wr, ws in zip(ref, solo) for a, b in zip(wr, ws)) > 1e-2


def test_overlap_is_rejected_where_it_is_not_defined():
    for algorithm in ("diloco", "noloco", "local"):
        with pytest.raises(ValueError, match="overlap"):
            OuterConfig(algorithm=algorithm, overlap=True)


def test_mix_momentum_one_round_by_hand():
    """theta = z + gamma (z - z_prev - (1 - kappa)(z - y)): kappa of the mixing correction z - y enters momentum."""
    eta, gamma, kappa = 0.7, 0.9, 0.25
    cfg = OuterConfig(outer_lr=eta, momentum=gamma, mix_momentum=kappa)
    a, b = fresh_params(1), fresh_params(2)
    oa, ob = make_outer(cfg, a), make_outer(cfg, b)
    theta0 = [t.clone() for t in a]
    fake_inner(a, 0, 0)
    fake_inner(b, 1, 0)
    ya, yb = oa.outgoing(a), ob.outgoing(b)
    z = mix(ya, [yb])
    oa.apply(a, z)
    for got, zi, yi, t0 in zip(a, z, ya, theta0):
        torch.testing.assert_close(got, zi + gamma * (zi - t0 - (1 - kappa) * (zi - yi)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kappa", [0.0, 0.5, 1.0])
def test_every_mix_momentum_keeps_the_swarm_mean_on_diloco_path(kappa):
    """Pairwise mixing with solo rounds (k odd): the corrections z - y sum to zero, so the workers' mean follows
    Nesterov SGD on the mean pseudo-gradient whatever kappa is."""
    k, rounds = 5, 12
    ref = diloco_reference(0.7, 0.9, k=k, rounds=rounds, inner=shift_inner)
    workers = _pairs_run("C", overlap=False, k=k, rounds=rounds, kappa=kappa)
    for got, want in zip(exact_mean(workers), ref):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)


def test_mix_momentum_zero_applies_the_correction_once():
    """Against the same worker in a solo round, a mix moves it by (1 + gamma kappa)(z - y): once for kappa = 0 (its
    momentum holds only its own progress), 1.9x for kappa = 1 (form C)."""
    for kappa in (0.0, 1.0):
        cfg = OuterConfig(momentum=0.9, mix_momentum=kappa)
        me, partner, solo = fresh_params(1), fresh_params(2), fresh_params(1)
        o_me, o_partner, o_solo = make_outer(cfg, me), make_outer(cfg, partner), make_outer(cfg, solo)
        for w, i in ((me, 0), (partner, 1), (solo, 0)):
            shift_inner(w, i, 0)
        y, y_partner = o_me.outgoing(me), o_partner.outgoing(partner)
        z = mix(y, [y_partner])
        o_me.apply(me, z)
        o_solo.apply(solo, o_solo.outgoing(solo))
        for m, s, zi, yi in zip(me, solo, z, y):
            torch.testing.assert_close(m - s, (1 + 0.9 * kappa) * (zi - yi), atol=1e-12, rtol=0)


def test_defaults_gasloc_gamma_07_baselines_as_published():
    assert (OuterConfig().eta, OuterConfig().gamma) == (0.7, 0.7)
    assert (OuterConfig(algorithm="diloco").eta, OuterConfig(algorithm="diloco").gamma) == (0.7, 0.9)
    assert (OuterConfig(algorithm="noloco").eta, OuterConfig(algorithm="noloco").gamma) == (0.7, 0.5)


def test_mix_momentum_is_rejected_where_it_is_not_defined():
    for kwargs in ({"algorithm": "diloco"}, {"form": "A"}, {"form": "B"}, {"algorithm": "gossip"}):
        with pytest.raises(ValueError, match="mix_momentum"):
            OuterConfig(mix_momentum=0.5, **kwargs)
    # unset: the form as published, or the exchange's codec's own (protocol/averaging.py round_mix_momentum)
    assert OuterConfig(algorithm="diloco").mix_momentum is None and OuterConfig(algorithm="diloco").kappa == 1.0
    assert OuterConfig(form="A", mix_momentum=1.0).kappa == 1.0   # the form as published, stated: allowed
