"""A misbehaving partner, run as a subprocess by the integration tests (so it can be kill -9'd, and so its memory is
not the receiver's). It speaks the wire protocol through the real encoder but does what a broken or hostile peer
does. Every mode prints `READY <peer_id> <maddr> <p2pd_pid> <socket> <socket>` first, then progress lines.

    partner.py respond-half NS FP NUMEL            accept an exchange, send half the payload, then trickle slowly
    partner.py initiate-half NS FP NUMEL MADDR     initiate an exchange, send half the payload, then trickle
    partner.py flood NS FP MADDR MB                declare a 1 TiB payload and push MB megabytes without waiting
    partner.py donor-half NS FP NUMEL              serve state: a valid header, half the payload, then trickle
"""
import asyncio
import ctypes
import signal
import sys

import torch
from hivemind.p2p import P2P, PeerID

from gasloc.peer.transport.channel import STREAM_ERRORS, Channel, read_header
from gasloc.peer.transport.state_transfer import _payload_digest
from gasloc.peer.transport.state_transfer import handler_name as state_handler_name
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import (
    PROTOCOL_VERSION,
    ExchangeReply,
    ExchangeRequest,
    StateReply,
    StateRequest,
    TensorSpec,
)
from gasloc.protocol.wire import encode_header, lane_segments

TRICKLE = 1 << 16


def say(*words) -> None:
    print(*words, flush=True)


async def trickle(ch: Channel, rest: memoryview) -> None:
    """Keep streaming, slowly, until killed: the partner is mid-exchange when the test kills it."""
    for off in range(0, len(rest), TRICKLE):
        await ch.write(rest[off:off + TRICKLE])
        await asyncio.sleep(0.02)
    await asyncio.Event().wait()


def exchange_name(ns: str) -> str:
    return f"{ns}::gasloc.exchange.v{PROTOCOL_VERSION}"


async def main(mode: str, ns: str, fp: str, *args: str) -> None:
    initial = [args[-2 if mode == "flood" else -1]] if mode in ("initiate-half", "flood") else None
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
    maddr = (await p2p.get_visible_maddrs())[0]
    socks = [str(p2p._daemon_listen_maddr).removeprefix("/unix"), str(p2p._client_listen_maddr).removeprefix("/unix")]
    say("READY", p2p.peer_id, maddr, p2p._child.pid, *socks)

    if mode in ("respond-half", "initiate-half", "donor-half"):
        numel = int(args[0])
        payload = torch.full((numel,), 1.5).view(torch.uint8).numpy()
        spec = (TensorSpec(shape=(numel,), dtype="float32"),)

    if mode == "respond-half":
        lanes_held = []

        async def lane_handler(info, reader, writer):     # accept every lane, never serve it
            lanes_held.append(Channel.take_over(reader, writer))

        async def handler(info, reader, writer):
            ch = Channel.take_over(reader, writer)
            request = await read_header(ch, ExchangeRequest)
            await ch.write(encode_header(ExchangeReply(protocol_version=PROTOCOL_VERSION, code=0, fingerprint=fp,
                                                       codec="float32", specs=spec, total_bytes=len(payload),
                                                       token="t" * 32)))
            _, start, end = lane_segments([len(payload)], request.streams)[0][0]   # what lane 0 carries
            half = (start + end) // 2
            await ch.write(payload[start:half])
            say("HALF")
            await trickle(ch, memoryview(payload)[half:end])
        await p2p.add_binary_stream_handler(exchange_name(ns), handler)
        await p2p.add_binary_stream_handler(f"{ns}::gasloc.exchange-lane.v{PROTOCOL_VERSION}", lane_handler)
        await asyncio.Event().wait()

    if mode == "initiate-half":
        target = PeerID.from_base58(args[-1].rsplit("/p2p/", 1)[1])
        _, reader, writer = await p2p.call_binary_stream_handler(target, exchange_name(ns))
        ch = Channel.take_over(reader, writer)
        await ch.write(encode_header(ExchangeRequest(protocol_version=PROTOCOL_VERSION, fingerprint=fp, round=1,
                                                     codec="float32", specs=spec, total_bytes=len(payload))))
        reply = await read_header(ch, ExchangeReply)
        say("REPLY", Code(reply.code).name)
        await ch.write(payload[:len(payload) // 2])
        say("HALF")
        await trickle(ch, memoryview(payload)[len(payload) // 2:])

    if mode == "flood":
        target = PeerID.from_base58(args[-2].rsplit("/p2p/", 1)[1])
        junk = bytes(1 << 20)
        _, reader, writer = await p2p.call_binary_stream_handler(target, exchange_name(ns))
        ch = Channel.take_over(reader, writer)
        await ch.write(encode_header(ExchangeRequest(protocol_version=PROTOCOL_VERSION, fingerprint=fp, round=1,
                                                     codec="float32", specs=(TensorSpec(shape=(1 << 38,),
                                                                                            dtype="float32"),),
                                                     total_bytes=1 << 40)))
        reply_task = asyncio.ensure_future(read_header(ch, ExchangeReply))
        sent = 0
        try:
            async with asyncio.timeout(20):
                for _ in range(int(args[-1])):     # ignore the answer: push everything we declared (or can)
                    await ch.write(junk)
                    sent += len(junk)
        except (TimeoutError, *STREAM_ERRORS):
            pass
        reply = await asyncio.wait_for(reply_task, 10)
        say("REPLY", Code(reply.code).name, sent)
        await asyncio.Event().wait()

    if mode == "donor-half":
        async def handler(info, reader, writer):
            ch = Channel.take_over(reader, writer)
            await read_header(ch, StateRequest)
            digest = _payload_digest([torch.full((numel,), 1.5)])
            await ch.write(encode_header(StateReply(protocol_version=PROTOCOL_VERSION, code=0, fingerprint=fp,
                                                    round=7, specs=spec, total_bytes=len(payload), sha256=digest)))
            await ch.write(payload[:len(payload) // 2])
            say("HALF")
            await trickle(ch, memoryview(payload)[len(payload) // 2:])
        await p2p.add_binary_stream_handler(state_handler_name(ns), handler)
        await asyncio.Event().wait()


if __name__ == "__main__":
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: die with the test process
    asyncio.run(main(*sys.argv[1:]))
