"""Property-based tests of every decoder in protocol/: random, mutated, truncated and oversized input is answered
with a Code (or a SwarmKeyError line), never an uncaught exception.

Each hypothesis example is a seed for a generator that makes a batch of BATCH frames, so that >= 10,000 frames
per decoder stay within seconds (drawing every frame through hypothesis' own strategies took minutes); a failure
is reported with the seed that produced it. Counters prove the frame counts.
"""
from __future__ import annotations

import json
import random
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gasloc.protocol.auth import EXCHANGE_CALL, SwarmKeyError, parse_swarm_key, proof_ok, stream_proof
from gasloc.protocol.claims import RoundClaims
from gasloc.protocol.codes import Code
from gasloc.protocol.donors import adopted_round, check_metadata
from gasloc.protocol.messages import (
    PROTOCOL_VERSION,
    ExchangeReply,
    ExchangeRequest,
    LaneHello,
    StateReply,
    StateRequest,
    TensorSpec,
    payload_bytes,
)
from gasloc.protocol.wire import (
    MAX_HEADER_BYTES,
    WireError,
    check_reply,
    check_request,
    check_state_reply,
    decode_header,
    encode_header,
    parse_length,
)

BATCH, EXAMPLES = 100, 100          # 10,000 frames per decoder
FAST = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SPECS = (TensorSpec(shape=(64, 32), dtype="float32"), TensorSpec(shape=(7,), dtype="float32"))
FP = "0123456789abcdef"
VALID = {
    ExchangeRequest: ExchangeRequest(protocol_version=PROTOCOL_VERSION, fingerprint=FP, round=3,
                                     codec="float32", specs=SPECS, total_bytes=payload_bytes(SPECS, "float32")),
    ExchangeReply: ExchangeReply(protocol_version=PROTOCOL_VERSION, code=0, fingerprint=FP, specs=SPECS,
                                 total_bytes=payload_bytes(SPECS, "float32"), token="t" * 32),
    LaneHello: LaneHello(protocol_version=PROTOCOL_VERSION, token="t" * 32, lane=1),
    StateRequest: StateRequest(protocol_version=PROTOCOL_VERSION, fingerprint=FP),
    StateReply: StateReply(protocol_version=PROTOCOL_VERSION, code=0, fingerprint=FP, specs=SPECS,
                           total_bytes=payload_bytes(SPECS), sha256="0" * 64, metadata={"round": 3}),
}
HEADERS = list(VALID)
counts: dict[str, int] = {}

def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, -(2**70), rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, -1e308, float("inf"), float("nan"), rng.random()])
    if kind in (4, 5):
        return "".join(rng.choice("ab\u00e9\"\\{}[]0 ") for _ in range(rng.randrange(20)))
    if kind in (6, 7):
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(rng.randrange(100)): _json_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def header_body(rng: random.Random) -> bytes:
    """A header body: random bytes, a random JSON object, or a valid header with one field changed or cut."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(200))
    if kind == 1:
        return json.dumps(_json_value(rng)).encode()
    body = json.loads(VALID[rng.choice(HEADERS)].model_dump_json())
    body[rng.choice(sorted(body))] = _json_value(rng)
    raw = json.dumps(body).encode()
    return raw[:rng.randrange(len(raw) + 1)] if kind == 3 else raw


def _count(name: str, n: int) -> None:
    counts[name] = counts.get(name, 0) + n


# a plain seeded Random: hypothesis' own st.randoms() draws every call from its data stream, which took minutes
RANDOMS = st.integers(0, 2**32 - 1).map(random.Random)


@FAST
@given(RANDOMS)
def test_length_prefix(rng):
    prefixes = [rng.randbytes(rng.randrange(9)) for _ in range(BATCH)]
    for p in prefixes:
        try:
            n = parse_length(p, max_header_bytes=4096)
            assert len(p) == 4 and 1 <= n <= 4096
        except WireError as e:
            assert e.code == Code.BAD_HEADER
    _count("parse_length", len(prefixes))


@FAST
@given(RANDOMS)
def test_header_decoder_and_checks(rng):
    frames = [(rng.choice(HEADERS), header_body(rng)) for _ in range(BATCH)]
    for cls, body in frames:
        try:
            header = decode_header(body, cls)
        except WireError as e:
            assert e.code in (Code.BAD_HEADER, Code.BAD_VERSION) and str(e)
            continue
        # whatever decoded must survive the checks that come next, each giving a Code
        if isinstance(header, ExchangeRequest):
            code, _ = check_request(header, expected_specs=SPECS, fingerprint=FP, max_bytes=1 << 20)
        elif isinstance(header, ExchangeReply):
            code, _ = check_reply(header, expected_specs=SPECS, fingerprint=FP, max_bytes=1 << 20)
        elif isinstance(header, StateReply):
            code, _ = check_state_reply(header, expected_specs=SPECS, outer_specs=None, fingerprint=FP,
                                        max_bytes=1 << 20)
        else:
            code = Code.OK
        assert isinstance(code, Code)
        assert len(encode_header(header)) <= MAX_HEADER_BYTES + 4   # what decoded re-encodes
    _count("decode_header", len(frames))


@FAST
@given(RANDOMS)
def test_code_parse(rng):
    values = [rng.randrange(-1000, 1000) for _ in range(BATCH)]
    for v in values:
        assert isinstance(Code.parse(v), Code)
        assert Code.parse(v) == (Code(v) if v in Code._value2member_map_ else Code.BAD_HEADER)
    _count("Code.parse", len(values))


@FAST
@given(RANDOMS)
def test_swarm_key_text(rng):
    alphabets = ["0123456789abcdefABCDEF \n", "0123456789abcdefxyz\u00e9\t", "0"]
    texts = ["".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.randrange(90))) for _ in range(BATCH)]
    for t in texts:
        try:
            key = parse_swarm_key(t)
            assert len(key) >= 32
        except SwarmKeyError as e:
            assert "\n" not in str(e) and str(e)
    _count("parse_swarm_key", len(texts))


KEY = bytes(range(32))


@FAST
@given(RANDOMS)
def test_stream_proofs(rng):
    good = stream_proof(KEY, EXCHANGE_CALL, "A", "B")
    proofs = ["".join(rng.choice("0123456789abcdef") for _ in range(rng.choice([63, 64, 64, 65])))
              for _ in range(BATCH)]
    proofs += [good[:i] + rng.choice("0123456789abcdef") + good[i + 1:] for i in range(0, 64, 8)]
    for p in proofs:
        assert proof_ok(KEY, p, EXCHANGE_CALL, "A", "B") is (p == good)
        assert proof_ok(None, p, EXCHANGE_CALL, "A", "B")        # an open swarm checks nothing
    assert proof_ok(KEY, good, EXCHANGE_CALL, "A", "B")
    assert not proof_ok(KEY, good, EXCHANGE_CALL, "B", "A")       # bound to the direction and both ids
    _count("proof_ok", len(proofs))


HOSTILE_ROUNDS = ["soon", -7, 10**9, 2**63, -(2**70), 3.0, True, None, [], {}, "3", float("nan"), 3]


def hostile_metadata(rng: random.Random) -> object:
    """A donor's metadata as a liar writes it: hostile values under the keys the joiner reads, keys missing or
    added, or no object at all."""
    if rng.random() < 0.05:
        return _json_value(rng)
    meta = {}
    for key in ("round", "num_outer", "peer_id"):
        if rng.random() < 0.7:
            meta[key] = rng.choice([*HOSTILE_ROUNDS, "QmDonor", "QmSomeoneElse", _json_value(rng)])
    for _ in range(rng.randrange(3)):
        meta[rng.choice(["x", "run", "z_prev", "\u00e9", "round "])] = _json_value(rng)
    return meta


@FAST
@given(RANDOMS)
def test_state_reply_metadata(rng):
    """Issue 29: the state reply's metadata is the donor's claim. Whatever it holds, the joiner's checks give a
    Code, and what passes gives the joiner an int round >= 0 that the header declared, and the stream's peer id."""
    base = json.loads(VALID[StateReply].model_dump_json())
    frames = []
    for _ in range(BATCH):
        body = dict(base, metadata=hostile_metadata(rng), round=rng.choice([0, 3, 7, 10**9, -7, "soon", 3.5]),
                    num_outer=rng.choice([0, 0, 1, -1, "x"]))
        frames.append(json.dumps(body).encode())
    for raw in frames:
        try:
            reply = decode_header(raw, StateReply)
        except WireError as e:
            assert e.code in (Code.BAD_HEADER, Code.BAD_VERSION)
            continue
        code, _ = check_state_reply(reply, expected_specs=SPECS, outer_specs=None, fingerprint=FP,
                                    max_bytes=1 << 20)
        assert isinstance(code, Code)
        code, why = check_metadata(reply.metadata, reply_round=reply.round, num_outer=reply.num_outer,
                                   donor="QmDonor")
        assert isinstance(code, Code) and (code == Code.OK) == (why == "")
        if code == Code.OK:
            meta = reply.metadata
            assert type(reply.round) is int and reply.round >= 0
            assert meta.get("round", reply.round) == reply.round and meta.get("peer_id", "QmDonor") == "QmDonor"
            r = adopted_round([reply.round], rng.choice([None, 0, 5, 10**6]))
            assert type(r) is int and r >= 0
    _count("state reply metadata", len(frames))


@FAST
@given(RANDOMS)
def test_round_claims(rng):
    """Round claims of every size, in any order: what we believe is an int >= 0, never above the claim, and a
    first sighting is never believed past the median of what we already believe plus the slack."""
    claims = RoundClaims(slack=3, speedup=4.0)
    own = 0
    n = 0
    for _ in range(BATCH // 10):
        listing = {f"p{rng.randrange(12)}": rng.choice([0, 1, rng.randrange(50), 10**9, 2**63])
                   for _ in range(rng.randrange(1, 8))}
        claims.observe(listing, own if rng.random() < 0.5 else None)
        for p, r in claims.believed(listing, own).items():
            assert type(r) is int and 0 <= r <= listing[p]
            n += 1
        own += rng.randrange(3)
    assert n > 0


def test_every_decoder_saw_ten_thousand_frames():
    # runs after the tests above in file order; a run of only this test has nothing to count
    ran = {k: v for k, v in counts.items()}
    if ran:
        assert all(v >= 10_000 for v in ran.values()), ran


def test_an_oversized_prefix_is_refused_before_the_body():
    for n in (4097, 1 << 20, 0xFFFFFFFF):
        try:
            parse_length(struct.pack(">I", n), max_header_bytes=4096)
        except WireError as e:
            assert e.code == Code.BAD_HEADER
        else:
            raise AssertionError(n)
