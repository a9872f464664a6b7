"""The live peer applies the mix decision (peer/daemon.py `_mixed`, `_judge`; protocol/decision.py): per-tensor clip
scales in the in-place mix, an echo rejected, the trust change in the one trust book the partner search reads, no
outer momentum on a stranger's correction, and the batch check on a batch only this peer knows. The network side
is a stand-in: the tensors an ok exchange would hand over."""
from __future__ import annotations

import random

import pytest
import torch

from gasloc.peer.config import PeerConfig
from gasloc.peer.daemon import Peer, _momentum
from gasloc.peer.swarm.round_report import RoundExchange
from gasloc.peer.train.data import build_data
from gasloc.peer.train.model import build_model
from gasloc.peer.train.outer import make_outer, round_mix_momentum_applied
from gasloc.protocol.codec import exchange_mix_momentum, exchange_mix_weight
from gasloc.protocol.codec import parse as parse_codec
from gasloc.protocol.decision import MixJudge
from gasloc.protocol.guard import TrustBook
from gasloc.protocol.partners import Backoff
from gasloc.protocol.search import PartnerPolicy, SearchRules

pytestmark = pytest.mark.timeout(120)


class _Net:
    live: dict = {}

    def believed_rounds(self):
        return {}


class _Averaging:
    def __init__(self, cfg):
        self.policy = PartnerPolicy(SearchRules(), Backoff(2.0, 60.0, 0.5), avoid_recent=0, rng=random.Random(0),
                                    trust=TrustBook(cfg.guard))


def _peer(**sections) -> Peer:
    cfg = PeerConfig.model_validate({"model": {"preset": "tiny", "seq_len": 32}, "data": {"batch_size": 2}, **sections})
    p = Peer.__new__(Peer)
    p.cfg, p.device, p.round, p.peer_id, p._catch_up = cfg, torch.device("cpu"), 10, "me", None
    p.data, tok = build_data(cfg.data, cfg.model.seq_len)
    p.val_batches = p.data.val_batches()
    p.model = build_model(cfg.model, tok.vocab_size, seed=0)
    p.params = list(p.model.parameters())
    p.outer = make_outer(cfg.outer, p.params)
    p.guard = MixJudge(cfg.guard, seed=1)
    p._far = p.guard.streak
    p.net, p.averaging = _Net(), _Averaging(cfg)
    return p


def _near(own, seed: int, rel: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in own:
        n = torch.randn(t.shape, generator=g)
        out.append(t + rel * float(t.norm()) / float(n.norm()) * n)
    return out


def _ex(partner: str, theirs, round_: int = 10) -> RoundExchange:
    return RoundExchange(outcome="ok", partner=partner, received=[t.clone() for t in theirs], offer_round=round_,
                         partner_round=round_)


def test_the_daemon_mixes_by_the_decisions_per_tensor_scales_and_keeps_trust_in_the_search(monkeypatch):
    p = _peer()
    own = [t.detach().clone() for t in p.params]
    drawn = []
    import gasloc.peer.daemon as daemon
    real = daemon.private_batches
    monkeypatch.setattr(daemon, "private_batches", lambda data, n: drawn.append(n) or real(data, n))
    for k, partner in enumerate(("a", "b", "c", "a", "b", "c")):  # honest partners: votes
        mixed, _ = p._mixed(own, _ex(partner, _near(own, k, 0.02)))
        assert mixed is not None
    assert drawn == [1] * 6  # every offer checked on a private batch, not only the suspicious ones
    # a partner sending everything the whole budget allows in one tensor (the token embedding)
    tau = p.guard.tau()
    theirs = [t.clone() for t in own]
    push = torch.randn(theirs[0].shape, generator=torch.Generator().manual_seed(9))
    theirs[0] += 0.9 * tau * (sum(float(t.norm()) ** 2 for t in own) ** 0.5) * push / float(push.norm())
    ex = _ex("x", theirs)
    mixed, _ = p._mixed(own, ex)
    # in tiny the embedding holds ~1% of ||y||^2: the whole budget there is ~10x its own tau_k, far: rejected
    assert mixed is None and ex.outcome == "rejected" and "tensor 0" in ex.detail, ex.detail
    assert ex.guard["guard"] == "reject" and ex.guard["partner_trust"] < p.cfg.guard.busy_below
    # a quarter of it: clipped to the tensor's own tau_k, the other tensors mixed as they are
    theirs[0] = own[0] + 0.25 * (theirs[0] - own[0])
    ex = _ex("z", theirs)
    mixed, _ = p._mixed(own, ex)
    moved = float((mixed[0] - own[0]).norm()) / float((theirs[0] - own[0]).norm())
    assert moved < 0.5 * 0.5, moved  # the pair mean would move it half way; its own tau_k keeps it below
    assert all(torch.equal(m, t) for m, t in zip(mixed[1:], own[1:]))  # equal tensors: the mean is ours
    assert ex.guard["guard"] == "clip" and ex.guard["partner_trust"] < 1.0
    assert p.averaging.policy.trust.score("x", 1e9) <= 1.0


def test_an_echo_is_rejected_and_a_strangers_correction_gets_no_momentum():
    p = _peer()
    own = [t.detach().clone() for t in p.params]
    for k, partner in enumerate(("a", "b", "c")):
        p._mixed(own, _ex(partner, _near(own, k, 0.02)))
    echo = _ex("e", own)
    mixed, _ = p._mixed(own, echo)
    assert mixed is None and echo.outcome == "rejected" and "echo" in echo.detail
    first = _ex("n", _near(own, 7, 0.02))
    p._mixed(own, first)
    assert first.guard["momentum"] is False and not _momentum(first)
    assert _momentum(RoundExchange(outcome="solo"))  # nothing judged: nothing to withhold


def test_a_rounds_kappa_applies_to_that_apply_alone():
    params = [torch.zeros(3)]
    cfg = PeerConfig.model_validate({}).outer.model_copy(update={"momentum": 0.7, "outer_lr": 1.0})
    runs = {}
    for kappa in (1.0, 0.5, 0.0):
        o, ps = make_outer(cfg, params), [t.clone() for t in params]
        ps[0] += 0.1
        sent = o.outgoing(ps)
        with round_mix_momentum_applied(o, kappa):
            o.apply(ps, [sent[0] + 1.0])
        runs[kappa] = float(ps[0][0])
        assert o.cfg.mix_momentum is None and o.cfg.kappa == 1.0  # restored
    # form C: theta = z + gamma (z - z_prev - (1 - kappa)(z - y)); z = 1.1, y = 0.1, z_prev = 0
    assert runs[1.0] == pytest.approx(1.1 + 0.7 * 1.1)
    assert runs[0.5] == pytest.approx(1.1 + 0.7 * 0.6)
    assert runs[0.0] == pytest.approx(1.1 + 0.7 * 0.1)


@pytest.mark.parametrize("codec,sent,received,configured,kappa", [
    ("mod4-sd", "mod4-sd", "mod4-sd", None, 0.5), ("int8", "int8", "int8", None, 1.0),
    ("mod4-sd", "int8", "int8", None, 1.0), ("mod4-sd", "mod4-sd", "mod4-sd", 0.2, 0.2),
    ("mod4-sd", "mod4-sd", "mod4-sd", 1.0, 1.0)])
def test_the_daemons_round_kappa_is_the_exchanges_unless_one_is_configured(codec, sent, received, configured, kappa):
    # mod4-sd (the default) carries half of a mix's correction on (protocol/codec.py Codec.mix_momentum,
    # docs/codecs.md J) where both sides sent it; a fallback exchange, and every other codec, all of it (the form as
    # published): both sides alike; a configured outer.mix_momentum wins, and a partner we barely know gets none
    p = _peer(exchange={"codec": codec}, outer={"mix_momentum": configured})
    ex = _ex("a", [t.detach().clone() for t in p.params])
    ex.mix_momentum = exchange_mix_momentum(parse_codec(sent), parse_codec(received))   # as the exchanger reports it
    assert p._kappa(ex) == kappa
    ex.guard = {"momentum": False}
    assert p._kappa(ex) == 0.0


@pytest.mark.parametrize("codec,sent,received,configured,pull", [
    ("mod4-sd", "mod4-sd", "mod4-sd", None, 0.4), ("int8", "int8", "int8", None, 0.5),
    ("mod4-sd", "int8", "int8", None, 0.5), ("mod4-sd", "int8", "float32", None, 0.5),
    ("mod4-sd", "mod4-sd", "mod4-sd", 0.3, 0.3)])
def test_the_daemon_mixes_with_the_exchanges_weight_unless_one_is_configured(codec, sent, received, configured, pull):
    # mod4-sd (the default) pulls by its own 0.4 (protocol/codec.py Codec.mix_weight, docs/codecs.md G) where both
    # sides sent it; the other codecs, and a modulo peer's fallback for a partner of another codec, by the pair's
    # mean, whatever our configured codec: both sides must pull alike; a configured outer.mix_weight wins
    # (protocol/averaging.py pair_weight)
    p = _peer(exchange={"codec": codec}, outer={"mix_weight": configured})
    own = [t.detach().clone() for t in p.params]
    theirs = _near(own, 3, 0.005)
    ex = _ex("a", theirs)
    ex.mix_weight = exchange_mix_weight(parse_codec(sent), parse_codec(received))   # as the exchanger reports it
    mixed, _ = p._mixed(own, ex)
    assert mixed is not None and ex.guard["guard"] == "accept", ex.guard
    moved = sum(float(((m - o) * (t - o)).sum()) for m, o, t in zip(mixed, own, theirs))
    apart = sum(float((t - o).square().sum()) for o, t in zip(own, theirs))
    assert moved / apart == pytest.approx(pull, rel=1e-4)
