"""Parallel streams ("lanes") for one exchange, and the full-duplex byte mover over them.

Why lanes: p2pd multiplexes streams over one connection with yamux, whose per-stream flow-control window starts at
256 KiB. When both directions are busy, window updates queue behind data, so one stream stalls on links with deep
queues or long round trips (measured: 0.7x raw TCP on a 100 Mbit tbf link, 0.95x with 32 lanes). The control
stream of an exchange is lane 0; the initiator opens lanes 1..n-1 to the responder's lane handler after the OK
reply, each presenting the reply's token. The responder accepts a lane only from the same authenticated peer, with
a token it issued, at an index it expects, once.

`move` sends our payload and receives the partner's at once over all lanes, each lane carrying the same
contiguous share of both payloads (protocol.wire.lane_segments), straight from and into preallocated tensors.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from gasloc.peer.transport.channel import STREAM_ERRORS, Channel, read_header
from gasloc.peer.transport.tensor_io import byte_view
from gasloc.protocol.messages import PROTOCOL_VERSION, LaneHello
from gasloc.protocol.wire import SMALL_HEADER_BYTES, WireError, encode_header, lane_segments

log = logging.getLogger(__name__)


@dataclass
class _Expected:
    partner: str
    waiters: list[asyncio.Future]          # waiters[i - 1] receives the Channel of lane i
    extra: list[Channel] = field(default_factory=list)


class LaneRegistry:
    """Responder side: the lanes that accepted exchanges are waiting for."""

    def __init__(self, hello_timeout_s: float):
        self.hello_timeout_s = hello_timeout_s
        self._expected: dict[str, _Expected] = {}

    def expect(self, partner: str, lanes: int) -> tuple[str, list[asyncio.Future]]:
        """Register an accepted exchange; its token, and one future per extra lane (resolved with its Channel)."""
        token = secrets.token_hex(16)
        loop = asyncio.get_running_loop()
        self._expected[token] = _Expected(partner, [loop.create_future() for _ in range(lanes - 1)])
        return token, self._expected[token].waiters

    def release(self, token: str) -> None:
        """The exchange is over: forget the token; lanes that attach later are refused."""
        entry = self._expected.pop(token, None)
        if entry is not None:
            for w in entry.waiters:
                if w.done() and not w.cancelled() and w.exception() is None:
                    w.result().close()
                else:
                    w.cancel()

    async def handle(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The lane stream handler: attach the stream to its exchange, or close it."""
        ch = Channel.take_over(reader, writer)
        partner = str(stream_info.peer_id)
        if not any(e.partner == partner for e in self._expected.values()):
            # who before what: only a partner whose exchange we accepted may open lanes; nobody else gets a read
            log.debug("lane partner=%s refused=no_accepted_exchange", partner)
            ch.close()
            return
        try:
            async with asyncio.timeout(self.hello_timeout_s):
                hello = await read_header(ch, LaneHello, SMALL_HEADER_BYTES)
        except (TimeoutError, WireError, *STREAM_ERRORS) as e:
            log.debug("lane partner=%s refused=no_hello detail=%s: %s", partner, type(e).__name__, e)
            ch.close()
            return
        except asyncio.CancelledError:   # top of a task owned by asyncio's unix server (see Exchanger._handle)
            ch.close()
            return
        entry = self._expected.get(hello.token)
        if entry is None or entry.partner != partner or hello.lane > len(entry.waiters) \
                or entry.waiters[hello.lane - 1].done():
            log.debug("lane partner=%s refused=unexpected lane=%s", partner, hello.lane)
            ch.close()
            return
        entry.waiters[hello.lane - 1].set_result(ch)   # the channel keeps the stream alive; this task may end


async def open_lanes(p2p: P2P, peer_id: PeerID, name: str, token: str, lanes: int) -> list[Channel]:
    """Initiator side: open lanes 1..lanes-1 concurrently and present the token on each."""
    async def one(i: int) -> Channel:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, name)
        ch = Channel.take_over(reader, writer)
        opened.append(ch)
        await ch.write(encode_header(LaneHello(protocol_version=PROTOCOL_VERSION, token=token, lane=i)))
        return ch

    opened: list[Channel] = []
    try:
        return list(await gather_or_cancel([one(i) for i in range(1, lanes)]))
    except BaseException:
        for ch in opened:
            ch.abort()
        raise


async def gather_or_cancel(coros: Sequence) -> list:
    """Run coroutines concurrently; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        # collect what the cancelled tasks raised, so asyncio does not log "exception was never retrieved"
        await asyncio.gather(*tasks, return_exceptions=True)


class Watermark:
    """How many leading bytes of a buffer are final: advanced by its writer, from any thread, and awaited on the
    event loop. A pipelined exchange's encoder advances one a tensor chunk by chunk, so that a lane sends its share
    of the tensor once those bytes are encoded, not once all of it is: the first bytes leave after the first chunk's
    encode, where a whole first tensor (the embedding, often the largest) kept the link idle for all of its."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.bytes = 0
        self._changed = asyncio.Event()

    def advance(self, n: int) -> None:
        """The first n bytes are final (any thread; the loop must still run)."""
        self._loop.call_soon_threadsafe(self._set, n)

    def _set(self, n: int) -> None:
        if n > self.bytes:
            self.bytes = n
            self._changed.set()
            self._changed = asyncio.Event()

    async def reached(self, n: int) -> None:
        while self.bytes < n:
            await self._changed.wait()


async def move(channels: Sequence[Channel], out: Sequence[torch.Tensor], into: Sequence[torch.Tensor],
               chunk_bytes: int, ready: Sequence[Watermark] | None = None,
               arrived: Callable[[int], None] | None = None,
               landed: Callable[[int, int, int], None] | None = None) -> None:
    """Send `out` and fill `into` at once, lane k carrying share k of each payload. Raises if any lane fails.
    Pipelined (a codec encoded per exchange, peer/transport/exchange.py): a lane sends bytes a..b of out[i] once
    `ready[i]` has reached b, `landed(i, a, b)` is called once bytes a..b of into[i] (one lane's share of it) are
    in, and `arrived(i)` once all of into[i] is."""
    out_views = [byte_view(t) for t in out]
    in_views = [byte_view(t) for t in into]
    sends = lane_segments([len(v) for v in out_views], len(channels))
    recvs = lane_segments([len(v) for v in in_views], len(channels))
    left = [0] * len(in_views)     # segments of each received tensor still on their way, over all lanes
    for segs in recvs:
        for i, _, _ in segs:
            left[i] += 1
    if arrived is not None:        # an empty tensor has no segment: it is in from the start
        for i, n in enumerate(left):
            if n == 0:
                arrived(i)

    async def send(ch: Channel, segs) -> None:
        for i, a, b in segs:
            if ready is not None:
                await ready[i].reached(b)
            await ch.write(out_views[i][a:b], chunk_bytes)

    async def receive(ch: Channel, segs) -> None:
        for i, a, b in segs:
            await ch.readinto(in_views[i][a:b])
            if landed is not None:
                landed(i, a, b)
            left[i] -= 1
            if left[i] == 0 and arrived is not None:
                arrived(i)

    await gather_or_cancel([send(ch, s) for ch, s in zip(channels, sends)] +
                           [receive(ch, r) for ch, r in zip(channels, recvs)])
