"""Joining mid-run: state download from donors over real p2pd daemons, with dying and lying donors."""
import asyncio
import contextlib
import time

import pytest
import torch
from p2p_helpers import Partner, arun, p2p_nodes

from gasloc.peer.transport.channel import Channel, read_header
from gasloc.peer.transport.state_transfer import (
    StateDownloadError,
    StateServer,
    StateTransferConfig,
    download_state,
    handler_name,
)
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import PROTOCOL_VERSION, StateReply, StateRequest, TensorSpec, fingerprint, payload_bytes
from gasloc.protocol.wire import encode_header

NS = "stest"
FP = fingerprint(preset="test", seq_len=16)
SHAPES = [(200, 300), (50,), ()]
SPECS = [(s, torch.float32) for s in SHAPES]


def state(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


async def anyone(peer_id) -> bool:
    return True


def server(p2p, tensors, metadata=None, fp=FP, cfg=None, is_member=anyone, swarm_key=None):
    meta = {"round": 12, "run": "r1"} if metadata is None else metadata
    # no rate limit unless a test asks for one: several tests download from one donor in a row
    return StateServer(p2p, lambda: (dict(meta), [t.clone() for t in tensors]), fp, NS,
                       cfg or StateTransferConfig(min_request_interval_s=0), is_member=is_member,
                       swarm_key=swarm_key)


CFG = StateTransferConfig(per_donor_timeout_s=10, accept_timeout_s=3)


@pytest.mark.timeout(60)
def test_download_params_and_outer_state_bit_exact():
    async def main():
        async with p2p_nodes(3) as (donor, plain_donor, joiner):
            params, outer = state(1), state(2, [(200, 300)])
            s1 = server(donor, params + outer, {"round": 12, "num_outer": 1})
            s2 = server(plain_donor, params)
            await s1.start(), await s2.start()
            meta, got = await download_state(joiner, [donor.peer_id], SPECS, FP, CFG, NS,
                                             outer_specs=[((200, 300), torch.float32)])
            assert meta["round"] == 12 and meta["num_outer"] == 1 and len(got) == 4
            assert all(torch.equal(x, y) for x, y in zip(got, params + outer))
            # a joiner that wants outer state accepts a donor without it, and one that does not want it refuses it
            meta, got = await download_state(joiner, [plain_donor.peer_id], SPECS, FP, CFG, NS,
                                             outer_specs=[((200, 300), torch.float32)])
            assert meta["num_outer"] == 0 and meta["run"] == "r1" and len(got) == 3
            with pytest.raises(StateDownloadError, match="BAD_SHAPE"):
                await download_state(joiner, [donor.peer_id], SPECS, FP, CFG, NS)
            await s1.stop(), await s2.stop()
    arun(main())


@pytest.mark.timeout(60)
def test_donor_killed_mid_transfer_falls_back_to_next_donor():
    numel = 4_000_000
    shapes = [(numel,)]

    async def main():
        async with Partner("donor-half", NS, FP, numel) as bad:
            async with p2p_nodes(2, initial_peers=[bad.maddr]) as (good, joiner):
                params = state(3, shapes)
                s = server(good, params)
                await s.start()
                async def kill_at_half():
                    await bad.expect("HALF")
                    bad.kill()
                killer = asyncio.ensure_future(kill_at_half())
                t0 = time.monotonic()
                meta, got = await download_state(joiner, [bad.peer_id, good.peer_id], [(shapes[0], torch.float32)],
                                                 FP, CFG, NS)
                await killer
                assert time.monotonic() - t0 < 8
                assert torch.equal(got[0], params[0]) and meta["round"] == 12
                await s.stop()
    arun(main())


@pytest.mark.timeout(60)
def test_corrupt_checksum_nan_and_wrong_fingerprint_rejected():
    async def main():
        async with p2p_nodes(5) as (liar, nan_donor, stranger, good, joiner):
            params = state(4)
            payload = [t.clone() for t in params]
            specs = tuple(TensorSpec.of(t.shape, t.dtype) for t in payload)

            async def lying_donor(info, reader, writer):      # correct header and bytes, wrong checksum
                ch = Channel.take_over(reader, writer)
                await read_header(ch, StateRequest)
                await ch.write(encode_header(StateReply(protocol_version=PROTOCOL_VERSION, code=0, fingerprint=FP,
                                                        round=3, specs=specs, total_bytes=payload_bytes(specs),
                                                        sha256="ab" * 32)))
                for t in payload:
                    await ch.write(t.reshape(-1).view(torch.uint8).numpy())
                await ch.readexactly(1)
                ch.close()

            await liar.add_binary_stream_handler(handler_name(NS), lying_donor)
            bad = state(5)
            bad[1][3] = float("inf")
            servers = [server(nan_donor, bad), server(stranger, params, fp="other"), server(good, params)]
            for s in servers:
                await s.start()
            for donor, code in [(liar, "BAD_CHECKSUM"), (nan_donor, "NOT_FINITE"), (stranger, "BAD_FINGERPRINT")]:
                with pytest.raises(StateDownloadError, match=code):
                    await download_state(joiner, [donor.peer_id], SPECS, FP, CFG, NS)
            meta, got = await download_state(joiner, [liar.peer_id, nan_donor.peer_id, stranger.peer_id,
                                                      good.peer_id], SPECS, FP, CFG, NS)
            assert all(torch.equal(x, y) for x, y in zip(got, params))
            with pytest.raises(StateDownloadError, match="no donors given"):
                await download_state(joiner, [], SPECS, FP, CFG, NS)
            for s in servers:
                await s.stop()
    arun(main())


@pytest.mark.timeout(60)
def test_a_donor_without_a_snapshot_answers_busy_and_the_joiner_asks_again():
    """The daemon takes a joiner's snapshot only at its next round boundary (peer/swarm/network.py): a request that
    comes before it gets BUSY, and the joiner asks that donor again instead of giving up."""
    async def main():
        async with p2p_nodes(2) as (donor, joiner):
            params = state(3)
            asked = []
            boundary = asyncio.Event()

            async def get_state():
                asked.append(time.monotonic())
                if len(asked) == 1:
                    return None           # the boundary is not reached within the wait: BUSY
                await boundary.wait()     # the next request waits for the boundary, which comes
                return {"round": 4}, [t.clone() for t in params]

            s = StateServer(donor, get_state, FP, NS, is_member=anyone)  # default rate limit: a BUSY is no download
            await s.start()
            asyncio.get_running_loop().call_later(0.8, boundary.set)
            meta, got = await download_state(joiner, [donor.peer_id], SPECS, FP, CFG, NS)
            assert meta["round"] == 4 and all(torch.equal(x, y) for x, y in zip(got, params))
            assert len(asked) == 2 and asked[1] - asked[0] >= 0.4  # asked again after the BUSY pause
            await s.stop()
    arun(main())


@pytest.mark.timeout(90)
def test_a_donor_lying_in_its_metadata_is_a_status_code_and_the_next_donor_serves():
    """Issue 29: a donor's metadata is a claim. A round of "soon" (the joiner raised ValueError and the peer
    exited), -7, a float, a round contradicting the header, another peer's id: each is a code for that donor, and
    the joiner goes on to the next. The donor's id the joiner reports is the stream's, never the metadata's."""
    async def main():
        async with p2p_nodes(3) as (liar, good, joiner):
            params = state(6)
            specs = tuple(TensorSpec.of(t.shape, t.dtype) for t in params)
            digest = __import__("hashlib").sha256(b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                                           for t in params)).hexdigest()
            lies = [({"round": "soon"}, 3, "BAD_HEADER"), ({"round": -7}, 3, "BAD_HEADER"),
                    ({"round": 3.0}, 3, "BAD_HEADER"), ({"round": 10**9}, 3, "BAD_HEADER"),
                    ({"num_outer": "x"}, 3, "BAD_HEADER"), ({"round": True}, 1, "BAD_HEADER"),
                    ({"peer_id": good.peer_id.to_base58()}, 3, "DISTRUSTED"), ({"peer_id": None}, 3, "DISTRUSTED")]
            queue = list(lies)

            async def lying_donor(info, reader, writer):
                ch = Channel.take_over(reader, writer)
                await read_header(ch, StateRequest)
                meta, rnd, _ = queue.pop(0)
                await ch.write(encode_header(StateReply(protocol_version=PROTOCOL_VERSION, code=0, fingerprint=FP,
                                                        round=rnd, metadata=meta, specs=specs,
                                                        total_bytes=payload_bytes(specs), sha256=digest)))
                for t in params:
                    await ch.write(t.reshape(-1).view(torch.uint8).numpy())
                with contextlib.suppress(Exception):
                    await ch.readexactly(1)
                ch.close()

            await liar.add_binary_stream_handler(handler_name(NS), lying_donor)
            s = server(good, params, {"round": 12, "peer_id": liar.peer_id.to_base58(), "run": "r1"})
            for _, _, code in lies:
                with pytest.raises(StateDownloadError, match=code):
                    await download_state(joiner, [liar.peer_id], SPECS, FP, CFG, NS)
            # the good donor's own metadata names another peer: refused too
            await s.start()
            with pytest.raises(StateDownloadError, match="DISTRUSTED"):
                await download_state(joiner, [good.peer_id], SPECS, FP, CFG, NS)
            await s.stop()
            honest = server(good, params, {"round": 12, "run": "r1"})     # no peer_id: the stream says who
            await honest.start()
            # consistent, but past what the joiner believes of this donor: refused before the payload
            with pytest.raises(StateDownloadError, match="DISTRUSTED"):
                await download_state(joiner, [good.peer_id], SPECS, FP, CFG, NS,
                                     round_caps={good.peer_id.to_base58(): 11})
            # consistent and believable, but its record announced round 1012 (a ready-liar): refused the same way
            with pytest.raises(StateDownloadError, match="record claims round 1012"):
                await download_state(joiner, [good.peer_id], SPECS, FP, CFG, NS,
                                     listed_rounds={good.peer_id.to_base58(): 1012})
            queue.append(({"round": "soon"}, 3, ""))
            meta, got = await download_state(joiner, [liar.peer_id, good.peer_id], SPECS, FP, CFG, NS)
            assert meta["peer_id"] == good.peer_id.to_base58() and meta["round"] == 12
            assert all(torch.equal(x, y) for x, y in zip(got, params))
            await honest.stop()
    arun(main())


# The payload's deadline (payload_deadline_s): accept_timeout_s + its size at min_rate_mbit; 256 Mbit/s puts a 128 MB
# state's at 3 + 4 s, shorter than the partner's trickle takes (64 KiB per 20 ms after the first half: ~20 s)
SLOW_CFG = StateTransferConfig(accept_timeout_s=3, min_rate_mbit=256, min_request_interval_s=0)
BIG = 32_000_000


@pytest.mark.timeout(120)
def test_a_trickling_donor_is_given_up_at_its_payloads_deadline_for_the_next():
    """A donor that sends half of its state, then trickles it (an attacker who read a fixed 120-s per-donor deadline:
    every joiner that picked it failed its whole join) is skipped once its payload is late, with no per-donor cap
    set; before, its valid state arrived whole, late, and was taken."""
    shapes = [(BIG,)]

    async def main():
        async with Partner("donor-half", NS, FP, BIG) as bad:
            async with p2p_nodes(2, initial_peers=[bad.maddr]) as (good, joiner):
                params = state(3, shapes)
                s = server(good, params, cfg=SLOW_CFG)
                await s.start()
                t0 = time.monotonic()
                meta, got = await download_state(joiner, [bad.peer_id, good.peer_id], [(shapes[0], torch.float32)],
                                                 FP, SLOW_CFG, NS)
                took = time.monotonic() - t0
                assert meta["round"] == 12 and torch.equal(got[0], params[0])   # the good donor's (the bad one: 7)
                assert took < 60, took
                await s.stop()
    arun(main())


@pytest.mark.timeout(120)
def test_a_joiner_that_stops_reading_frees_the_donors_slot_at_the_payloads_deadline():
    """A donor serves one joiner at a time (the others: BUSY). A joiner that takes the header and then reads nothing
    held that slot until the per-donor deadline (120 s, or for good with none); now it holds it until the payload's
    deadline, and the next joiner (asking again on BUSY) is served. Asking again at once, the staller is
    RATE_LIMITED: the interval (5 s) counts from the end of its serve, not from its first byte, which its payload's
    deadline (3 + 4 s) had left behind, so it cannot take the slot back to back."""
    shapes = [(BIG,)]
    cfg = SLOW_CFG.model_copy(update={"min_request_interval_s": 5.0})

    async def ask(node, donor) -> tuple[Channel, StateReply]:
        _, reader, writer = await node.call_binary_stream_handler(donor, handler_name(NS))
        ch = Channel.take_over(reader, writer)
        await ch.write(encode_header(StateRequest(protocol_version=PROTOCOL_VERSION, fingerprint=FP)))
        return ch, await read_header(ch, StateReply)

    async def main():
        async with p2p_nodes(3) as (donor, slow, joiner):
            params = state(4, shapes)
            s = server(donor, params, cfg=cfg)
            await s.start()
            ch, reply = await ask(slow, donor.peer_id)
            assert reply.code == 0 and reply.total_bytes == payload_bytes(reply.specs)     # served: and never read
            t0 = time.monotonic()
            async with asyncio.timeout(60):
                meta, got = await download_state(joiner, [donor.peer_id], [(shapes[0], torch.float32)], FP, cfg, NS)
            took = time.monotonic() - t0
            assert torch.equal(got[0], params[0]) and meta["round"] == 12
            assert took > 2, took    # it was BUSY while the slow joiner held the slot
            ch.close()
            again, reply = await ask(slow, donor.peer_id)
            assert reply.code == Code.RATE_LIMITED, reply
            again.close()
            await s.stop()
    arun(main())
