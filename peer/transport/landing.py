"""The partner's payload decoded as it lands, beside the transfer (`peer/transport/exchange.py`).

p2pd delivers the lanes of one connection one after another (lane 0's share first, the last lane's at the end), so
decoding a tensor only once all of it is in leaves most of the decoding after the last byte, on the exchange's
clock. Where the codec `decodes_ranges` (a dense blockwise or modulo code of 2, 4 or 8 bits), each lane's share of a
tensor is decoded as soon as it is in (`lanes.move(landed=...)`); a blockwise share waits for its tensor's scales
(the first bytes of its payload, usually in the same or an earlier lane). Any other codec decodes each tensor once
all of it is in (`move(arrived=...)`). Each tensor is checked finite once it is whole.

Decoding runs in worker threads, one hop for everything that landed meanwhile, never on the event loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch

from gasloc.peer.transport.lanes import Watermark
from gasloc.peer.transport.staging import Staging
from gasloc.peer.transport.tensor_io import in_thread, is_finite
from gasloc.protocol.codec import Codec


class Landing:
    """Decodes `bufs` (the partner's payload buffers, in `codec`) into `out` while `move` fills them. `fill`, `ref`
    and `steps`: what `Staging.decode` takes per tensor (our own wire form or tensors, our payload, a modulo
    codec's steps). `ready[i]`, where given, must reach byte b of tensor i before its bytes up to b decode (a modulo
    code decodes against our own payload of it, encoded during the transfer)."""

    def __init__(self, staging: Staging, codec: Codec, bufs: Sequence[torch.Tensor], out: Sequence[torch.Tensor],
                 seed: int | None, fill: Sequence[torch.Tensor] | None, ref: Sequence[torch.Tensor] | None,
                 steps: Sequence[float] | None, ready: Sequence[Watermark] | None = None):
        self.staging, self.codec, self.bufs, self.out, self.seed = staging, codec, bufs, out, seed
        self.fill, self.ref, self.steps, self.ready = fill, ref, steps, ready
        self.ranged = codec.decodes_ranges
        n = len(bufs)
        # per tensor: bytes still to land (ranged) or 1 until it is decoded whole; its header (a blockwise code's
        # scales) and the header bytes still to land; code ranges that landed before their scales
        self._left = [b.numel() if self.ranged else 1 for b in bufs]
        self._header = [codec.range_header_bytes(o.numel()) if self.ranged else 0 for o in out]
        self._head = list(self._header)
        self._waiting: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self._queue: asyncio.Queue[tuple[int, int, int]] = asyncio.Queue()

    def hooks(self) -> dict[str, Callable]:
        """The keyword arguments `lanes.move` reports landings through."""
        if self.ranged:
            return {"landed": lambda i, a, b: self._queue.put_nowait((i, a, b))}
        return {"arrived": lambda i: self._queue.put_nowait((i, 0, self.bufs[i].numel()))}

    async def run(self) -> list[int]:
        """Until every tensor is whole: the indices of those not finite after decoding."""
        bad, todo = [], sum(1 for x in self._left if x > 0)   # a tensor of no bytes is whole from the start
        while todo:
            batch = [await self._queue.get()]
            while not self._queue.empty():          # one thread hop for all that landed meanwhile
                batch.append(self._queue.get_nowait())
            if self.ready is not None:
                for i, _, b in batch:
                    await self.ready[i].reached(b if self.ranged else self.bufs[i].numel())
            job = asyncio.ensure_future(in_thread(self._decode, batch))
            try:
                got, whole = await asyncio.shield(job)
            except asyncio.CancelledError:
                # the thread writes into the exchange's buffers: it ends before they can go to another exchange
                await asyncio.wait([job])
                raise
            bad += got
            todo -= whole
        return sorted(bad)

    def _args(self, i: int) -> tuple:
        return (self.fill[i] if self.fill is not None else None, self.ref[i] if self.ref is not None else None,
                self.steps[i] if self.steps is not None else None)

    def _decode(self, batch: list[tuple[int, int, int]]) -> tuple[list[int], int]:
        """In a worker thread: decode what landed; (tensors now whole that are not finite, how many became whole)."""
        bad, whole = [], 0
        for i, a, b in batch:
            if not self.ranged:
                self._left[i] = 0
                finite = self.staging.decode_one(self.codec, self.bufs[i], self.out[i], self.seed, *self._args(i))
            else:
                self._left[i] -= b - a
                header = self._header[i]
                if a < header:                     # a share of the scales: counted; its codes, if any, follow
                    self._head[i] -= min(b, header) - a
                    a = header
                if a < b:
                    self._waiting[i].append((a, b))
                if self._head[i] == 0:             # every scale is in: all codes that landed so far decode
                    for lo, hi in self._waiting[i]:
                        self.codec.decode_range(self.bufs[i], self.out[i], lo, hi, *self._args(i))
                    self._waiting[i].clear()
                finite = self._left[i] > 0 or is_finite(self.out[i])
            whole += self._left[i] == 0
            if not finite:
                bad.append(i)
        return bad, whole
