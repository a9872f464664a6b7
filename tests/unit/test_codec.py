"""protocol/codec.py and the symmetric mix (protocol/averaging.py mix_pair_): sizes, round trips, names, hostile
payloads, and the pair mean that mixing the wire forms keeps where mixing our exact tensors did not."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gasloc.protocol.averaging import mix_pair_, pair_weight, round_mix_momentum
from gasloc.protocol.codec import (
    DEFAULT_CODEC,
    MIN_STEP,
    MODULO_CHUNK,
    CodecError,
    _unpack,
    modulo_dither,
    parse,
    probe,
    probe_numel,
    probe_steps,
    probe_text,
    read_probe,
)


def tensors(seed, numels=(300 * 500, 77, 1, 64, 4096)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 0.02 for n in numels]


@pytest.mark.parametrize("name,bits,bpp", [("float32", 32, 32.0), ("float16", 16, 16.0), ("bfloat16", 16, 16.0),
                                           ("int8", 8, 8.25), ("int4", 4, 4.25), ("int3", 3, 3.25),
                                           ("int2", 2, 2.25), ("int4-b256", 4, 4.0625)])
def test_sizes_are_exact_golden_numbers(name, bits, bpp):
    c = parse(name)
    assert c.bits == bits
    assert c.bits_per_param([64 * 1000]) == pytest.approx(bpp)   # whole blocks: scales included, no padding
    assert c.encode(torch.zeros(64 * 1000)).numel() == c.tensor_bytes(64 * 1000)


def test_the_default_codec_and_what_it_sends_for_tiny():
    # 885,888 parameters, every tensor a multiple of 64 values: mod4-sd is 442,944 bytes = 0.5 bytes a parameter
    # (fp32: 4; int8, the default before, 913,572 = 1.031; blockwise int4 470,628 at +2.9-11.7 % loss, docs/codecs.md)
    from gasloc.peer.train.model import ModelConfig, build_model
    numels = [p.numel() for p in build_model(ModelConfig(preset="tiny"), 256, seed=0).parameters()]
    assert sum(numels) == 885_888
    assert DEFAULT_CODEC == "mod4-sd" and parse(DEFAULT_CODEC).payload_bytes(numels) == 442_944
    assert parse("int8").payload_bytes(numels) == 913_572 and parse("int4").payload_bytes(numels) == 470_628


def test_only_the_measured_modulo_code_brings_its_own_mix_weight():
    """The dense 4-bit modulo code with the shared dither pulls by 0.4 (docs/codecs.md invocation G); every other
    codec by the pair's mean, and a configured outer.mix_weight wins over both (protocol/averaging.py pair_weight)."""
    assert parse("mod4-sd").mix_weight == 0.4
    for name in ("float32", "float16", "int8", "int4-sd", "mod4", "mod3-sd", "mod8-sd", "mod4-p25-sd", "int8-p10"):
        assert parse(name).mix_weight is None, name
    assert pair_weight(None, parse("mod4-sd").mix_weight) == 0.4
    assert pair_weight(None, parse("int8").mix_weight) == 0.5
    assert pair_weight(0.3, parse("mod4-sd").mix_weight) == 0.3


def test_only_the_measured_codecs_bring_their_own_mix_momentum():
    """A round's kappa (protocol/averaging.py round_mix_momentum): 0 where the mix decision withholds momentum, else
    a configured outer.mix_momentum, else the codec's own (docs/codecs.md invocation J: mod4-sd 0.5; mod3-sd and the
    sparse int8-p10 and mod8-p12-sd 0), else 1. A codec is known by what its name stands for, not by its spelling."""
    assert parse("mod4-sd").mix_momentum == 0.5
    for name in ("mod3-sd", "int8-p10", "int8-b64-p10-sr", "mod8-p12-sd"):
        assert parse(name).mix_momentum == 0.0, name
    for name in ("float32", "float16", "int8", "int4-sd", "mod4", "mod3", "mod8-sd", "mod4-p25-sd", "mod2-p50-sd",
                 "int8-p10-rn", "int8-b32-p10", "int8-p11", "mod8-p12"):
        assert parse(name).mix_momentum is None, name
    assert round_mix_momentum(None, parse("mod4-sd").mix_momentum) == 0.5
    assert round_mix_momentum(None, parse("int8").mix_momentum) == 1.0
    assert round_mix_momentum(0.2, parse("mod4-sd").mix_momentum) == 0.2
    assert round_mix_momentum(1.0, parse("mod4-sd").mix_momentum) == 1.0
    assert round_mix_momentum(None, parse("mod4-sd").mix_momentum, carry=False) == 0.0
    assert round_mix_momentum(0.7, None, carry=False) == 0.0


@pytest.mark.parametrize("name", ["int8", "int4", "int4-rn", "int3", "int2", "int8-b8", "int4-b4096"])
def test_blockwise_round_trip_is_within_one_step_of_each_blocks_scale(name):
    c = parse(name)
    qmax = (1 << (c.bits - 1)) - 1
    for x in tensors(0):
        y = c.decode(c.encode(x), torch.empty_like(x))
        pad = -x.numel() % c.block
        xb = torch.nn.functional.pad(x, (0, pad)).view(-1, c.block)
        step = (xb.abs().amax(1) / qmax).repeat_interleave(c.block)[:x.numel()]
        assert ((y - x).abs() <= step * (1.0 if c.stochastic else 0.5) * 1.01 + 1e-12).all()


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    x = torch.linspace(-1, 1, 64) * 0.37 + 0.011   # values between grid points
    sr, rn = parse("int2"), parse("int2-rn")
    g = torch.Generator().manual_seed(0)
    mean = torch.stack([sr.decode(sr.encode(x, generator=g), torch.empty(64)) for _ in range(4000)]).mean(0)
    assert (mean - x).abs().max() < 0.02                      # E[Q(x)] = x
    assert (rn.decode(rn.encode(x), torch.empty(64)) - x).abs().max() > 0.1   # three levels: nearest is biased


def test_casts_round_trip_and_float32_is_lossless():
    x = tensors(1)[0]
    assert parse("float32").lossless and torch.equal(parse("float32").decode(parse("float32").encode(x),
                                                                             torch.empty_like(x)), x)
    for name, tol in (("float16", 2 ** -11), ("bfloat16", 2 ** -8)):
        y = parse(name).decode(parse(name).encode(x), torch.empty_like(x))
        assert torch.allclose(y, x, rtol=tol, atol=1e-7) and not parse(name).lossless


def test_sparse_codec_sends_the_same_blocks_for_a_seed_and_decodes_over_the_fill():
    c = parse("int8-p10")
    x, fill = tensors(2)[0], tensors(3)[0]
    assert torch.equal(c.block_choice(x.numel(), 7), c.block_choice(x.numel(), 7))
    assert not torch.equal(c.block_choice(x.numel(), 7), c.block_choice(x.numel(), 8))
    y = c.decode(c.encode(x, seed=7), torch.empty_like(x), 7, fill=fill)
    moved = (y != fill)
    chosen = torch.zeros(-(-x.numel() // 64), dtype=torch.bool)
    chosen[c.block_choice(x.numel(), 7)] = True
    assert not moved[~chosen.repeat_interleave(64)[:x.numel()]].any()        # the rest is the fill, untouched
    assert c.bits_per_param([64 * 1000]) == pytest.approx(0.825)
    with pytest.raises(CodecError, match="seed"):
        c.encode(x)


@pytest.mark.parametrize("bad", ["int5", "int4-b7", "int4-b8192", "int4-p0", "float64", "int4-xx", "", "i" * 40,
                                 "int4-p100", "mod5", "mod4-rn", "mod4-b128", "mod1", "mod4-p0"])
def test_unknown_or_malformed_codec_names_say_why(bad):
    with pytest.raises(CodecError):
        parse(bad)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["int8", "int4", "int3", "int2", "float16", "bfloat16", "int8-p10"]),
       numel=st.integers(1, 700), data=st.data())
def test_any_payload_of_the_right_size_decodes_and_any_other_size_is_refused(name, numel, data):
    """A hostile partner controls every payload byte: a payload of the size the header promised decodes to some
    tensor (NaN/Inf included: the exchange's finite check rejects those) and never raises; a wrong size is an error
    that names the codec."""
    c = parse(name)
    n = c.tensor_bytes(numel)
    raw = torch.tensor(list(data.draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
    out = torch.empty(numel)
    c.decode(raw, out, 1, fill=torch.zeros(numel))
    with pytest.raises(CodecError, match=c.name):
        c.decode(torch.zeros(n + 1, dtype=torch.uint8), out, 1, fill=torch.zeros(numel))


@pytest.mark.parametrize("name", ["float32", "float16", "int8", "int4", "int2"])
def test_mixing_the_wire_forms_keeps_the_pair_mean_where_mixing_our_exact_tensors_moved_it(name):
    c = parse(name)
    ya, yb = tensors(4), tensors(5)
    g = torch.Generator().manual_seed(1)
    qa = [c.decode(c.encode(t, generator=g), torch.empty_like(t)) for t in ya]
    qb = [c.decode(c.encode(t, generator=g), torch.empty_like(t)) for t in yb]
    own_a, own_b = (None, None) if c.lossless else (qa, qb)
    za = mix_pair_([t.clone() for t in qb], ya, own_a, 0.5)
    zb = mix_pair_([t.clone() for t in qa], yb, own_b, 0.5)
    for x, y, a, b in zip(za, zb, ya, yb):
        assert torch.allclose(x + y, a + b, atol=1e-7, rtol=0)
    if not c.lossless:   # the old mix, y_i + w (Q(y_j) - y_i): the pair's sum moves by w (Q(y) - y) on each side
        old = sum(float(((a + 0.5 * (qb_ - a)) + (b + 0.5 * (qa_ - b)) - (a + b)).abs().max())
                  for a, b, qa_, qb_ in zip(ya, yb, qa, qb))
        assert old > 1e-5


def test_mix_pair_refuses_a_weight_outside_zero_to_one():
    with pytest.raises(ValueError):
        mix_pair_([torch.zeros(2)], [torch.zeros(2)], None, 1.5)


def test_shared_dither_rounds_a_close_pair_alike_and_needs_the_seed():
    """-sd: both sides draw the same offsets from the exchange's seed on power-of-two scales, so the noise of
    Q(y_j) - Q(y_i) shrinks with the pair's difference; independent stochastic rounding adds a third of a step to
    every coordinate however close the pair is (measured: 6.6 against 21.5 times the difference at 1 % apart)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(64 * 2000, generator=g) * 0.02
    yj = y + torch.randn(y.shape, generator=g) * 0.02 * 0.01

    def noise(name):
        c = parse(name)
        qi = c.decode(c.encode(y, generator=g, seed=3), torch.empty_like(y))
        qj = c.decode(c.encode(yj, generator=g, seed=3), torch.empty_like(y))
        return float(((qj - qi) - (yj - y)).norm() / (yj - y).norm())

    assert noise("int4-sd") < 0.5 * noise("int4")
    c = parse("int4-sd")
    assert c.seeded and not c.sparse
    assert torch.equal(c.encode(y, seed=5), c.encode(y, seed=5))          # the seed alone decides the rounding
    mean = torch.stack([c.decode(c.encode(y[:640], seed=s), torch.empty(640)) for s in range(2000)]).mean(0)
    assert (mean - y[:640]).abs().max() < 0.002                            # unbiased over seeds
    with pytest.raises(CodecError, match="seed"):
        c.encode(y)


def _modulo_pair(name, ya, yb, seed=7, gen_seed=0):
    """Both sides of one modulo exchange: steps from both probes, codes, each side's decoding of the other's."""
    c = parse(name)
    numels = [t.numel() for t in ya]
    steps = probe_steps(c, numels, probe(ya, seed), probe(yb, seed))
    assert steps == probe_steps(c, numels, probe(yb, seed), probe(ya, seed))   # both sides, bit for bit
    g = torch.Generator().manual_seed(gen_seed)
    pa = [c.encode(t, generator=g, seed=seed, step=s) for t, s in zip(ya, steps)]
    pb = [c.encode(t, generator=g, seed=seed, step=s) for t, s in zip(yb, steps)]
    at_a = [c.decode(p, torch.empty_like(t), seed, fill=t, ref=r, step=s) for p, r, t, s in zip(pb, pa, ya, steps)]
    at_b = [c.decode(p, torch.empty_like(t), seed, fill=t, ref=r, step=s) for p, r, t, s in zip(pa, pb, yb, steps)]
    return c, steps, at_a, at_b


@pytest.mark.parametrize("name,bits,bpp", [("mod4", 4, 4.0), ("mod3", 3, 3.0), ("mod2", 2, 2.0), ("mod8", 8, 8.0),
                                           ("mod4-p25", 4, 1.0), ("mod2-p50", 2, 1.0), ("mod4-sd", 4, 4.0)])
def test_modulo_sizes_are_exact_golden_numbers(name, bits, bpp):
    """No scales travel (the step comes from the probes in the headers): b bits a value, times the share sent."""
    c = parse(name)
    assert c.modulo and c.seeded and c.bits == bits and not c.lossless
    assert c.bits_per_param([64 * 1000]) == pytest.approx(bpp)
    assert c.encode(torch.zeros(64 * 1000), seed=1, step=0.1).numel() == c.tensor_bytes(64 * 1000)


@pytest.mark.parametrize("name", ["mod4", "mod3-sd", "mod2", "mod4-p25"])
def test_modulo_pair_keeps_its_mean_exactly_also_where_a_coordinate_wrapped(name):
    """Each side decodes d = the partner's codes minus its own, modulo 2^b; the other side reads -d from the same
    two codes, so z_i + z_j = y_i + y_j to float rounding even for coordinates further apart than the range (here
    one in a hundred is moved far past it)."""
    ya = tensors(4)
    yb = [t + torch.randn_like(t) * 0.0005 for t in ya]
    yb[0][::100] += 0.5
    c, steps, at_a, at_b = _modulo_pair(name, ya, yb)
    za = mix_pair_([t.clone() for t in at_a], ya, None, 0.5)
    zb = mix_pair_([t.clone() for t in at_b], yb, None, 0.5)
    for x, y, a, b in zip(za, zb, ya, yb):
        assert torch.allclose(x + y, a + b, atol=1e-7, rtol=0)
    # what a side decodes is its own tensor moved by whole steps, at most 2^(b-1) - 1 of them
    half = 1 << (c.bits - 1)
    for got, own, s in zip(at_a, ya, steps):
        d = (got - own) / s
        assert torch.allclose(d, d.round(), atol=1e-3) and float(d.abs().max()) <= half - 1 + 1e-3


def test_modulo_decodes_the_partner_to_within_a_step_where_the_pair_is_close():
    """RANGE_RMS RMS of the pair's difference span the range: nearly every coordinate decodes to within two steps
    (each side's stochastic rounding is off by less than one), unbiased, far finer than int4 on the weights."""
    ya = tensors(4)
    yb = [t + torch.randn_like(t) * 0.0005 for t in ya]
    c, steps, at_a, _ = _modulo_pair("mod4", ya, yb)
    err = torch.cat([(x - y).reshape(-1) for x, y in zip(at_a, yb)])
    big = torch.cat([torch.full((t.numel(),), s) for t, s in zip(ya, steps)])
    assert float((err.abs() < 2 * big).float().mean()) > 0.999
    assert abs(float(err.mean())) < 1e-5
    int4 = parse("int4")
    q = torch.cat([int4.decode(int4.encode(t), torch.empty_like(t)).reshape(-1) - t.reshape(-1) for t in yb])
    assert float(err.norm()) < 0.2 * float(q.norm())


def test_modulo_needs_its_step_seed_and_own_codes_and_probes_are_checked():
    c = parse("mod4")
    y = torch.randn(640)
    with pytest.raises(CodecError, match="step"):
        c.encode(y, seed=1)
    with pytest.raises(CodecError, match="step"):
        c.encode(y, seed=1, step=float("nan"))
    p = c.encode(y, seed=1, step=0.1)
    with pytest.raises(CodecError, match="own"):
        c.decode(p, torch.empty(640), 1, fill=y, step=0.1)           # no own payload to decode against
    with pytest.raises(CodecError, match="seed"):
        parse("mod4-sd").encode(y, step=0.1)
    numels = [640, 3]
    good = probe([y, torch.ones(3)], 5)
    assert good.numel() == probe_numel(numels) == 64 + 3
    assert torch.equal(read_probe(probe_text(good), numels), good)
    for bad, why in (("!!", "base64"), (probe_text(good[:-1]), "bytes"),
                     (probe_text(torch.full((67,), float("inf"))), "finite")):
        with pytest.raises(CodecError, match=why):
            read_probe(bad, numels)
    # identical tensors: the step falls to its floor and every coordinate decodes to our own
    steps = probe_steps(c, numels, good, good.clone())
    assert steps == [MIN_STEP, MIN_STEP]


@pytest.mark.parametrize("name", ["mod4-sd", "mod2", "mod8", "int8", "int4-sd", "int2-b256", "int8-rn"])
def test_a_dense_payload_decodes_range_by_range_to_the_whole_decode(name):
    """The exchange decodes each lane's share of a tensor as it lands (`decode_range`): cut anywhere (inside a
    block, inside the scales), the parts give the whole decode's values bit for bit, in any order once the scales
    are in; a part writes only its own values, and bytes beside it that have not landed change nothing."""
    c = parse(name)
    assert c.decodes_ranges
    ya = tensors(3, numels=(5000, 77))
    yb = [t + torch.randn_like(t) * 0.0005 for t in ya]
    for own, theirs in zip(ya, yb):
        pa, pb = c.encode(own, seed=7, step=1e-4), c.encode(theirs, seed=7, step=1e-4)
        mod = {"fill": own, "ref": pa, "step": 1e-4} if c.modulo else {}
        whole = c.decode(pb, torch.empty_like(own), 7, **mod)
        head = c.range_header_bytes(own.numel())
        assert head == (0 if c.modulo else 2 * -(-own.numel() // c.block))
        cuts = sorted({0, head, pb.numel(), *torch.randint(
            1, pb.numel(), (5,), generator=torch.Generator().manual_seed(1)).tolist()})
        parts = torch.full_like(own, float("nan"))
        landed = pb.clone()
        landed[head:] = 0xA5                               # codes not landed yet: stale bytes
        for a, b in reversed(list(zip(cuts, cuts[1:]))):
            landed[a:b] = pb[a:b]
            c.decode_range(landed, parts, a, b, **mod)
            lo = min(max(a - head, 0) * 8 // c.bits, own.numel())
            assert bool(torch.isnan(parts[:lo]).all()) and not bool(torch.isnan(parts[lo:]).any())
        assert torch.equal(parts, whole)
    p = c.encode(torch.zeros(640), seed=1, step=0.1)
    mod = {"fill": torch.zeros(640), "ref": p, "step": 0.1} if c.modulo else {}
    with pytest.raises(CodecError, match="bytes"):
        c.decode_range(p, torch.empty(640), p.numel() - 4, p.numel() + 4, **mod)
    with pytest.raises(CodecError, match="bytes"):
        c.decode_range(p[:8], torch.empty(640), 0, 8, **mod)     # the whole buffer, not a slice
    if c.modulo:
        with pytest.raises(CodecError, match="own"):
            c.decode_range(p, torch.empty(640), 0, 8, fill=torch.zeros(640), ref=p[:4], step=0.1)


def test_only_dense_codes_that_fill_whole_bytes_decode_by_ranges():
    for other in ("mod3", "mod4-p25", "int3", "int8-p10", "float16", "float32"):   # a byte is not whole codes, or
        assert not parse(other).decodes_ranges                                   # sparse, or a cast
    p = parse("mod3").encode(torch.zeros(640), seed=1, step=0.1)
    with pytest.raises(CodecError, match="does not decode on its own"):
        parse("mod3").decode_range(p, torch.empty(640), 0, 3, fill=torch.zeros(640), ref=p, step=0.1)


@pytest.mark.parametrize("name", ["mod4-sd", "mod3", "mod2-sd", "mod8"])
def test_modulo_encodes_chunk_by_chunk_to_the_codes_of_the_whole_tensor(name):
    """The encode rounds MODULO_CHUNK values at a time (a cache-sized float64 temporary) against `modulo_dither`'s
    offsets and takes the code from the low bits of an int64; the codes must be those of rounding the whole tensor
    at once against the same offsets and taking the remainder, bit for bit, also for values far past the range:
    the partner decodes against them."""
    c = parse(name)
    n = 2 * MODULO_CHUNK + 640                      # three chunks, the last a short one
    y = torch.randn(n) * 0.02
    y[::997] = torch.randn(n)[::997] * 1e30       # past int64 as multiples of the step: codes 0, as the remainder
    y[1::997] = -3.1234567e9                       # negative, past 2^31 steps
    step = 1.2345678e-3
    got = c.encode(y, seed=7, step=step, generator=torch.Generator().manual_seed(11))
    base, offsets = modulo_dither(n, torch.Generator().manual_seed(7 if c.shared else 11))
    u = (base.repeat(3)[:n] + offsets.repeat_interleave(MODULO_CHUNK)[:n]).frac()
    q = y.to(torch.float64).div(step) + u
    codes = torch.remainder(q.floor(), 1 << c.bits).to(torch.uint8)
    assert torch.equal(got, _pack_reference(codes, c.bits))


def test_modulo_dither_is_uniform_and_the_shared_one_rounds_a_close_pair_alike():
    """`modulo_dither` draws one offset a position of a chunk and one a chunk (drawing one a value was most of the
    encode): each value's offset frac(base + offset) is uniform in [0, 1), so over exchanges a value's code is
    unbiased, and with the shared dither (both sides draw from the exchange's seed) its noise shrinks with the pair's
    difference instead of being about a third of a step everywhere, as with independent draws."""
    n = MODULO_CHUNK + 4096
    base, offsets = modulo_dither(n, torch.Generator().manual_seed(3))
    assert base.shape == (MODULO_CHUNK,) and offsets.shape == (2,) and base.dtype == torch.float64
    u = torch.cat([base + offsets[0], base[:4096] + offsets[1]]).frac()
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.003
    assert float((u[:4096] - u[MODULO_CHUNK:]).abs().mean()) > 0.2      # a chunk apart: other offsets
    g = torch.Generator().manual_seed(0)
    y = torch.randn(64 * 100, generator=g) * 0.02
    yj = y + torch.randn(y.shape, generator=g) * 0.02 * 0.01
    step = 0.001      # the pair 1 % of a weight apart, a fifth of a step

    def decoded(name, seed, gen):
        c = parse(name)
        mine = c.encode(y, seed=seed, step=step, generator=gen)
        theirs = c.encode(yj, seed=seed, step=step, generator=gen)
        return c.decode(theirs, torch.empty_like(y), seed, fill=y, ref=mine, step=step)

    shared = torch.stack([decoded("mod4-sd", s, None) for s in range(400)])
    assert float((shared.mean(0) - yj).abs().max()) < 0.2 * step          # unbiased over exchanges
    alone = torch.stack([decoded("mod4", 0, torch.Generator().manual_seed(s)) for s in range(100)])
    assert float((alone.mean(0) - yj).abs().max()) < 0.4 * step
    noise = lambda d: float((d - yj).pow(2).mean().sqrt())                  # noqa: E731
    assert noise(shared) < 0.75 * noise(alone)       # measured: 0.35 against 0.57 of a step


@pytest.mark.parametrize("name", ["mod4-sd", "mod3", "mod2-p50-sd", "int8"])
def test_the_encode_reports_each_final_prefix_of_the_payload_as_it_writes_it(name):
    """`progress(n)`: the first n payload bytes are final when it is called (a pipelined exchange sends them at
    once): a modulo code once a chunk, every codec its whole payload at the end; the same bytes as without it."""
    c = parse(name)
    n = 2 * MODULO_CHUNK + 6400
    y = torch.randn(n) * 0.02
    out = torch.zeros(c.tensor_bytes(n), dtype=torch.uint8)
    seen: list[tuple[int, torch.Tensor]] = []
    c.encode(y, out, seed=7, step=1e-3, generator=torch.Generator().manual_seed(1),
             progress=lambda k: seen.append((k, out[:k].clone())))
    whole = c.encode(y, seed=7, step=1e-3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(out, whole)
    marks = [k for k, _ in seen]
    assert marks == sorted(marks) and marks[-1] == out.numel()
    assert len(set(marks)) == (1 if not c.modulo else -(-c.blocks_sent(n) * c.block // MODULO_CHUNK))
    assert all(torch.equal(prefix, whole[:k]) for k, prefix in seen)


def _pack_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-end-first packing as a bit stream: each code's bits, lowest first, one after another."""
    stream = np.unpackbits(codes.numpy()[:, None], axis=1, bitorder="little")[:, :bits].reshape(-1)
    return torch.from_numpy(np.packbits(stream, bitorder="little"))


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["mod4", "mod3", "mod2-p50", "mod8"]), numel=st.integers(1, 700), data=st.data())
def test_any_modulo_payload_of_the_right_size_decodes_within_the_range(name, numel, data):
    """A hostile partner controls every code: whatever it sends, what we decode is our own tensor moved by at most
    2^(b-1) - 1 steps a coordinate (its pull is bounded by the range), never NaN."""
    c = parse(name)
    n = c.tensor_bytes(numel)
    raw = torch.tensor(list(data.draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
    own = torch.randn(numel)
    ref = c.encode(own, seed=3, step=0.01)
    out = c.decode(raw, torch.empty(numel), 3, fill=own, ref=ref, step=0.01)
    assert bool(torch.isfinite(out).all())
    assert float((out - own).abs().max()) <= ((1 << (c.bits - 1)) - 1) * 0.01 * (1 + 1e-5) + 1e-6


def test_doctor_names_the_codec_its_bits_and_what_it_sends_a_partner_of_another_codec(tmp_path):
    from gasloc.cli.doctor_checks import check_codec
    cfg = tmp_path / "peer.toml"
    cfg.write_text('[model]\npreset = "tiny"\n[exchange]\ncodec = "mod4"\n')
    c = check_codec(cfg)
    assert c.status == "OK" and "mod4: 4.00 bits a parameter" in c.detail
    assert "with a partner of another codec it sends int8 instead" in c.detail
    cfg.write_text('[model]\npreset = "tiny"\n[exchange]\ncodec = "int8-p10"\n')
    assert "only with peers that send int8-p10" in check_codec(cfg).detail
    cfg.write_text('[exchange]\ncodec = "mod5"\n')
    c = check_codec(cfg)
    assert c.status == "FAIL" and "mod5" in c.detail


@pytest.mark.parametrize("name", ["mod2-sd", "mod4-sd", "mod8", "mod4-p25-sd"])
def test_modulo_decode_reads_each_pair_of_bytes_from_a_table_as_the_code_arithmetic_would(name):
    """A modulo code that fills whole bytes decodes by a gather from `_delta_table` (every pair of bytes, theirs and
    ours): the same values, bit for bit, as unpacking both payloads and taking (theirs - ours) modulo 2^b into
    [-2^(b-1), 2^(b-1)), -2^(b-1) read as 0, then times the step, for every byte value on either side."""
    c = parse(name)
    g = torch.Generator().manual_seed(5)
    n = 64 * 8192
    size = c.tensor_bytes(n)
    theirs = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    ours = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    every = torch.arange(256, dtype=torch.uint8)
    theirs[:1 << 16], ours[:1 << 16] = every.repeat(256), every.repeat_interleave(256)   # every byte against every byte
    ncodes = size * 8 // c.bits
    half, step = 1 << (c.bits - 1), 1.2345e-3
    d = (_unpack(theirs, c.bits, ncodes).to(torch.int16) - _unpack(ours, c.bits, ncodes).to(torch.int16) + half)
    d = d.bitwise_and_((1 << c.bits) - 1).sub_(half)
    want = d.masked_fill_(d == -half, 0).to(torch.float32).mul_(step)
    assert torch.equal(c._modulo_delta(theirs, ours, ncodes, step), want)
    fill = torch.randn(n, generator=g)
    got = c.decode(theirs, torch.empty(n), seed=3, fill=fill, ref=ours, step=step)
    if not c.sparse:
        assert torch.equal(got, want[:n] + fill)
