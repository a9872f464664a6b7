"""peer/transport/lanes.py `move` pipelined (a modulo codec's exchange, peer/transport/exchange.py `_pipelined`): a
lane sends its share of tensor i only once `ready[i]` (a Watermark) has reached the share's end, and `arrived(i)`
comes once per tensor, when all of its bytes are in, over every lane. Channels here are in-memory pairs (move uses
only write and readinto)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from gasloc.peer.transport.lanes import Watermark, move

pytestmark = pytest.mark.timeout(30)


class _Pipe:
    """One direction of an in-memory stream."""

    def __init__(self):
        self.buf, self.more = bytearray(), asyncio.Event()


class _Channel:
    def __init__(self, out: _Pipe, inp: _Pipe, log: list):
        self.out, self.inp, self.log = out, inp, log

    async def write(self, view, chunk_bytes: int) -> None:
        self.log.append(("sent", bytes(view)))
        self.out.buf.extend(bytes(view))
        self.out.more.set()
        await asyncio.sleep(0)

    async def readinto(self, view) -> None:
        while len(self.inp.buf) < len(view):
            self.inp.more.clear()
            await self.inp.more.wait()
        view[:] = self.inp.buf[:len(view)]
        del self.inp.buf[:len(view)]


def _pair(lanes: int, log: list):
    pipes = [(_Pipe(), _Pipe()) for _ in range(lanes)]
    return [_Channel(a, b, log) for a, b in pipes], [_Channel(b, a, []) for a, b in pipes]


def test_a_pipelined_move_sends_a_tensor_only_once_ready_and_reports_each_arrival_once():
    async def main():
        ours = [torch.arange(n, dtype=torch.uint8) for n in (10, 7, 0, 13)]
        theirs = [torch.full((n,), 200 - n, dtype=torch.uint8) for n in (10, 7, 0, 13)]
        got_ours = [torch.zeros_like(t) for t in ours]
        got_theirs = [torch.zeros_like(t) for t in theirs]
        log: list = []
        mine, partners = _pair(2, log)
        loop = asyncio.get_running_loop()
        ready = [Watermark(loop) for _ in ours]
        arrived: list[int] = []
        task = asyncio.ensure_future(move(mine, ours, got_theirs, 4, ready=ready, arrived=arrived.append))
        other = asyncio.ensure_future(move(partners, theirs, got_ours, 4))
        await asyncio.sleep(0.05)
        assert not log                      # nothing of ours before tensor 0 is ready
        assert sorted(arrived) == [0, 1, 2, 3]   # theirs all in already (the empty one from the start)
        ready[0].advance(10)
        await asyncio.sleep(0.05)
        assert {b for _, b in log} <= {bytes(ours[0])} and log    # tensor 0 only
        for w, n in zip(ready[1:], (7, 0, 13)):
            w.advance(n)
        await asyncio.wait_for(asyncio.gather(task, other), 5)
        assert len(arrived) == 4 and len(set(arrived)) == 4     # once each
        assert all(torch.equal(a, b) for a, b in zip(got_ours, ours))
        assert all(torch.equal(a, b) for a, b in zip(got_theirs, theirs))

    asyncio.run(main())


def test_arrivals_wait_for_every_lanes_share_of_a_tensor():
    async def main():
        ours = [torch.zeros(16, dtype=torch.uint8)]
        theirs = [torch.arange(16, dtype=torch.uint8)]       # split over 2 lanes: bytes 0-7 and 8-15
        got = [torch.zeros(16, dtype=torch.uint8)]
        mine, partners = _pair(2, [])
        arrived: list[int] = []
        task = asyncio.ensure_future(move(mine, ours, got, 4, arrived=arrived.append))
        # the partner's lane 0 alone: half of tensor 0 is in, it has not arrived
        await partners[0].write(memoryview(theirs[0].numpy())[:8], 4)
        await asyncio.sleep(0.02)
        assert arrived == []
        await partners[1].write(memoryview(theirs[0].numpy())[8:], 4)
        for ch in partners:   # and read ours, so that our sends complete
            await ch.readinto(memoryview(bytearray(8)))
        await asyncio.wait_for(task, 5)
        assert arrived == [0] and torch.equal(got[0], theirs[0])

    asyncio.run(main())


def test_each_lanes_share_of_a_tensor_is_reported_as_it_lands():
    """`landed(i, a, b)`: what a range-decoding codec decodes while the other lanes still carry the rest; every byte
    of every tensor is reported once, and a share only once its bytes are in."""
    async def main():
        sizes = (10, 0, 30)
        ours = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        theirs = [torch.arange(n, dtype=torch.uint8) for n in sizes]   # 40 bytes, 3 lanes: 0-12, 13-25, 26-39
        got = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        mine, partners = _pair(3, [])
        landed: list[tuple[int, int, int]] = []

        def land(i, a, b):
            assert torch.equal(got[i][a:b], theirs[i][a:b])      # the bytes are in when it is called
            landed.append((i, a, b))

        task = asyncio.ensure_future(move(mine, ours, got, 4, landed=land))
        await partners[1].write(memoryview(theirs[2].numpy())[3:16], 4)    # lane 1 alone: bytes 13..25 overall
        await asyncio.sleep(0.02)
        assert landed == [(2, 3, 16)]
        await partners[0].write(memoryview(torch.cat(theirs).numpy())[:13], 4)
        await partners[2].write(memoryview(theirs[2].numpy())[16:], 4)
        for ch in partners:
            await ch.readinto(memoryview(bytearray(13 if ch is not partners[2] else 14)))
        await asyncio.wait_for(task, 5)
        assert sorted(landed) == [(0, 0, 10), (2, 0, 3), (2, 3, 16), (2, 16, 30)]
        assert all(torch.equal(a, b) for a, b in zip(got, theirs))

    asyncio.run(main())


def test_a_lane_sends_its_share_once_the_watermark_passes_it_not_once_the_whole_tensor_is_encoded():
    """The encoder advances a tensor's Watermark chunk by chunk (exchange.py `_pipelined`): with 2 lanes, lane 0's
    share of a 16-byte tensor (bytes 0-7) goes once 8 bytes are final, lane 1's waits for the rest, and a watermark
    advanced from another thread wakes the sender."""
    async def main():
        ours = [torch.arange(16, dtype=torch.uint8)]
        theirs = [torch.zeros(16, dtype=torch.uint8)]
        got_ours, got_theirs = [torch.zeros(16, dtype=torch.uint8)], [torch.zeros(16, dtype=torch.uint8)]
        log: list = []
        mine, partners = _pair(2, log)
        ready = [Watermark(asyncio.get_running_loop())]
        task = asyncio.ensure_future(move(mine, ours, got_theirs, 4, ready=ready))
        other = asyncio.ensure_future(move(partners, theirs, got_ours, 4))
        ready[0].advance(7)                                  # one byte short of lane 0's share
        await asyncio.sleep(0.05)
        assert not log
        await asyncio.to_thread(ready[0].advance, 8)         # as the encoder thread does
        await asyncio.sleep(0.05)
        assert log == [("sent", bytes(range(8)))]
        ready[0].advance(3)                                  # a watermark never goes back
        await asyncio.sleep(0.01)
        assert ready[0].bytes == 8
        ready[0].advance(16)
        await asyncio.wait_for(asyncio.gather(task, other), 5)
        assert torch.equal(got_ours[0], ours[0]) and [b for _, b in log] == [bytes(range(8)), bytes(range(8, 16))]

    asyncio.run(main())
