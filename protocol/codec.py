"""Wire codecs of the pairwise exchange: how a peer's tensors become bytes and back. Pure tensor math, no I/O.

A codec is named by one string that travels in the exchange header (`ExchangeRequest.codec`), so a receiver knows
exactly how to read the payload and how many bytes it must be:

    float32 | float16 | bfloat16     a cast (float32 is lossless for an fp32 model)
    int<b>[-b<block>][-p<pct>][-sr|-rn|-sd]
                                     blockwise: b in {2, 3, 4, 8} bits a value, one fp16 scale per `block` values
                                     (default 64), stochastic (sr, the default), nearest (rn) or shared-dither (sd)
                                     rounding; with -p<pct>, only pct % of the blocks travel (seeded sparse
                                     averaging, below)
    mod<b>[-p<pct>][-sr|-sd]         modulo: b in {2, 3, 4, 8} bits a value, no scales; the partner's difference to
                                     us, decoded against our own tensors (below)

Blockwise layout of one tensor (n values, padded with zeros to nb = ceil(n / block) blocks):

    [nb fp16 scales][nb * block codes of b bits, packed little-end first]

A code c in [0, 2^b - 2] stands for (c - qmax) * scale with qmax = 2^(b-1) - 1; the scale is the block's absolute
maximum / qmax, rounded to fp16 (and used rounded, so sender and receiver agree to the bit). The all-ones code is
never written. int4 is 4 + 16/64 = 4.25 bits a parameter, int8 8.25.

Seeded sparse averaging (`-p<pct>`): both sides of one exchange send the same ceil(pct/100 * nb) blocks of each
tensor, chosen by a seed both derive from the exchange (`block_choice`), so no indices travel; a payload is the
chosen blocks' scales and codes in the chosen order. The receiver decodes them over a copy of its own wire form
(`decode(..., fill=...)`), so everything not chosen mixes as identical and only the chosen blocks move this round.
int8-p10 is 0.1 * 8.25 = 0.83 bits a parameter.

Shared dither (`-sd`): stochastic rounding whose random offsets both sides of an exchange draw from the exchange's
seed, on a scale grid both are likely to share (each block's scale rounded up to a power of two). Two close models
then round their common part the same way: Q(y_j) - Q(y_i) is still y_j - y_i in expectation, but its noise grows
with the square root of their difference times the step instead of with the step (independent roundings add about a
third of a step of noise to every coordinate of every mix, however close the pair already is). The price: the
payload waits for the exchange's seed (it is encoded after the handshake, not at the offer), and a power-of-two
scale loses up to one bit of range.

Why stochastic rounding: the exchange mixes the wire form of both sides (`protocol/averaging.py` `mix_pair_`:
z_i = y_i + w (Q(y_j) - Q(y_i))), so the pair's mean is exact whatever Q does, and what Q costs is only how well the
pair comes together. With nearest rounding two close models round to the same codes, Q(y_j) - Q(y_i) is 0 where they
differ by less than a step, and those coordinates never mix; stochastic rounding makes E[Q(y)] = y, so every
coordinate mixes in expectation, with noise of at most a step (measured: docs/codecs.md).

Modulo codes (`mod<b>`, after Moniqua, Lu & De Sa 2020): gossip has no reference both partners hold, but two
partners' models are close, so each side's own model is the reference for decoding the other's. Both round y / step
stochastically to integers r and send r modulo 2^b; the receiver takes d = (r_j - r_i) modulo 2^b into
[-2^(b-1), 2^(b-1)) from the two codes and decodes the partner as y_i + step d. Where the pair is less than 2^(b-1)
steps apart that is the partner's tensor on our grid, E[y_i + step d] = y_j; spending the b bits on the difference
instead of the weight makes a step 2^(b-1) / 4 of the pair's RMS difference instead of a block's largest weight.
The step of each tensor comes from the pair's actual distance: the request carries the caller's values at
PROBE_VALUES positions of each tensor (the caller's seed), the reply the responder's at the same positions, and both
compute the same step from the two (`probe_steps`), so the range spans RANGE_RMS times the RMS of the difference. A
coordinate further apart than the range wraps and pulls the wrong way, by at most the range, on both sides alike:
the partner reads -d from the same two codes, so the pair's mean is kept exactly (the one value whose sign both
would read alike, -2^(b-1), is not mixed). A hostile partner's pull is bounded by the range a coordinate. Our own
wire form is our tensors themselves (`Staging.own_wire` None). mod4 is 4 bits a parameter. A modulo code is read
only against the same code of our own, so with a partner of any other codec a modulo peer sends FALLBACK_CODEC
instead (`sent_codec`: both sides derive it from the two codec names in the headers, no round trip), and the pair
mixes at the pair's mean (`exchange_mix_weight`): a swarm whose volunteers set different codecs stays one swarm.

Decoding checks nothing but sizes: the receiver checks the decoded values are finite (a NaN or Inf scale decodes to
NaN), and the guard judges the decoded tensors.
"""
from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache, lru_cache

import torch

from gasloc.protocol.messages import MAX_CODEC_CHARS

# the exchange's default, chosen by measurement (docs/codecs.md): the cheapest codec within 0.5 % of the fp32 wire's
# loss at equal tokens in the simulator (paired seeds). mod4-sd at its mix weight (below): +0.43 % on seeds 0-2,
# +0.18 % on 0-4, at 4.0 bits a parameter; on the fp32 run's partners (clock.charge_codec false: the rounding alone,
# docs/codecs.md G2) +1.04 % and +0.79 %; over ten seeds +0.32 +- 0.35 % on its own partners, +0.91 +- 0.39 % on
# fp32's (G3) at kappa 1; with its own kappa 0.5 (below) +0.39 +- 0.37 % on fp32's partners over ten seeds (J),
# lower than at kappa 1 on every seed.
# Blockwise rounding of the weights themselves at 4 bits costs 2.9-11.7 % (noise of ~14 % of a weight a mix, five
# times the partners' distance); int8 (8.25 bits) was the default before
DEFAULT_CODEC = "mod4-sd"
# the weight per partner an exchange of one of these codecs mixes with where outer.mix_weight is unset (the pair's
# mean, 0.5, for every other codec). mod4-sd 0.4: its decoded difference carries rounding noise of about a sixth of
# the difference's square (a step is the difference's RMS), and the pair's mean takes that noise in whole: pulling
# each side by less leaves part of the difference but less of the noise (for a noise share r the pair ends closest at
# 0.5 / (1 + r), about 0.43). Measured (docs/codecs.md invocation G): 0.35 +1.6 %, 0.4 +0.4 %, 0.45 +1.3 %, 0.5
# +1.15 % over fp32; 0.4 halves the consensus distance
MIX_WEIGHT = {"mod4-sd": 0.4}
# kappa (outer.mix_momentum, form C) an exchange of one of these codecs runs where outer.mix_momentum is unset (1, the
# form as published, for every other codec), from docs/codecs.md invocation J, on fp32's partners. The outer
# momentum carries on that share of a mix's correction, and with it that share of the codec's rounding noise:
# - mod4-sd (the default) 0.5: below 1 on each of ten seeds, by 0.51 +- 0.11 % (+0.39 % over fp32 against +0.91 %);
#   0 cost more than 1 (+1.4 % against +1.0 % on seeds 0-2)
# - mod3-sd 0: +1.8 % over fp32 on seeds 0-2 against +14.8 % at 1 (+9.9 % at 0.5, seed 0); at 1 the momentum drives
#   a spiral of overshoots that the guard clips and rejects
# - int8-p10, mod8-p12-sd 0: +18.3 % (seeds 0-2) and +18.5 % (seed 0) against +33.8 % and +35.9 % at 1 (invocations
#   C and F, seeds 0-2): a sparse code's block goes unmixed for rounds after the momentum carried it past its mean
# Measured and left at 1: mod2-p50-sd and sign1 read the same at 0 and 1 (the guard gives their mixes no momentum);
# mod3-p33-sd 0 -1.2 % against 1 on one seed, within a seed's noise.
MIX_MOMENTUM = {"mod4-sd": 0.5, "mod3-sd": 0.0, "int8-p10": 0.0, "mod8-p12-sd": 0.0}
DEFAULT_BLOCK = 64
CASTS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BLOCK_BITS = (2, 3, 4, 8)
_BLOCKWISE = re.compile(
    r"^int(?P<bits>\d)(?:-b(?P<block>\d{1,5}))?(?:-p(?P<pct>\d{1,2}))?(?:-(?P<rounding>sr|rn|sd))?$")
_MODULO = re.compile(r"^mod(?P<bits>\d)(?:-p(?P<pct>\d{1,2}))?(?:-(?P<rounding>sr|sd))?$")
MODULO_BITS = (2, 3, 4, 8)
# a modulo codec's step: the code range, 2^(b-1) steps each way, spans this many RMS of the pair's difference (a
# coordinate further apart wraps), measured at PROBE_VALUES positions a tensor that both sides send in the handshake
RANGE_RMS = 8.0
PROBE_VALUES = 64
MIN_STEP = 1e-9
# values a modulo encode rounds at once (a multiple of every packing group: whole bytes a chunk)
MODULO_CHUNK = 1 << 18
_INT_CLAMP = float(1 << 62)


# what a modulo peer sends a partner of another codec (the partner's own codes are no reference for ours): the
# cheapest blockwise code that loses nothing measurable (docs/codecs.md)
FALLBACK_CODEC = "int8"


class CodecError(ValueError):
    """A codec name or payload we cannot read (the exchange answers BAD_DTYPE / BAD_HEADER)."""


@dataclass(frozen=True)
class Codec:
    """One wire codec. `name` is what the header carries; everything else follows from it (`parse`)."""
    name: str
    bits: int                 # bits a value (cast: the dtype's width)
    block: int = 0            # values per fp16 scale (0: a cast)
    stochastic: bool = False  # rounding of blockwise codes
    percent: int = 100        # share of the blocks that travel (seeded sparse averaging), in percent
    shared: bool = False      # stochastic rounding with the exchange's shared dither, on power-of-two scales
    modulo: bool = False      # codes of round(y / step) mod 2^bits, decoded against the receiver's own tensors

    @property
    def lossless(self) -> bool:
        """Decoding gives back the fp32 tensor exactly."""
        return self.name == "float32"

    @property
    def cast(self) -> torch.dtype | None:
        return CASTS.get(self.name)

    @property
    def seeded(self) -> bool:
        """Encoding needs the exchange's seed (a sparse codec's blocks, a shared dither) or its agreed steps (a
        modulo codec): once per exchange."""
        return self.sparse or self.shared or self.modulo

    @property
    def mix_weight(self) -> float | None:
        """The weight per partner this codec's rounding warrants where outer.mix_weight is unset (None: the pair's
        mean). Set only where measured (MIX_WEIGHT), by what the name stands for, as mix_momentum. Both sides of a
        modulo exchange run the same codec (any other is BAD_DTYPE), so both pull by the same weight and the pair's
        mean stays exact."""
        return _MIX_WEIGHT_BY_FORM.get(self._form)

    @property
    def mix_momentum(self) -> float | None:
        """kappa (outer.mix_momentum) this codec's rounding warrants where outer.mix_momentum is unset (None: 1, the
        form as published). Set only where measured (MIX_MOMENTUM), by what the name stands for: int8-b64-p10-sr is
        int8-p10."""
        return _MIX_MOMENTUM_BY_FORM.get(self._form)

    @property
    def _form(self) -> Codec:
        """What the name stands for: the codec without its name (int8-b64-p10-sr and int8-p10 share one)."""
        return replace(self, name="")

    @property
    def sparse(self) -> bool:
        """Only some blocks travel: encode and decode need the exchange's seed (`block_choice`)."""
        return self.percent < 100

    def blocks_sent(self, numel: int) -> int:
        nb = -(-numel // self.block)
        return nb if not self.sparse else -(-nb * self.percent // 100)

    def tensor_bytes(self, numel: int) -> int:
        """Payload bytes of one tensor of `numel` values."""
        if self.cast is not None:
            return numel * self.bits // 8
        nb = self.blocks_sent(numel)
        return (0 if self.modulo else 2 * nb) + _packed_bytes(nb * self.block, self.bits)

    def block_choice(self, numel: int, seed: int) -> torch.Tensor | None:
        """Sparse: the indices of the blocks that travel, the same on both sides for the same seed (None: all)."""
        if not self.sparse:
            return None
        nb = -(-numel // self.block)
        return torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[:self.blocks_sent(numel)]

    def payload_bytes(self, numels: Sequence[int]) -> int:
        return sum(self.tensor_bytes(n) for n in numels)

    def bits_per_param(self, numels: Sequence[int]) -> float:
        """What a payload of these tensors costs, scales and padding included."""
        return 8 * self.payload_bytes(numels) / max(1, sum(numels))

    # ---- encode / decode, one tensor at a time ----

    @torch.no_grad()
    def encode(self, t: torch.Tensor, out: torch.Tensor | None = None, generator: torch.Generator | None = None,
               seed: int | None = None, step: float | None = None,
               progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """`t` (any float dtype, any device) as payload bytes: a uint8 CPU tensor of `tensor_bytes(t.numel())`,
        written into `out` when given. Stochastic rounding draws from `generator` (None: torch's default; a tensor
        on a GPU always draws from its device's default generator); a sparse codec sends the blocks
        `block_choice(numel, seed)` picks. A GPU tensor is quantized on its device and only the payload (bits/32 of
        the tensor) crosses to the host. `progress(n)`: the first n bytes of `out` are final; a modulo codec on the
        CPU reports each chunk (`MODULO_CHUNK` values), every encode its whole payload at the end."""
        n = t.numel()
        size = self.tensor_bytes(n)
        if out is None:
            out = torch.empty(size, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.numel() != size:
            raise CodecError(f"{self.name}: output buffer of {out.numel()} bytes, need {size}")
        if self.cast is not None:
            out.view(self.cast).copy_(t.detach().reshape(-1))
            return out
        host, dev = out, t.device
        if dev.type != "cpu":
            out, generator = torch.empty(size, dtype=torch.uint8, device=dev), None
        x = t.detach().reshape(-1).to(torch.float32)
        nb = -(-n // self.block)
        if nb * self.block != n:
            x = torch.nn.functional.pad(x, (0, nb * self.block - n))
        xb = x.view(nb, self.block)
        if self.sparse:
            if seed is None:
                raise CodecError(f"{self.name}: a sparse codec encodes with the exchange's seed")
            xb = xb[self.block_choice(n, seed).to(dev)]
            nb = xb.shape[0]
        if self.modulo:
            self._encode_modulo(xb, out, generator, seed, step, progress if out is host else None)
        else:
            self._encode_blockwise(xb, out, generator, seed)
        if out is not host:
            host.copy_(out)   # the payload only: bits/32 of the tensor crosses to the host
        if progress is not None:
            progress(size)
        return host

    def _encode_blockwise(self, xb: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None,
                          seed: int | None) -> None:
        nb, dev = xb.shape[0], xb.device
        qmax = (1 << (self.bits - 1)) - 1
        scales = out[:2 * nb].view(torch.float16)
        step = xb.abs().amax(dim=1).div_(qmax)
        if self.shared:   # a power of two at or above the step: two close models mostly pick the same one
            step = torch.exp2(torch.ceil(torch.log2(step)))
        scales.copy_(step)                                  # fp16: what the receiver reads back
        s = scales.float()
        s[s == 0] = 1.0                                     # an all-zero block: codes qmax, decoded 0
        q = xb / s.unsqueeze(1)
        if self.shared:
            if seed is None:
                raise CodecError(f"{self.name}: a shared dither encodes with the exchange's seed")
            # drawn on the CPU from the seed alone, so that both sides, on any device, draw the same offsets
            u = torch.rand(q.shape, generator=torch.Generator().manual_seed(seed))
            q.add_(u.to(dev)).floor_()
        elif self.stochastic:
            q.add_(torch.rand(q.shape, generator=generator, device=dev)).floor_()
        else:
            q.round_()
        codes = q.clamp_(-qmax, qmax).add_(qmax).to(torch.uint8)
        _pack(codes.view(-1), self.bits, out[2 * nb:])

    def _encode_modulo(self, xb: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None,
                       seed: int | None, step: float | None, progress: Callable[[int], None] | None) -> None:
        if step is None or not math.isfinite(step) or step <= 0:
            raise CodecError(f"{self.name}: a modulo codec encodes with the exchange's agreed step, got {step}")
        x, dev = xb.reshape(-1), xb.device
        if self.shared:
            if seed is None:
                raise CodecError(f"{self.name}: a shared dither encodes with the exchange's seed")
            # drawn on the CPU from the seed alone, so that both sides, on any device, draw the same offsets
            base, offsets = modulo_dither(x.numel(), torch.Generator().manual_seed(seed))
        else:
            base, offsets = modulo_dither(x.numel(), generator, dev)
        base, offsets = base.to(dev), offsets.tolist()
        # chunk by chunk: the float64 temporaries of a whole tensor (8 bytes a value, three passes) spill the cache
        # and made the encode 2.4x slower
        for k, a in enumerate(range(0, x.numel(), MODULO_CHUNK)):
            b = min(a + MODULO_CHUNK, x.numel())
            # float64: |y| / step passes 2^24 for a small step, where float32 would round the fraction stochastic
            # rounding draws against
            q = x[a:b].to(torch.float64).div_(step).add_(base[:b - a].add(offsets[k]).frac_())
            # floor(q) mod 2^b as the low bits of an int64 (two's complement: the same as the remainder, a quarter
            # faster); past 2^62, where a float64 is a multiple of 2^b anyway, clamped, so no cast overflows
            codes = q.floor_().clamp_(-_INT_CLAMP, _INT_CLAMP).to(torch.int64).bitwise_and_((1 << self.bits) - 1)
            codes = codes.to(torch.uint8)
            # a and b are multiples of every packing group (whole blocks, MODULO_CHUNK), so each chunk packs into
            # whole bytes of its own
            _pack(codes, self.bits, out[a * self.bits // 8:b * self.bits // 8])
            if progress is not None:
                progress(b * self.bits // 8)

    @torch.no_grad()
    def decode(self, payload: torch.Tensor, out: torch.Tensor, seed: int | None = None,
               fill: torch.Tensor | None = None, ref: torch.Tensor | None = None,
               step: float | None = None) -> torch.Tensor:
        """Payload bytes (a uint8 CPU tensor of exactly `tensor_bytes(out.numel())`) into `out` (its shape and
        dtype stay; any device). A sparse codec writes the chosen blocks over `fill` (what the rest of `out`
        becomes: the receiver's own wire form, so that the blocks not sent mix as identical). A modulo codec
        decodes against our own tensor `fill` and our own payload `ref` of the same exchange (`_decode_modulo`)."""
        n = out.numel()
        if payload.dtype != torch.uint8 or payload.numel() != self.tensor_bytes(n):
            raise CodecError(f"{self.name}: {payload.numel()} payload bytes for {n} values, expected "
                             f"{self.tensor_bytes(n)}")
        flat = out.view(-1)
        if self.cast is not None:
            flat.copy_(payload.view(self.cast), non_blocking=True)
            return out
        if self.modulo:
            return self._decode_modulo(payload, out, seed, fill, ref, step)
        nb = self.blocks_sent(n)
        vals = self._block_values(payload[:2 * nb], payload[2 * nb:])
        if self.sparse:
            if seed is None or fill is None or fill.numel() != n:
                raise CodecError(f"{self.name}: a sparse codec decodes with the exchange's seed over a fill")
            full = torch.nn.functional.pad(fill.detach().reshape(-1).to("cpu", torch.float32),
                                           (0, -(-n // self.block) * self.block - n))
            full.view(-1, self.block)[self.block_choice(n, seed)] = vals
            vals = full
        flat.copy_(vals.view(-1)[:n], non_blocking=True)
        return out

    def _block_values(self, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Blockwise codes as values, (blocks, block) float32: (code - qmax) times its block's fp16 scale, from the
        scales' bytes and the packed codes of the same blocks."""
        nb = scales.numel() // 2
        q = _unpack(codes, self.bits, nb * self.block).view(nb, self.block).float()
        return q.sub_((1 << (self.bits - 1)) - 1).mul_(scales.view(torch.float16).float().unsqueeze(1))

    def _decode_modulo(self, payload: torch.Tensor, out: torch.Tensor, seed: int | None, fill: torch.Tensor | None,
                       ref: torch.Tensor | None, step: float | None) -> torch.Tensor:
        """out = fill + step * d, d = the partner's codes minus ours, taken modulo 2^b into [-2^(b-1), 2^(b-1)).

        Both sides rounded y / step (the step both agreed) and sent the integers modulo 2^b. Where the pair is less
        than 2^(b-1) steps apart, d is exactly r_j - r_i: the partner's tensor as seen on our grid, rounded
        stochastically, E[step d] = y_j - y_i. The partner computes -d from the same two codes, so the pair's
        corrections cancel exactly, also where a coordinate further apart wrapped (it then pulls by a wrong amount,
        at most the range, on both sides alike). The one code difference whose sign the two sides would read alike,
        -2^(b-1), is left unmixed on both sides. `fill` is our own tensor y_i, which is also our own wire form: the
        mix z_i = y_i + w (out - y_i) = y_i + w step d (protocol/averaging.py mix_pair_ with own_wire None)."""
        n = out.numel()
        self._check_modulo_inputs(n, payload, fill, ref, step)
        if not self.sparse:
            return self._decode_modulo_span(payload, ref, out, fill, 0, n, step)
        nb = self.blocks_sent(n)
        if seed is None:
            raise CodecError(f"{self.name}: a sparse codec decodes with the exchange's seed")
        delta = self._modulo_delta(payload, ref, nb * self.block, step).view(nb, self.block)
        base = torch.nn.functional.pad(fill.detach().reshape(-1).to("cpu", torch.float32),
                                       (0, -(-n // self.block) * self.block - n))
        base.view(-1, self.block).index_add_(0, self.block_choice(n, seed), delta)
        out.view(-1).copy_(base[:n], non_blocking=True)
        return out

    @property
    def decodes_ranges(self) -> bool:
        """Any byte range of a payload decodes on its own once the tensor's `range_header_bytes` are in
        (`decode_range`): a dense modulo or blockwise code whose codes fill whole bytes (2, 4 or 8 bits), so every
        split of the payload is a split between codes. The exchange decodes each lane's share of a tensor as it
        lands instead of the whole tensor after its last byte."""
        return self.block > 0 and not self.sparse and 8 % self.bits == 0

    def range_header_bytes(self, numel: int) -> int:
        """The leading bytes of a tensor's payload that every range of it needs: a blockwise code's scales (0: a
        modulo code, whose reference is our own payload)."""
        return 0 if self.modulo else 2 * self.blocks_sent(numel)

    @torch.no_grad()
    def decode_range(self, payload: torch.Tensor, out: torch.Tensor, start: int, stop: int,
                     fill: torch.Tensor | None = None, ref: torch.Tensor | None = None,
                     step: float | None = None) -> None:
        """Bytes start..stop of a tensor's whole payload buffer decoded into the values they hold of `out` (what
        `decode` gives for them; the rest of `out` untouched). The caller guarantees that those bytes and the first
        `range_header_bytes` are in; other bytes of the buffer may be anything (a code beside the range may be
        read, never written out). A modulo code decodes against `fill`, our whole tensor, and `ref`, our whole
        payload. Only where `decodes_ranges`."""
        n = out.numel()
        if not self.decodes_ranges:
            raise CodecError(f"{self.name}: a part of this codec's payload does not decode on its own")
        size = self.tensor_bytes(n)
        if payload.dtype != torch.uint8 or payload.numel() != size or not 0 <= start <= stop <= size:
            raise CodecError(f"{self.name}: bytes {start}..{stop} of a payload of {payload.numel()} bytes for {n} "
                             f"values, expected {size}")
        per, head = 8 // self.bits, self.range_header_bytes(n)
        lo, hi = min(max(start - head, 0) * per, n), min(max(stop - head, 0) * per, n)   # past n: padding
        if lo >= hi:
            return
        if self.modulo:
            self._check_modulo_inputs(n, payload, fill, ref, step)
            self._decode_modulo_span(payload[start:stop], ref[start:stop], out, fill, lo, hi, step)
            return
        # whole blocks around the values, their codes read as they are (those beside the range are not written)
        b0, b1 = lo // self.block, -(-hi // self.block)
        vals = self._block_values(payload[2 * b0:2 * b1],
                                  payload[head + b0 * self.block // per:head + b1 * self.block // per])
        out.view(-1)[lo:hi].copy_(vals.view(-1)[lo - b0 * self.block:hi - b0 * self.block], non_blocking=True)

    def _check_modulo_inputs(self, n: int, payload: torch.Tensor, fill: torch.Tensor | None,
                             ref: torch.Tensor | None, step: float | None) -> None:
        if fill is None or fill.numel() != n or ref is None or ref.numel() != payload.numel():
            raise CodecError(f"{self.name}: a modulo codec decodes against our own tensor and our own payload")
        if step is None or not math.isfinite(step) or step <= 0:
            raise CodecError(f"{self.name}: a modulo codec decodes with the exchange's agreed step, got {step}")

    def _modulo_delta(self, payload: torch.Tensor, ref: torch.Tensor, ncodes: int, step: float) -> torch.Tensor:
        """step * d for the codes of these bytes, d in [-2^(b-1), 2^(b-1)), -2^(b-1) read as 0 (see _decode_modulo)."""
        if 8 % self.bits == 0:
            # a byte of theirs and the byte of ours at the same place hold the same codes: their d's are one row of
            # a table of every pair of bytes (a gather instead of a dozen passes over the codes; the same values)
            pairs = payload.to(torch.int32).mul_(256).add_(ref)
            return torch.index_select(_delta_table(self.bits), 0, pairs).view(-1)[:ncodes].to(torch.float32).mul_(step)
        return _code_difference(payload, ref, self.bits, ncodes).to(torch.float32).mul_(step)

    def _decode_modulo_span(self, payload: torch.Tensor, ref: torch.Tensor, out: torch.Tensor,
                            fill: torch.Tensor, lo: int, hi: int, step: float) -> torch.Tensor:
        """Values lo..hi of `out`, from a dense payload's bytes that hold codes lo.. (and padding past n)."""
        delta = self._modulo_delta(payload, ref, payload.numel() * 8 // self.bits, step)[:hi - lo]
        out.view(-1)[lo:hi].copy_(delta.add_(fill.detach().reshape(-1)[lo:hi].to("cpu", torch.float32)),
                                  non_blocking=True)
        return out


def modulo_dither(numel: int, generator: torch.Generator | None, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A modulo encode's stochastic-rounding offsets for a tensor of `numel` values, in float64: `base`, one uniform
    draw in [0, 1) for each position of a chunk (min(numel, MODULO_CHUNK) of them), and `offsets`, one uniform draw a
    chunk; value i of chunk k rounds as floor(y / step + frac(base[i] + offsets[k])).

    Why not one draw a value: the draws were most of the encode, and the default codec's encode is on the exchange's
    clock (docs/codecs.md, Speed). What the rounding needs still holds: each value's offset is uniform in [0, 1), so
    E[r] = y / step, whether each side draws its own or both draw the same from the exchange's seed (a shared
    dither: close values round alike); values a chunk apart share a base draw but round against other offsets."""
    n = min(numel, MODULO_CHUNK)
    base = torch.rand(n, generator=generator, dtype=torch.float64, device=device)
    offsets = torch.rand(-(-numel // MODULO_CHUNK), generator=generator, dtype=torch.float64, device=device)
    return base, offsets.cpu()


def _code_difference(theirs: torch.Tensor, ours: torch.Tensor, bits: int, ncodes: int) -> torch.Tensor:
    """d of the first `ncodes` codes of two modulo payloads' bytes, int16: (their code - ours) modulo 2^b in
    [-2^(b-1), 2^(b-1)), -2^(b-1) read as 0 (Codec._decode_modulo)."""
    half = 1 << (bits - 1)
    d = _unpack(theirs, bits, ncodes).to(torch.int16).sub_(_unpack(ours, bits, ncodes).to(torch.int16))
    d = d.add_(half).bitwise_and_((1 << bits) - 1).sub_(half)
    return d.masked_fill_(d == -half, 0)


@cache
def _delta_table(bits: int) -> torch.Tensor:
    """A modulo code of `bits` that fills whole bytes: `_code_difference` of every pair of payload bytes, [65536,
    8 // bits] int8, row theirs * 256 + ours."""
    every, per = torch.arange(256, dtype=torch.uint8), 8 // bits
    theirs, ours = every.repeat_interleave(256), every.repeat(256)
    return _code_difference(theirs, ours, bits, 65536 * per).view(65536, per).to(torch.int8)


def probe_positions(numel: int, seed: int) -> torch.Tensor | None:
    """Where a modulo codec's probe samples a tensor of `numel` values: PROBE_VALUES positions drawn from the
    exchange's probe seed (None: a tensor that small is probed whole)."""
    if numel <= PROBE_VALUES:
        return None
    return torch.randint(numel, (PROBE_VALUES,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def probe(tensors: Sequence[torch.Tensor], seed: int) -> torch.Tensor:
    """Our values at the probe positions of every tensor, concatenated (float32, on the CPU): what the exchange's
    request and reply carry so that both sides can size the step from the pair's actual distance."""
    out = []
    for k, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        pos = probe_positions(flat.numel(), seed + k)
        out.append((flat if pos is None else flat[pos.to(flat.device)]).to("cpu", torch.float32))
    return torch.cat(out) if out else torch.empty(0)


def probe_numel(numels: Sequence[int]) -> int:
    return sum(min(n, PROBE_VALUES) for n in numels)


def probe_text(values: torch.Tensor) -> str:
    """A probe as the exchange header carries it: its float32 values, little-endian, in base64."""
    return base64.b64encode(values.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()


def read_probe(text: str, numels: Sequence[int]) -> torch.Tensor:
    """A header's probe back as values; CodecError unless it is base64 of exactly one float32 a probe position of
    these tensors, every one finite."""
    n = probe_numel(numels)
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise CodecError(f"probe is not base64: {e}") from None
    if len(raw) != 4 * n:
        raise CodecError(f"probe of {len(raw)} bytes, expected {4 * n} ({n} float32 values)")
    values = torch.frombuffer(bytearray(raw), dtype=torch.float32)   # little-endian hosts, as probe_text writes
    if not bool(torch.isfinite(values).all()):
        raise CodecError("a probe value is not finite")
    return values


def probe_steps(codec: Codec, numels: Sequence[int], mine: torch.Tensor, theirs: torch.Tensor) -> list[float]:
    """A modulo codec's step per tensor for one exchange, from both sides' probes: the code range (2^(b-1) steps
    each way) spans RANGE_RMS times the RMS of the pair's difference at the probe positions. Both sides compute it
    from the same two probes, bit for bit ((a - b)^2 = (b - a)^2 in floating point), so no agreement round trip is
    needed. CodecError where a probe has the wrong size or a value that is not finite."""
    n = probe_numel(numels)
    for p in (mine, theirs):
        if p.numel() != n or p.dtype != torch.float32:
            raise CodecError(f"{codec.name}: a probe of {p.numel()} values, expected {n}")
        if not bool(torch.isfinite(p).all()):
            raise CodecError(f"{codec.name}: a probe value is not finite")
    sq = (mine.double() - theirs.double()).square_()
    span = RANGE_RMS / (1 << (codec.bits - 1))
    out, at = [], 0
    for numel in numels:
        k = min(numel, PROBE_VALUES)
        out.append(max(span * math.sqrt(float(sq[at:at + k].mean())), MIN_STEP))
        at += k
    return out


def parse(name: str) -> Codec:
    """The codec a name stands for; CodecError names what is wrong with it."""
    if not isinstance(name, str) or len(name) > MAX_CODEC_CHARS:
        raise CodecError(f"codec name must be a string of at most {MAX_CODEC_CHARS} characters")
    return _parse(name)


@lru_cache(maxsize=64)
def _parse(name: str) -> Codec:
    if name in CASTS:
        return Codec(name, bits=torch.finfo(CASTS[name]).bits)
    m = _MODULO.match(name)
    if m:
        bits, pct = int(m["bits"]), int(m["pct"] or 100)
        if bits not in MODULO_BITS:
            raise CodecError(f"codec {name!r}: {bits} bits a value, supported {list(MODULO_BITS)}")
        if not 1 <= pct <= 100:
            raise CodecError(f"codec {name!r}: -p{pct}, the share of blocks sent must be 1..99 percent")
        return Codec(name, bits=bits, block=DEFAULT_BLOCK, stochastic=True, percent=pct, shared=m["rounding"] == "sd",
                     modulo=True)
    m = _BLOCKWISE.match(name)
    if not m:
        raise CodecError(f"unknown codec {name!r}: float32, float16, bfloat16, "
                         "int<bits>[-b<block>][-p<pct>][-sr|-rn|-sd] or mod<bits>[-p<pct>][-sr|-sd]")
    bits, block = int(m["bits"]), int(m["block"] or DEFAULT_BLOCK)
    if bits not in BLOCK_BITS:
        raise CodecError(f"codec {name!r}: {bits} bits a value, supported {list(BLOCK_BITS)}")
    if not 8 <= block <= 4096 or block % 8:
        raise CodecError(f"codec {name!r}: block {block}, must be a multiple of 8 in 8..4096")
    pct = int(m["pct"] or 100)
    if not 1 <= pct <= 100:
        raise CodecError(f"codec {name!r}: -p{pct}, the share of blocks sent must be 1..99 percent")
    return Codec(name, bits=bits, block=block, stochastic=m["rounding"] != "rn", percent=pct,
                 shared=m["rounding"] == "sd")


# MIX_WEIGHT and MIX_MOMENTUM by what each name stands for (Codec.mix_weight, Codec.mix_momentum)
_MIX_WEIGHT_BY_FORM = {_parse(name)._form: weight for name, weight in MIX_WEIGHT.items()}
_MIX_MOMENTUM_BY_FORM = {_parse(name)._form: kappa for name, kappa in MIX_MOMENTUM.items()}


def sent_codec(own: Codec, other: Codec) -> Codec:
    """What a peer whose codec is `own` sends a partner whose header names `other`: its own codec, except a modulo
    one facing any other codec, which sends FALLBACK_CODEC. Both sides compute it from the same two names."""
    return parse(FALLBACK_CODEC) if own.modulo and other != own else own


def exchange_mix_weight(sent: Codec, received: Codec) -> float | None:
    """The weight per partner of one exchange where outer.mix_weight is unset: the codec's own (Codec.mix_weight)
    only where both sides sent that codec, else the pair's mean (None). Both sides compute the same, so the pair's
    mean stays exact."""
    return sent.mix_weight if sent == received else None


def exchange_mix_momentum(sent: Codec, received: Codec) -> float | None:
    """kappa of one exchange where outer.mix_momentum is unset: the codec's own (Codec.mix_momentum) only where both
    sides sent that codec, else None (1). Both sides compute the same: a kappa that differs between the two sides
    of a mix would move the swarm's mean."""
    return sent.mix_momentum if sent == received else None


def check_name(name: str) -> str:
    """For config validators: the name if it parses, else a ValueError that says why."""
    parse(name)
    return name


# ---- bit packing: codes are < 2^bits; `per` codes make `per * bits / 8` whole bytes ----

def _group(bits: int) -> int:
    return 8 // math.gcd(8, bits)


def _packed_bytes(ncodes: int, bits: int) -> int:
    per = _group(bits)
    return -(-ncodes // per) * per * bits // 8


def _pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    if bits == 8:
        out.copy_(codes)
        return
    if bits == 4:  # the common case, without the wide accumulator: two codes a byte
        torch.bitwise_or(codes[0::2], codes[1::2] << 4, out=out)
        return
    per = _group(bits)
    c = codes.view(-1, per).to(torch.int32)   # blocks are multiples of 8 codes, so whole groups
    acc = torch.zeros(c.shape[0], dtype=torch.int32, device=codes.device)
    for k in range(per):
        acc |= c[:, k] << (bits * k)
    nbytes = per * bits // 8
    view = out.view(-1, nbytes)
    for j in range(nbytes):
        view[:, j] = (acc >> (8 * j)) & 0xFF


def _unpack(payload: torch.Tensor, bits: int, ncodes: int) -> torch.Tensor:
    if bits == 8:
        return payload
    if bits == 4:
        codes = torch.empty(ncodes, dtype=torch.uint8, device=payload.device)
        torch.bitwise_and(payload, 0x0F, out=codes[0::2])
        torch.bitwise_right_shift(payload, 4, out=codes[1::2])
        return codes
    per = _group(bits)
    nbytes = per * bits // 8
    b = payload.view(-1, nbytes).to(torch.int32)
    acc = torch.zeros(b.shape[0], dtype=torch.int32, device=payload.device)
    for j in range(nbytes):
        acc |= b[:, j] << (8 * j)
    mask = (1 << bits) - 1
    return torch.stack([(acc >> (bits * k)) & mask for k in range(per)], dim=1).view(-1)[:ncodes]
