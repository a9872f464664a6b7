"""Framing and validation of wire headers. Sans-I/O: bytes in, models and Codes out.

Frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON (one of the models in `messages`). The length
is checked against MAX_HEADER_BYTES before a single body byte is read, so a peer cannot make us buffer a huge
header. Tensor bytes follow the header raw, as it describes them.

The checks return a Code instead of raising, so the I/O layer can answer it on the wire. Their order is part of the
contract (tests pin it): version, fingerprint, wire dtype, declared size, count and shapes, dtypes, consistency.
The declared size is checked before the shapes so that an oversized declaration is always TOO_LARGE.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from gasloc.protocol.codec import FALLBACK_CODEC, Codec, CodecError, read_probe, sent_codec
from gasloc.protocol.codec import parse as parse_codec
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import (
    DTYPE_BYTES,
    MAX_STREAMS,
    PROTOCOL_VERSION,
    ExchangeReply,
    ExchangeRequest,
    StateReply,
    TensorSpec,
    payload_bytes,
)

LENGTH_PREFIX_BYTES = 4
MAX_HEADER_BYTES = 1 << 20   # 1 MiB: the most any header may be; a receiver caps far lower (header_cap)
HEADER_SLACK_BYTES = 2048    # room above our own header's size for a peer's longer strings and newer fields
SMALL_HEADER_BYTES = 4096    # cap of headers that carry no tensor specs (a lane hello, a refusal)
STATE_REQUEST_BYTES = 8192   # a state request: SMALL_HEADER_BYTES + the caller's inline record (WireMember, <= 5.2 KB)
_LENGTH = struct.Struct(">I")

H = TypeVar("H", bound=BaseModel)


class WireError(Exception):
    """A received frame is unacceptable; `code` is what to answer."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code


def encode_header(header: BaseModel) -> bytes:
    """Length prefix + compact JSON of a header model."""
    body = header.model_dump_json().encode()
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(body)} bytes exceeds MAX_HEADER_BYTES={MAX_HEADER_BYTES}")
    return _LENGTH.pack(len(body)) + body


def header_cap(own_header: BaseModel) -> int:
    """What we read of a partner's header that describes the same tensors as `own_header` (ours, fully filled):
    its size plus some slack. A compatible partner's header is about as long as ours, so anything much longer is
    garbage we need not buffer (a 1 MiB cap would let every caller make us parse 1 MiB of JSON)."""
    return min(MAX_HEADER_BYTES, len(own_header.model_dump_json().encode()) + HEADER_SLACK_BYTES)


def parse_length(prefix: bytes, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """The body length announced by a 4-byte prefix; WireError(BAD_HEADER) when empty or over the cap."""
    if len(prefix) != LENGTH_PREFIX_BYTES:
        raise WireError(Code.BAD_HEADER, f"length prefix has {len(prefix)} bytes, expected {LENGTH_PREFIX_BYTES}")
    (n,) = _LENGTH.unpack(prefix)
    if n == 0 or n > max_header_bytes:
        raise WireError(Code.BAD_HEADER, f"header length {n} outside 1..{max_header_bytes}")
    return n


def decode_header(body: bytes, cls: type[H]) -> H:
    """Parse a header body into `cls`. BAD_VERSION for another protocol version, BAD_HEADER for anything malformed.

    The version is looked at before the full validation so that a peer on another version gets BAD_VERSION even if
    its header has a different shape.
    """
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(Code.BAD_HEADER, f"header is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise WireError(Code.BAD_HEADER, "header is not a JSON object")
    version = raw.get("protocol_version")
    if type(version) is not int:
        raise WireError(Code.BAD_HEADER, "header has no integer protocol_version")
    if version != PROTOCOL_VERSION:
        raise WireError(Code.BAD_VERSION, f"protocol_version {version}, this peer speaks {PROTOCOL_VERSION}")
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "header"
        raise WireError(Code.BAD_HEADER, f"{cls.__name__}.{where}: {first['msg']}") from None


def _check_specs(fingerprint_got: str, specs: Sequence[TensorSpec], total_bytes: int, *,
                 expected_specs: Sequence[TensorSpec], fingerprint: str, max_bytes: int) -> tuple[Code, str]:
    if fingerprint_got != fingerprint:
        return Code.BAD_FINGERPRINT, f"fingerprint {fingerprint_got!r} != ours {fingerprint!r}"
    if total_bytes > max_bytes:
        return Code.TOO_LARGE, f"declared {total_bytes} bytes > cap {max_bytes}"
    if len(specs) != len(expected_specs):
        return Code.BAD_SHAPE, f"{len(specs)} tensors, expected {len(expected_specs)}"
    for i, (got, want) in enumerate(zip(specs, expected_specs)):
        if got.shape != want.shape:
            return Code.BAD_SHAPE, f"tensor {i} has shape {list(got.shape)}, expected {list(want.shape)}"
        if got.dtype != want.dtype:
            return Code.BAD_DTYPE, f"tensor {i} has dtype {got.dtype}, expected {want.dtype}"
    return Code.OK, ""


def _check_exchange(fingerprint_got: str, codec_name: str, specs: Sequence[TensorSpec], total_bytes: int, *,
                    expected_specs: Sequence[TensorSpec], fingerprint: str, max_bytes: int,
                    codec: Codec | None, probe: str = "", sent: bool = False) -> tuple[Code, str]:
    """An exchange header's payload: our specs, in a codec we read, exactly the bytes that codec makes of them; a
    modulo codec's probe of exactly its size, finite. What each side then sends follows from the two codecs
    (`sent_codec`: a modulo peer sends FALLBACK_CODEC to a partner of another codec); a sparse codec needs the same
    on both sides (both send the same blocks). `sent`: the header names what the partner sends (a reply), not its
    own codec: a modulo one must then be ours (an honest responder falls back)."""
    code, why = _check_specs(fingerprint_got, specs, total_bytes, expected_specs=expected_specs,
                             fingerprint=fingerprint, max_bytes=max_bytes)
    if code != Code.OK:
        return code, why
    try:
        theirs = parse_codec(codec_name)
    except CodecError as e:
        return Code.BAD_DTYPE, str(e)
    if codec is not None:
        if sent and theirs.modulo and theirs != codec:
            return Code.BAD_DTYPE, (f"codec {theirs.name!r} with ours {codec.name!r}: a modulo codec is decoded "
                                    f"against our own codes; a responder of another codec sends {FALLBACK_CODEC}")
        ours_sent, theirs_sent = sent_codec(codec, theirs), theirs if sent else sent_codec(theirs, codec)
        if (theirs_sent.sparse or ours_sent.sparse) and theirs_sent != ours_sent:
            return Code.BAD_DTYPE, (f"codec {theirs.name!r} with ours {codec.name!r}: a sparse codec needs the same "
                                    "on both sides")
    want = theirs.payload_bytes([s.numel for s in specs])
    if total_bytes != want:
        return Code.BAD_HEADER, f"total_bytes {total_bytes} != {want} that codec {theirs.name} makes of the specs"
    if theirs.modulo:
        try:
            read_probe(probe, [s.numel for s in specs])
        except CodecError as e:
            return Code.BAD_HEADER, f"codec {theirs.name}: {e}"
    return Code.OK, ""


def check_request(req: ExchangeRequest, *, expected_specs: Sequence[TensorSpec], fingerprint: str,
                  max_bytes: int, codec: Codec | None = None) -> tuple[Code, str]:
    """Whether a responder (sending in `codec`) may accept this request (membership and busyness are the caller's
    checks)."""
    if req.streams > MAX_STREAMS:
        return Code.BAD_HEADER, f"{req.streams} streams requested, at most {MAX_STREAMS}"
    return _check_exchange(req.fingerprint, req.codec, req.specs, req.total_bytes, expected_specs=expected_specs,
                           fingerprint=fingerprint, max_bytes=max_bytes, codec=codec, probe=req.probe)


def check_reply(reply: ExchangeReply, *, expected_specs: Sequence[TensorSpec], fingerprint: str,
                max_bytes: int, codec: Codec | None = None) -> tuple[Code, str]:
    """Whether an initiator (sending in `codec`) may receive what this reply announces. A non-OK reply returns its
    own code."""
    if reply.code != Code.OK:
        return Code.parse(reply.code), reply.message
    return _check_exchange(reply.fingerprint, reply.codec, reply.specs, reply.total_bytes,
                           expected_specs=expected_specs, fingerprint=fingerprint, max_bytes=max_bytes, codec=codec,
                           probe=reply.probe, sent=True)


def check_state_reply(reply: StateReply, *, expected_specs: Sequence[TensorSpec],
                      outer_specs: Sequence[TensorSpec] | None, fingerprint: str,
                      max_bytes: int) -> tuple[Code, str]:
    """Whether a joiner may receive the state this reply announces.

    The donor sends its parameters, then (`num_outer` > 0) its outer-optimizer state. A joiner that passes
    `outer_specs` accepts either; a joiner that passes None accepts parameters only.
    """
    if reply.code != Code.OK:
        return Code.parse(reply.code), reply.message
    if reply.num_outer and outer_specs is None:
        return Code.BAD_SHAPE, f"donor sends {reply.num_outer} outer-state tensors, none expected"
    expected = list(expected_specs) + (list(outer_specs) if reply.num_outer and outer_specs else [])
    if reply.num_outer and reply.num_outer != len(outer_specs or ()):
        return Code.BAD_SHAPE, f"donor sends {reply.num_outer} outer-state tensors, expected {len(outer_specs or ())}"
    if any(s.dtype not in DTYPE_BYTES for s in reply.specs):
        return Code.BAD_DTYPE, "unknown dtype in state specs"
    code, why = _check_specs(reply.fingerprint, reply.specs, reply.total_bytes, expected_specs=expected,
                             fingerprint=fingerprint, max_bytes=max_bytes)
    if code == Code.OK and reply.total_bytes != payload_bytes(reply.specs):
        return Code.BAD_HEADER, f"total_bytes {reply.total_bytes} != {payload_bytes(reply.specs)} implied by specs"
    if code == Code.OK and len(reply.sha256) != 64:
        return Code.BAD_HEADER, "state reply without a sha256 checksum"
    return code, why


# ---- splitting a payload over parallel streams ("lanes") ----
# One yamux stream moves at most its flow-control window per round trip (256 KiB until p2pd grows it), so a single
# stream cannot fill a link whose round trip is long or whose queues are deep; a few parallel streams can. Both
# sides derive the same split from the byte count and the lane count, so nothing about it travels on the wire.

Segment = tuple[int, int, int]     # (tensor index, first byte, end byte) within that tensor's wire bytes


def lane_count(total_bytes: int, max_streams: int, min_stream_bytes: int) -> int:
    """Lanes for a payload: one per `min_stream_bytes`, between 1 and `max_streams`."""
    return max(1, min(max_streams, MAX_STREAMS, total_bytes // max(1, min_stream_bytes)))


def lane_segments(tensor_bytes: Sequence[int], lanes: int) -> list[list[Segment]]:
    """Split the concatenated tensors into `lanes` contiguous, near-equal byte ranges, as per-tensor segments.

    Every byte belongs to exactly one lane, in order; a lane may span several tensors or part of one.
    """
    total = sum(tensor_bytes)
    bounds = [total * k // lanes for k in range(lanes + 1)]
    starts = [sum(tensor_bytes[:i]) for i in range(len(tensor_bytes))]
    out: list[list[Segment]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        segs = []
        for i, (start, size) in enumerate(zip(starts, tensor_bytes)):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                segs.append((i, a - start, b - start))
        out.append(segs)
    return out
