"""Handlers that check who before what, over real p2pd daemons: private-swarm proofs on exchanges and state
downloads, membership before any read, the per-joiner state rate limit, and a live exchange handler fed random,
truncated and oversized frames."""
import asyncio
import random
import struct

import pytest
import torch
from p2p_helpers import arun, p2p_nodes, rss_bytes
from test_exchange import NS, SPECS, exchanger, request_frame, tensors
from test_state_transfer import FP as FP_STATE
from test_state_transfer import NS as NS_STATE
from test_state_transfer import SPECS as STATE_SPECS
from test_state_transfer import server, state

from gasloc.peer.transport.channel import Channel, read_header
from gasloc.peer.transport.exchange import Outcome
from gasloc.peer.transport.state_transfer import StateDownloadError, StateTransferConfig, download_state
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import PROTOCOL_VERSION, ExchangeReply, payload_bytes

KEY, OTHER = bytes(range(32)), bytes(range(1, 33))
PAYLOAD = payload_bytes(SPECS, "float32")


@pytest.mark.timeout(90)
def test_exchanges_need_the_swarm_key_on_both_sides():
    async def main():
        async with p2p_nodes(4) as (a, b, nokey, wrong):
            ea, eb = exchanger(a, swarm_key=KEY), exchanger(b, swarm_key=KEY)
            en, ew = exchanger(nokey), exchanger(wrong, swarm_key=OTHER)
            for e in (ea, eb, en, ew):
                await e.start()
            ta = tensors(1)
            saved = [t.clone() for t in ta]
            for e, t in ((ea, ta), (eb, tensors(2)), (en, tensors(3)), (ew, tensors(4))):
                e.offer(t, 0)
            # outsiders calling a keyed peer: refused before any payload moves either way
            for e in (en, ew):
                res = await e.exchange(a.peer_id)
                assert res.outcome is Outcome.rejected and res.code == Code.NOT_AUTHORIZED, res.log_line()
                assert res.tensors is None and res.bytes_received < 4096 and res.bytes_sent < 4096
            assert all(torch.equal(x, y) for x, y in zip(ta, saved)) and await ea.wait_incoming(0) is None
            # a keyed peer calling an outsider that accepts: our tensors never leave
            for p in (nokey, wrong):
                res = await eb.exchange(p.peer_id)
                assert res.code == Code.NOT_AUTHORIZED and res.bytes_sent < 4096, res.log_line()
            # the keyed pair still exchanges
            res = await eb.exchange(a.peer_id)
            assert res.ok and res.bytes_received >= PAYLOAD
            for e in (ea, eb, en, ew):
                await e.stop()
    arun(main(), 80)


@pytest.mark.timeout(90)
def test_state_downloads_check_membership_key_and_rate():
    async def main():
        async with p2p_nodes(4) as (donor, member, stranger, wrong):
            members = {str(member.peer_id), str(wrong.peer_id)}

            async def is_member(peer_id):
                return str(peer_id) in members

            params = state(5)
            cfg = StateTransferConfig(per_donor_timeout_s=10, accept_timeout_s=3, min_request_interval_s=60)
            s = server(donor, params, cfg=cfg, is_member=is_member, swarm_key=KEY)
            await s.start()
            with pytest.raises(StateDownloadError, match="NOT_MEMBER"):
                await download_state(stranger, [donor.peer_id], STATE_SPECS, FP_STATE, cfg, NS_STATE, swarm_key=KEY)
            with pytest.raises(StateDownloadError, match="NOT_AUTHORIZED"):
                await download_state(wrong, [donor.peer_id], STATE_SPECS, FP_STATE, cfg, NS_STATE,
                                     swarm_key=OTHER)
            with pytest.raises(StateDownloadError, match="NOT_AUTHORIZED"):
                await download_state(wrong, [donor.peer_id], STATE_SPECS, FP_STATE, cfg, NS_STATE)
            assert s.bytes_served == 0          # nobody without membership and key got a byte of state
            meta, got = await download_state(member, [donor.peer_id], STATE_SPECS, FP_STATE, cfg, NS_STATE,
                                             swarm_key=KEY)
            assert all(torch.equal(x, y) for x, y in zip(got, params))
            served = s.bytes_served
            assert served == sum(t.numel() * 4 for t in params)
            # the same joiner again within min_request_interval_s: refused, no second snapshot
            with pytest.raises(StateDownloadError, match="RATE_LIMITED"):
                await download_state(member, [donor.peer_id], STATE_SPECS, FP_STATE, cfg, NS_STATE, swarm_key=KEY)
            assert s.bytes_served == served
            await s.stop()
    arun(main(), 80)


def _frame(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    good = request_frame()
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 64))                          # noise
    if kind == 1:
        return good[:rng.randrange(1, len(good))]                            # truncated
    if kind == 2:
        return struct.pack(">I", rng.choice([1 << 20, 1 << 30, 0xFFFFFFFF])) + rng.randbytes(100)   # oversized
    if kind == 3:                                                            # one byte flipped
        i = rng.randrange(4, len(good))
        return good[:i] + bytes([good[i] ^ (1 << rng.randrange(8))]) + good[i + 1:]
    body = rng.randbytes(rng.randrange(1, 300))
    return struct.pack(">I", len(body)) + body                               # a well-framed garbage body


@pytest.mark.timeout(120)
def test_a_live_handler_answers_every_random_frame_with_a_code():
    frames = 150        # each is one p2p stream (~10 ms, a cut one 0.2 s); the decoders get 10,000+ in tests/unit

    async def main():
        async with p2p_nodes(2) as (a, b):
            ea = exchanger(a, members={str(b.peer_id)}, accept_timeout_s=0.2)
            await ea.start()
            ta = tensors(1)
            saved = [t.clone() for t in ta]
            ea.offer(ta, 0)
            rng = random.Random(11)
            rss0 = rss_bytes()
            codes: dict[str, int] = {}
            for i in range(frames):
                frame = _frame(rng)
                _, reader, writer = await b.call_binary_stream_handler(
                    a.peer_id, f"{NS}::gasloc.exchange.v{PROTOCOL_VERSION}")
                ch = Channel.take_over(reader, writer)
                try:
                    # no half-close after the frame: p2pd ends the whole stream on it, so a cut header is seen
                    # by the handler's deadline (accept_timeout_s) and answered TIMEOUT
                    await ch.write(frame)
                    try:
                        reply = await asyncio.wait_for(read_header(ch, ExchangeReply), 5)
                    except asyncio.IncompleteReadError:
                        raise AssertionError(f"frame {i} got no reply: {frame[:80]!r}") from None
                finally:
                    ch.close()
                code = Code.parse(reply.code)   # OK too: a flipped bit no check can see (in the round, say)
                codes[code.name] = codes.get(code.name, 0) + 1
            assert sum(codes.values()) == frames and {"BAD_HEADER", "TIMEOUT"} <= set(codes), codes
            assert rss_bytes() - rss0 < 64 << 20        # 4 GiB declared headers were never buffered
            assert all(torch.equal(x, y) for x, y in zip(ta, saved))
            await asyncio.sleep(0.2)
            assert not ea._handlers            # every handler task ended (none hung, none raised past its top)
            await ea.stop()
    arun(main(), 110)
