"""Wire headers and their validation (protocol/messages.py, protocol/wire.py). Pure, no I/O."""
import json
import struct

import pytest
import torch

from gasloc.protocol.codec import exchange_mix_momentum, exchange_mix_weight, parse, probe_numel, probe_text, sent_codec
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import (
    PROTOCOL_VERSION,
    ExchangeReply,
    ExchangeRequest,
    StateReply,
    StateRequest,
    TensorSpec,
    fingerprint,
    payload_bytes,
    specs_of,
)
from gasloc.protocol.wire import (
    LENGTH_PREFIX_BYTES,
    MAX_HEADER_BYTES,
    WireError,
    check_reply,
    check_request,
    check_state_reply,
    decode_header,
    encode_header,
    lane_count,
    lane_segments,
    parse_length,
)

SPECS = specs_of([((4, 3), "float32"), ((7,), "float32"), ((), "float32")])
FP = fingerprint(preset="tiny", seq_len=128, algorithm="gasloc", form="C")
CAP = payload_bytes(SPECS, "float32")


def request(**over):
    fields = dict(protocol_version=PROTOCOL_VERSION, fingerprint=FP, round=3, codec="float32",
                  specs=tuple(SPECS), total_bytes=payload_bytes(SPECS, "float32"))
    fields.update(over)
    return ExchangeRequest(**fields)


def roundtrip(header, cls):
    frame = encode_header(header)
    n = parse_length(frame[:LENGTH_PREFIX_BYTES])
    assert n == len(frame) - LENGTH_PREFIX_BYTES
    return decode_header(frame[LENGTH_PREFIX_BYTES:], cls)


def test_headers_round_trip():
    for header, cls in [(request(), ExchangeRequest),
                        (ExchangeReply(protocol_version=PROTOCOL_VERSION, code=int(Code.BUSY), message="busy"),
                         ExchangeReply),
                        (StateRequest(protocol_version=PROTOCOL_VERSION, fingerprint=FP), StateRequest),
                        (StateReply(protocol_version=PROTOCOL_VERSION, code=0, fingerprint=FP, round=9, num_outer=1,
                                    metadata={"round": 9, "lr": 0.5}, specs=tuple(SPECS), total_bytes=CAP,
                                    sha256="ab" * 32), StateReply)]:
        assert roundtrip(header, cls) == header


def test_unknown_fields_are_tolerated_known_ones_validated():
    body = json.loads(request().model_dump_json())
    body["compression"] = "zstd"                       # a field from a newer peer
    body["specs"][0]["layout"] = "strided"
    got = decode_header(json.dumps(body).encode(), ExchangeRequest)
    assert got == request()
    body["round"] = "3"                                # a known field with the wrong type: no coercion
    with pytest.raises(WireError) as e:
        decode_header(json.dumps(body).encode(), ExchangeRequest)
    assert e.value.code == Code.BAD_HEADER and "round" in str(e.value)


@pytest.mark.parametrize("body,code", [
    (b"\xff\xfe not json", Code.BAD_HEADER),
    (b"[1, 2]", Code.BAD_HEADER),
    (b'{"fingerprint": "x"}', Code.BAD_HEADER),                        # no version
    (json.dumps({"protocol_version": PROTOCOL_VERSION + 1, "whatever": 1}).encode(), Code.BAD_VERSION),
    (json.dumps({"protocol_version": PROTOCOL_VERSION, "fingerprint": "x"}).encode(), Code.BAD_HEADER),
    (json.dumps({**json.loads(request().model_dump_json()), "specs": [{"shape": [-1], "dtype": "float32"}]}
                ).encode(), Code.BAD_HEADER),
    (json.dumps({**json.loads(request().model_dump_json()), "total_bytes": -5}).encode(), Code.BAD_HEADER),
])
def test_malformed_headers(body, code):
    with pytest.raises(WireError) as e:
        decode_header(body, ExchangeRequest)
    assert e.value.code == code


def test_oversized_or_empty_header_length_rejected_before_reading_the_body():
    with pytest.raises(WireError) as e:
        parse_length(struct.pack(">I", MAX_HEADER_BYTES + 1))
    assert e.value.code == Code.BAD_HEADER
    with pytest.raises(WireError):
        parse_length(struct.pack(">I", 0))
    with pytest.raises(WireError):
        parse_length(b"\x00\x01")
    assert parse_length(struct.pack(">I", MAX_HEADER_BYTES)) == MAX_HEADER_BYTES
    huge = ExchangeRequest(protocol_version=1, fingerprint=FP, round=0, codec="float32",
                           specs=tuple(TensorSpec(shape=(1,), dtype="float32") for _ in range(60_000)), total_bytes=0)
    with pytest.raises(ValueError, match="MAX_HEADER_BYTES"):
        encode_header(huge)


def check(req, **kw):
    args = dict(expected_specs=SPECS, fingerprint=FP, max_bytes=CAP)
    args.update(kw)
    return check_request(req, **args)[0]


def test_check_request_every_rule():
    assert check(request()) == Code.OK
    assert check(request(codec="bfloat16", total_bytes=payload_bytes(SPECS, "bfloat16"))) == Code.OK
    assert check(request(fingerprint="other")) == Code.BAD_FINGERPRINT
    assert check(request(codec="int7")) == Code.BAD_DTYPE
    assert check(request(total_bytes=1 << 40)) == Code.TOO_LARGE
    assert check(request(), max_bytes=CAP - 1) == Code.TOO_LARGE
    assert check(request(specs=tuple(SPECS[:2]))) == Code.BAD_SHAPE
    assert check(request(specs=(TensorSpec(shape=(3, 4), dtype="float32"), *SPECS[1:]))) == Code.BAD_SHAPE
    assert check(request(specs=(TensorSpec(shape=(4, 3), dtype="float64"), *SPECS[1:]))) == Code.BAD_DTYPE
    assert check(request(total_bytes=CAP - 4)) == Code.BAD_HEADER          # inconsistent with the specs
    assert check(request(codec="float16")) == Code.BAD_HEADER         # fp32 size declared for fp16 wire


def test_check_order_oversize_wins_over_shape_and_fingerprint_wins_over_all():
    # a huge declaration is TOO_LARGE even with absurd shapes, so the receiver never sizes anything from it
    absurd = (TensorSpec(shape=(1 << 20, 1 << 20), dtype="float32"),)
    assert check(request(specs=absurd, total_bytes=1 << 42)) == Code.TOO_LARGE
    assert check(request(specs=absurd, total_bytes=1 << 42, fingerprint="x")) == Code.BAD_FINGERPRINT


def test_check_reply():
    ok = ExchangeReply(protocol_version=1, code=0, fingerprint=FP, codec="float16", specs=tuple(SPECS),
                       total_bytes=payload_bytes(SPECS, "float16"))
    assert check_reply(ok, expected_specs=SPECS, fingerprint=FP, max_bytes=CAP)[0] == Code.OK
    busy = ExchangeReply(protocol_version=1, code=int(Code.BUSY), message="no offer")
    assert check_reply(busy, expected_specs=SPECS, fingerprint=FP, max_bytes=CAP) == (Code.BUSY, "no offer")
    future = ExchangeReply(protocol_version=1, code=200)
    assert check_reply(future, expected_specs=SPECS, fingerprint=FP, max_bytes=CAP)[0] == Code.BAD_HEADER
    bad = ok.model_copy(update={"specs": tuple(SPECS[::-1])})
    assert check_reply(bad, expected_specs=SPECS, fingerprint=FP, max_bytes=CAP)[0] == Code.BAD_SHAPE


def test_codecs_across_the_pair_a_modulo_peer_falls_back_and_a_sparse_one_needs_its_own():
    """What each side sends follows from the two codec names (protocol/codec.py sent_codec): a request in any dense
    codec is accepted by a modulo responder (which sends int8 back), a request in a modulo codec by a responder of
    any other dense one; a sparse codec still needs the same on the other side; a reply naming a modulo codec that
    is not ours is refused (an honest responder falls back, so it announces int8)."""
    numels = [s.numel for s in SPECS]
    mod, int8, sparse = parse("mod4-sd"), parse("int8"), parse("int8-p10")
    big = 1 << 20    # blocks of 64 values: these tiny tensors' int8 payload is larger than their fp32 bytes

    def req(name):
        c = parse(name)
        return request(codec=name, total_bytes=c.payload_bytes(numels),
                       probe=probe_text(torch.zeros(probe_numel(numels))) if c.modulo else "")

    assert check(req("int8"), codec=mod, max_bytes=big) == Code.OK
    assert check(req("float32"), codec=mod, max_bytes=big) == Code.OK
    assert check(req("mod4-sd"), codec=int8, max_bytes=big) == Code.OK
    assert check(req("mod3-sd"), codec=mod, max_bytes=big) == Code.OK                   # both fall back
    assert check(req("int8-p10"), codec=mod, max_bytes=big) == Code.BAD_DTYPE            # sparse against our fallback
    assert check(req("mod4-sd"), codec=sparse, max_bytes=big) == Code.BAD_DTYPE
    assert check(req("int8-p10"), codec=sparse, max_bytes=big) == Code.OK
    assert check(req("mod4-p25"), codec=int8, max_bytes=big) == Code.OK                  # a sparse modulo one falls back dense

    def reply(name):
        c = parse(name)
        return ExchangeReply(protocol_version=1, code=0, fingerprint=FP, codec=name, specs=tuple(SPECS),
                             total_bytes=c.payload_bytes(numels),
                             probe=probe_text(torch.zeros(probe_numel(numels))) if c.modulo else "")

    def chk(name, ours):
        return check_reply(reply(name), expected_specs=SPECS, fingerprint=FP, max_bytes=big, codec=ours)[0]

    assert chk("int8", mod) == Code.OK and chk("mod4-sd", mod) == Code.OK and chk("mod4-sd", int8) == Code.BAD_DTYPE
    assert chk("mod3-sd", mod) == Code.BAD_DTYPE and chk("int8", sparse) == Code.BAD_DTYPE
    # what each sends, both sides alike, and the weight they mix at: the codec's own only where both sent it
    assert sent_codec(mod, int8) == int8 and sent_codec(int8, mod) == int8 and sent_codec(mod, mod) == mod
    assert sent_codec(mod, parse("mod3-sd")) == int8 and sent_codec(parse("float32"), mod).name == "float32"
    assert exchange_mix_weight(mod, mod) == 0.4
    assert exchange_mix_weight(int8, int8) is None and exchange_mix_weight(int8, parse("float32")) is None
    assert exchange_mix_momentum(mod, mod) == 0.5    # and kappa likewise: a fallback exchange runs 1 on both sides
    assert exchange_mix_momentum(int8, int8) is None and exchange_mix_momentum(mod, int8) is None
    mod3, sparse = parse("mod3-sd"), parse("int8-p10")      # kappa 0 where both sent one of these, 1 past a fallback
    assert exchange_mix_momentum(mod3, mod3) == 0.0 and exchange_mix_momentum(sparse, sparse) == 0.0
    assert exchange_mix_momentum(sent_codec(mod3, int8), int8) is None


def test_check_state_reply():
    outer = specs_of([((4, 3), "float32")])
    base = dict(protocol_version=1, code=0, fingerprint=FP, specs=tuple(SPECS), total_bytes=CAP, sha256="0" * 64)
    args = dict(expected_specs=SPECS, fingerprint=FP, max_bytes=CAP + 48)

    def chk(outer_specs=None, **over):
        return check_state_reply(StateReply(**{**base, **over}), outer_specs=outer_specs, **args)[0]

    assert chk() == Code.OK
    assert chk(outer) == Code.OK                                       # outer state wanted, donor has none
    assert chk(outer, num_outer=1, specs=tuple(SPECS + outer), total_bytes=CAP + 48) == Code.OK
    assert chk(None, num_outer=1, specs=tuple(SPECS + outer), total_bytes=CAP + 48) == Code.BAD_SHAPE
    assert chk(sha256="") == Code.BAD_HEADER
    assert chk(total_bytes=CAP + 4) == Code.BAD_HEADER
    assert chk(total_bytes=1 << 40) == Code.TOO_LARGE
    assert chk(fingerprint="x") == Code.BAD_FINGERPRINT
    assert chk(specs=(TensorSpec(shape=(4, 3), dtype="int99"), *SPECS[1:])) == Code.BAD_DTYPE
    assert chk(code=int(Code.BUSY)) == Code.BUSY


def test_fingerprint_is_stable_and_order_independent():
    a = fingerprint(preset="tiny", seq_len=128, vocab_size=256)
    assert a == fingerprint(vocab_size=256, seq_len=128, preset="tiny")
    assert a != fingerprint(preset="tiny", seq_len=256, vocab_size=256)
    assert len(a) == 16 and int(a, 16) >= 0


def test_every_code_has_a_voice_and_fits_a_byte():
    assert all(c.voice and 0 <= c.value < 256 for c in Code)
    assert Code.parse(250) == Code.BAD_HEADER and Code.parse(1) is Code.BUSY


def test_too_many_streams_is_a_bad_header():
    assert check(request(streams=64)) == Code.OK
    assert check(request(streams=65)) == Code.BAD_HEADER
    with pytest.raises(WireError):
        decode_header(request().model_dump_json().replace('"streams":1', '"streams":0').encode(), ExchangeRequest)


def test_lane_count():
    assert lane_count(0, 32, 1 << 20) == 1
    assert lane_count(10 << 20, 32, 1 << 20) == 10
    assert lane_count(400_000_000, 32, 1 << 20) == 32
    assert lane_count(400_000_000, 500, 1) == 64            # never more than the protocol allows


@pytest.mark.parametrize("sizes,lanes", [([12, 0, 7, 30], 4), ([5], 3), ([100, 100], 1), ([3, 3], 7)])
def test_lane_segments_cover_every_byte_once_in_order(sizes, lanes):
    segs = lane_segments(sizes, lanes)
    assert len(segs) == lanes
    flat = [(i, b) for lane in segs for i, lo, hi in lane for b in range(lo, hi)]
    assert flat == [(i, b) for i, n in enumerate(sizes) for b in range(n)]
    shares = [sum(hi - lo for _, lo, hi in lane) for lane in segs]
    assert max(shares) - min(shares) <= 1                   # near-equal shares
