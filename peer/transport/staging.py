"""The exchange's staging step: our offered tensors become wire bytes, the partner's wire bytes become tensors.

It owns every buffer the pairwise exchange needs, so none is allocated per round once the first exchange has run:
- send: our payload in our codec (protocol/codec.py), encoded once per offer (a seeded codec: once per exchange,
  with the exchange's seed; a modulo codec tensor by tensor, `encode_one`, while the transfer runs). Zero-copy
  where the codec is our tensors' own dtype on the CPU (a float32 model on a float32 wire sends its tensors'
  memory as is). Tensors on a GPU are copied to pinned host memory without blocking
  and waited for once, not per tensor.
- own wire form: what the partner decodes of our payload, Q(y_i), which the daemon mixes against (symmetric mixing:
  z_i = y_i + w (Q(y_j) - Q(y_i)), protocol/averaging.py `mix_pair_`). None for a lossless codec (our tensors).
- receive: the partner's payload bytes, per codec name, and the decoded tensors the exchange returns (recycled by
  the daemon after the mix, `recycle`).

Everything here runs in a worker thread (torch releases the GIL), never on the event loop. Memory: a lossy codec
holds the payloads (about bits/32 of the model each way) and one decoded copy of our own wire form beside the
received tensors; the daemon counts these as the exchange's buffers (bench/host_memory.py).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from gasloc.peer.transport.tensor_io import is_finite, torch_dtype
from gasloc.protocol.codec import Codec
from gasloc.protocol.messages import TensorSpec


class Staging:
    """Send and receive buffers of one Exchanger; `codec` is what we send."""

    def __init__(self, specs: Sequence[TensorSpec], codec: Codec):
        self.specs, self.codec = list(specs), codec
        self.numels = [s.numel for s in self.specs]
        self.dtypes = [torch_dtype(s.dtype) for s in self.specs]
        self._send: list[torch.Tensor] | None = None      # encoded payload buffers (a lossy or cast codec)
        self._own: list[torch.Tensor] | None = None       # decoded own wire form, reused
        self._recv: dict[str, list[torch.Tensor]] = {}    # partner payload buffers per codec name
        self._spare: list[torch.Tensor] | None = None     # decoded output tensors handed back by `recycle`
        # stochastic rounding's draws: a generator of our own, never the global one (training's stays as it was)
        self._rng = torch.Generator().manual_seed(random.SystemRandom().getrandbits(62))

    def payload_bytes(self, codec: Codec | None = None) -> int:
        return (codec or self.codec).payload_bytes(self.numels)

    def _zero_copy(self, codec: Codec, tensors: Sequence[torch.Tensor]) -> bool:
        return codec.cast is not None and all(t.dtype == codec.cast and t.device.type == "cpu" for t in tensors)

    @torch.no_grad()
    def encode(self, tensors: Sequence[torch.Tensor], seed: int | None = None,
               steps: Sequence[float] | None = None) -> list[torch.Tensor]:
        """Our payload: one tensor per spec whose raw memory goes on the wire (reused buffers, valid until the
        next encode). `steps`: a modulo codec's agreed step per tensor."""
        if self._zero_copy(self.codec, tensors):
            return [t.detach().reshape(-1) for t in tensors]
        send = self.send_buffers(tensors)
        for k, t in enumerate(tensors):
            self.codec.encode(t, send[k], generator=self._rng, seed=seed, step=steps[k] if steps is not None else None)
        if any(t.device.type == "cuda" for t in tensors):
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory have landed
        return send

    def send_buffers(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The payload buffers (allocated at the first call, pinned for tensors on a GPU), for `encode_one`."""
        if self._send is None:
            pin = any(t.device.type == "cuda" for t in tensors) and torch.cuda.is_available()
            self._send = [torch.empty(self.codec.tensor_bytes(n), dtype=torch.uint8, pin_memory=pin)
                          for n in self.numels]
        return self._send

    @torch.no_grad()
    def encode_one(self, k: int, t: torch.Tensor, seed: int | None, step: float | None,
                   progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """Tensor k of our payload alone, into its send buffer (a pipelined exchange sends it while the rest is
        encoded); the same bytes `encode` writes for it. `progress(n)`: its first n bytes are final
        (`Codec.encode`)."""
        buf = self.send_buffers([t])[k]
        self.codec.encode(t, buf, generator=self._rng, seed=seed, step=step, progress=progress)
        if t.device.type == "cuda":
            torch.cuda.synchronize()
        return buf

    @torch.no_grad()
    def own_wire(self, payload: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
                 seed: int | None = None) -> list[torch.Tensor] | None:
        """Q(y_i): our payload as the partner decodes it (None: our tensors themselves, with a lossless codec, and
        with a modulo codec, whose decoded partner is our tensors plus a rounded difference)."""
        if self.codec.lossless or self.codec.modulo:
            return None
        if self._own is None:
            self._own = [torch.empty(s.shape, dtype=d) for s, d in zip(self.specs, self.dtypes)]
        for p, t, out in zip(payload, tensors, self._own):
            self.codec.decode(p, out, seed, fill=t if self.codec.sparse else None)
        return self._own

    def receive_buffers(self, codec: Codec) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(what the partner's bytes land in, the decoded tensors the exchange returns); the same tensors where the
        partner's codec is our own dtype (zero-copy)."""
        out, self._spare = self._spare, None
        if out is None:
            out = [torch.empty(s.shape, dtype=d) for s, d in zip(self.specs, self.dtypes)]
        if codec.cast is not None and all(d == codec.cast for d in self.dtypes):
            return out, out
        bufs = self._recv.get(codec.name)
        if bufs is None:
            if len(self._recv) >= 4:   # a swarm uses one or two codecs; do not keep one buffer set per stranger
                self._recv.clear()
            bufs = self._recv[codec.name] = [torch.empty(codec.tensor_bytes(n), dtype=torch.uint8)
                                             for n in self.numels]
        return bufs, out

    @torch.no_grad()
    def decode(self, codec: Codec, bufs: Sequence[torch.Tensor], out: Sequence[torch.Tensor], seed: int | None,
               fill: Sequence[torch.Tensor] | None, ref: Sequence[torch.Tensor] | None = None,
               steps: Sequence[float] | None = None) -> list[int]:
        """The partner's payload into `out` (a sparse codec over `fill`, our own wire form; a modulo codec against
        `fill`, our tensors, and `ref`, our payload, with the agreed `steps`); the indices of the tensors with a NaN
        or Inf after decoding."""
        return [i for i, (b, o) in enumerate(zip(bufs, out))
                if not self.decode_one(codec, b, o, seed, fill[i] if fill is not None else None,
                                       ref[i] if ref is not None else None, steps[i] if steps is not None else None)]

    @torch.no_grad()
    def decode_one(self, codec: Codec, buf: torch.Tensor, out: torch.Tensor, seed: int | None,
                   fill: torch.Tensor | None, ref: torch.Tensor | None, step: float | None) -> bool:
        """One tensor of the partner's payload into `out` (as `decode`); whether it is finite."""
        if buf is not out:
            codec.decode(buf, out, seed, fill=fill, ref=ref, step=step)
        return is_finite(out)

    def release(self) -> None:
        """Drop every buffer kept between exchanges (payloads, own wire form, spare decoded tensors); the next
        exchange allocates afresh. A CPU peer calls it after each search (peer/swarm/gossip.py keep_buffers)."""
        self._send, self._own, self._spare = None, None, None
        self._recv.clear()

    def recycle(self, tensors: Sequence[torch.Tensor]) -> None:
        ok = len(tensors) == len(self.specs) and all(
            tuple(t.shape) == s.shape and t.dtype == d and t.is_contiguous() and t.device.type == "cpu"
            for t, s, d in zip(tensors, self.specs, self.dtypes))
        if not ok:
            raise ValueError("recycle() takes the tensors of an exchange result (same shapes and dtypes as specs)")
        self._spare = list(tensors)
