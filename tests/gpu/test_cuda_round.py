"""One full round of `tiny` on CUDA, with the peer's own functions (issue 31 item 4): inner steps under bf16
autocast and torch.compile, outgoing, the exchange's staging (encode into pinned host buffers, the partner's payload
decoded), the guard's batch check (the model run with the partner's tensors), the in-place symmetric mix, the
in-place outer step; a checkpoint saved and loaded; and the outer step's peak within two parameter copies of what it
holds (y and the received tensors on the device): no model-sized temporaries. Skipped without CUDA (conftest.py)."""
from __future__ import annotations

import math

import pytest
import torch

from gasloc.peer.checkpoint import CheckpointConfig, load_latest, save_checkpoint
from gasloc.peer.config import PeerConfig
from gasloc.peer.train.inner import make_inner_optimizer, run_inner_phase
from gasloc.peer.train.memory import check_fit, evaluate_with
from gasloc.peer.train.model import autocast_for, build_model, maybe_compile
from gasloc.peer.train.outer import make_outer
from gasloc.peer.transport.staging import Staging
from gasloc.protocol.averaging import group_mean_weight, mix_pair_
from gasloc.protocol.codec import parse
from gasloc.protocol.messages import TensorSpec

VOCAB = 256


def cfg_for(codec: str) -> PeerConfig:
    return PeerConfig.model_validate({"model": {"preset": "tiny", "seq_len": 128, "compile": True},
                                      "data": {"batch_size": 8}, "inner": {"inner_steps": 6, "warmup_steps": 2},
                                      "exchange": {"codec": codec}, "run": {"device": "cuda"}})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("codec", ["int4", "float32"])
def test_one_full_round_of_tiny_on_cuda(codec, tmp_path):
    dev = torch.device("cuda")
    cfg = cfg_for(codec)
    fit = check_fit(cfg, VOCAB, dev, Staging)  # the start-up check: measured on the device, and it fits
    assert fit.ok and fit.measured
    model = build_model(cfg.model, VOCAB).to(dev)
    maybe_compile(model, cfg.model, dev)
    params = list(model.parameters())
    opt = make_inner_optimizer(model, cfg.inner)
    outer = make_outer(cfg.outer, params)
    partner = build_model(cfg.model, VOCAB, seed=1).to(dev)  # the partner's model, as bytes would bring it
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, VOCAB, (8, 129), generator=g) for _ in range(6)]
    it = iter(data * 2)

    steps, loss = run_inner_phase(model, opt, lambda: next(it), 0, cfg.inner, dev, autocast_for(dev))
    assert steps == 6 and math.isfinite(loss)
    assert all(p.grad is None for p in params)  # freed with the phase

    sent = outer.outgoing(params)
    assert all(t.is_cuda for t in sent)
    codec_ = parse(codec)
    ours = Staging([TensorSpec.of(tuple(t.shape), t.dtype) for t in sent], codec_)
    payload = ours.encode(sent, seed=0)  # device -> pinned host
    assert all(not p.is_cuda for p in payload)
    own_wire = ours.own_wire(payload, sent, seed=0)
    theirs = Staging([TensorSpec.of(tuple(t.shape), t.dtype) for t in sent], codec_)
    their_payload = theirs.encode(list(partner.parameters()), seed=0)
    bufs, out = ours.receive_buffers(codec_)
    for b, p in zip(bufs, their_payload):
        b.copy_(p.reshape(b.shape))
    assert ours.decode(codec_, bufs, out, 0, None) == []  # all finite

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    received = [t.to(dev, non_blocking=True) for t in out]
    wire = None if own_wire is None else [t.to(dev, non_blocking=True) for t in own_wire]
    batch = data[:1]
    own_loss = evaluate_with(model, sent if wire is None else wire, batch, autocast_for(dev))  # the guard's check
    their_loss = evaluate_with(model, received, batch, autocast_for(dev))
    assert math.isfinite(own_loss) and math.isfinite(their_loss)
    mixed = mix_pair_(received, sent, wire, group_mean_weight(1))
    outer.apply(params, mixed)
    torch.cuda.synchronize()
    n4 = 4 * sum(p.numel() for p in params)
    extra = torch.cuda.max_memory_allocated(dev) - base
    held = (2 if wire is None else 3) * n4  # received (and our wire form) on the device, plus y already counted
    assert extra <= held + 64 * 2**20, (extra / n4, "parameter copies above the round's own state")
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.equal(p, a) for p, a in zip(params, outer.anchor))

    ck = CheckpointConfig(dir=tmp_path)
    save_checkpoint(ck, model=model, inner_opt=opt, outer=outer, data_state={}, round=1, meta={},
                    fingerprint="gpu-test")
    fresh = build_model(cfg.model, VOCAB, seed=5).to(dev)
    fresh_opt = make_inner_optimizer(fresh, cfg.inner)
    fresh_outer = make_outer(cfg.outer, list(fresh.parameters()))
    loaded = load_latest(ck, model=fresh, inner_opt=fresh_opt, outer=fresh_outer, fingerprint="gpu-test")
    assert loaded is not None and loaded.round == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(fresh_outer.state_dict().values(), outer.state_dict().values()))
    # a second round from the loaded state trains on (the compiled model, the fused AdamW state)
    steps, loss2 = run_inner_phase(model, opt, lambda: next(it), 6, cfg.inner, dev, autocast_for(dev))
    assert steps == 6 and math.isfinite(loss2)


@pytest.mark.timeout(300)
def test_a_round_that_does_not_fit_the_device_is_refused():
    """The start-up check on CUDA: a memory budget below the round's need is refused in one line (simulated by
    asking for a preset and batch far larger than the device's free memory)."""
    from gasloc.peer.train.memory import DoesNotFit

    cfg = PeerConfig.model_validate({"model": {"preset": "1b", "seq_len": 65536}, "data": {"batch_size": 64},
                                     "run": {"device": "cuda"}})
    with pytest.raises(DoesNotFit) as e:
        check_fit(cfg, 128_000, torch.device("cuda"))
    assert "\n" not in str(e.value) and "fits" in str(e.value) and "free on" in str(e.value)
