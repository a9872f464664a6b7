"""peer/transport/landing.py: the partner's payload decoded as it lands. Landings are fed by hand in an order the
lanes could deliver them (a blockwise share before its tensor's scales, shares of two tensors interleaved); what
comes out must be the whole decode's values bit for bit, and a tensor is checked finite once it is whole."""
from __future__ import annotations

import asyncio

import pytest
import torch

from gasloc.peer.transport.landing import Landing
from gasloc.peer.transport.lanes import Watermark
from gasloc.peer.transport.staging import Staging
from gasloc.protocol.codec import parse
from gasloc.protocol.messages import TensorSpec

pytestmark = pytest.mark.timeout(30)


def _setup(name: str):
    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(64, 70, generator=g) * 0.02, torch.randn(300, generator=g) * 0.02]
    theirs = [t + 0.001 * torch.randn(t.shape, generator=g) for t in ours]
    codec, seed = parse(name), 99
    steps = [0.0005, 0.0005] if codec.modulo else None
    specs = [TensorSpec.of(tuple(t.shape), t.dtype) for t in ours]
    st = Staging(specs, codec)
    ref = [p.clone() for p in st.encode(ours, seed, steps)]
    payload = [p.clone() for p in Staging(specs, codec).encode(theirs, seed, steps)]
    bufs, out = st.receive_buffers(codec)
    want = [torch.empty_like(t) for t in ours]
    st.decode(codec, payload, want, seed, ours, ref if codec.modulo else None, steps)
    for o in out:
        o.fill_(float("nan"))
    return st, codec, seed, steps, ours, ref, payload, bufs, out, want


def _land(landing: Landing, bufs, payload, i: int, a: int, b: int) -> None:
    bufs[i][a:b] = payload[i][a:b]
    hooks = landing.hooks()
    if "landed" in hooks:
        hooks["landed"](i, a, b)
    elif b == payload[i].numel():
        hooks["arrived"](i)


@pytest.mark.parametrize("name", ["int8", "int4-sd", "mod4-sd"])
def test_shares_decode_as_they_land_and_a_blockwise_share_waits_for_its_scales(name):
    async def main():
        st, codec, seed, steps, ours, ref, payload, bufs, out, want = _setup(name)
        landing = Landing(st, codec, bufs, out, seed, ours, ref if codec.modulo else None, steps)
        assert set(landing.hooks()) == {"landed"}
        run = asyncio.ensure_future(landing.run())
        head = codec.range_header_bytes(ours[0].numel())
        n0, n1 = payload[0].numel(), payload[1].numel()
        mid = head + (n0 - head) // 2 + 3
        _land(landing, bufs, payload, 0, mid, n0)         # the second half of tensor 0's codes, scales not yet in
        await asyncio.sleep(0.05)
        tail = out[0].view(-1)[(mid - head) * 8 // codec.bits + 64:]
        # a modulo share needs no scales: decoded; a blockwise one waits for them
        assert bool(torch.isnan(tail).all()) != codec.modulo
        _land(landing, bufs, payload, 1, 0, n1)           # all of tensor 1 in one lane
        _land(landing, bufs, payload, 0, 0, head // 2)    # half of the scales: still waiting
        await asyncio.sleep(0.05)
        assert bool(torch.isnan(tail).all()) != codec.modulo
        _land(landing, bufs, payload, 0, head // 2, mid)  # the other half of the scales and the first half
        assert await asyncio.wait_for(run, 5) == []
        assert all(torch.equal(a, b) for a, b in zip(out, want))

    asyncio.run(main())


def test_a_tensor_is_checked_finite_once_whole_and_other_codecs_decode_each_tensor_whole():
    async def main():
        st, codec, seed, steps, ours, ref, payload, bufs, out, want = _setup("int8")
        payload[1][:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)   # the first scale an fp16 +inf
        landing = Landing(st, codec, bufs, out, seed, ours, None, steps)
        run = asyncio.ensure_future(landing.run())
        for i in (1, 0):
            _land(landing, bufs, payload, i, 0, payload[i].numel())
        assert await asyncio.wait_for(run, 5) == [1]

        st, codec, seed, steps, ours, ref, payload, bufs, out, want = _setup("int8-p50")   # sparse: no ranges
        landing = Landing(st, codec, bufs, out, seed, [o.clone() for o in ours], None, steps)
        assert set(landing.hooks()) == {"arrived"}
        run = asyncio.ensure_future(landing.run())
        _land(landing, bufs, payload, 0, 0, payload[0].numel())
        _land(landing, bufs, payload, 1, 0, payload[1].numel())
        assert await asyncio.wait_for(run, 5) == []

    asyncio.run(main())


def test_a_modulo_share_decodes_only_once_our_own_codes_of_it_are_encoded():
    """A pipelined exchange encodes our payload during the transfer, and a modulo share decodes against our codes of
    the same bytes: a share a..b waits until `ready` (the encoder's Watermark) has reached b, not the whole tensor."""
    async def main():
        st, codec, seed, steps, ours, ref, payload, bufs, out, want = _setup("mod4-sd")
        ready = [Watermark(asyncio.get_running_loop()) for _ in ours]
        landing = Landing(st, codec, bufs, out, seed, ours, ref, steps, ready=ready)
        run = asyncio.ensure_future(landing.run())
        n0, n1 = payload[0].numel(), payload[1].numel()
        mid = n0 // 2
        first = out[0].view(-1)[:mid * 8 // codec.bits]
        _land(landing, bufs, payload, 0, 0, mid)
        ready[0].advance(mid - 1)
        await asyncio.sleep(0.05)
        assert bool(torch.isnan(first).all())          # one byte of our codes short
        ready[0].advance(mid)
        await asyncio.sleep(0.05)
        assert torch.equal(first, want[0].view(-1)[:mid * 8 // codec.bits])   # decoded before the rest is encoded
        _land(landing, bufs, payload, 0, mid, n0)
        _land(landing, bufs, payload, 1, 0, n1)
        ready[0].advance(n0)
        ready[1].advance(n1)
        assert await asyncio.wait_for(run, 5) == []
        assert all(torch.equal(a, b) for a, b in zip(out, want))

    asyncio.run(main())
