"""Wire headers of the pairwise exchange and of the state download, as versioned pydantic models.

Headers are small JSON objects; tensors never travel inside them. A header describes the raw bytes that follow it
on the stream: one tensor after another, each in the header's codec (protocol/codec.py: a cast's C-contiguous
little-endian values, or a blockwise codec's scales and packed codes); a state download's in the specs' dtypes.

Rolling upgrades: a model ignores fields it does not know (a newer peer may add some) but validates every field it
knows, strictly (no "1" for 1). A change that an older peer cannot ignore bumps PROTOCOL_VERSION.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gasloc.protocol.codes import Code

# A run id prefixes the run's DHT keys; peers and bootstrap nodes of one run must spell it the same.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_run_id(v: str) -> str:
    if not RUN_ID_PATTERN.match(v):
        raise ValueError("run_id must be 1-64 letters, digits, '-' or '_'")
    return v

# 2: membership records may be signed with Ed25519 identities (peer/swarm/ed25519.py), which peers of protocol 1
# refuse to hold; each side sees the other's records as another protocol (Network._check_protocols)
# 3: exchange headers name a codec (protocol/codec.py) instead of a wire dtype, and an OK reply carries a seed
# 4: a mix's outer momentum carries the share its codec brings (protocol/codec.py MIX_MOMENTUM: 0.5 for the default
# mod4-sd, 0 for mod3-sd and two sparse codes), where peers of 3 carried all of it for every codec but mod4-sd: two
# sides that carry different shares move the swarm's mean, so the two do not pair
# 5: a modulo code's rounding offsets come from protocol/codec.py modulo_dither (one draw a position of a chunk and one
# a chunk, not one a value): a peer of 4 would round against other offsets than its partner of 5 with the same seed,
# so the shared dither of the default mod4-sd would quietly become independent rounding between the two
PROTOCOL_VERSION = 5

# dtypes a tensor may have in a header, with their size in bytes. Anything else is BAD_DTYPE.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

MAX_CODEC_CHARS = 32      # a codec's name (protocol/codec.py); anything longer is no codec of ours
MAX_TENSORS = 100_000      # more tensors than this in one header is garbage, whatever the model
# a modulo codec's probe (protocol/codec.py): base64 of at most 64 float32 values a tensor
MAX_PROBE_CHARS = -(-4 * 64 * MAX_TENSORS // 3) * 4
MAX_DIMS = 8
MAX_STREAMS = 64           # parallel streams ("lanes") one exchange may use; each costs the responder a buffer


class _Wire(BaseModel):
    # extra="ignore": tolerate fields from newer peers; strict: never coerce a known field's type
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class TensorSpec(_Wire):
    """Shape and dtype of one tensor (its dtype on the sender's side, before any wire cast)."""
    shape: tuple[int, ...] = Field(description="dimensions, each >= 0", max_length=MAX_DIMS)
    dtype: str = Field(description="torch dtype name without 'torch.', e.g. float32", max_length=16)

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 for d in v):
            raise ValueError("negative dimension")
        return v

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, shape: Sequence[int], dtype: Any) -> TensorSpec:
        """From a (shape, dtype) pair where dtype is a torch.dtype or its name."""
        return cls(shape=tuple(int(d) for d in shape), dtype=dtype_name(dtype))


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32 or 'float32' (no torch import needed here)."""
    return str(dtype).removeprefix("torch.")


def specs_of(pairs: Sequence[tuple[Sequence[int], Any]]) -> list[TensorSpec]:
    """TensorSpecs from (shape, dtype) pairs."""
    return [TensorSpec.of(shape, dtype) for shape, dtype in pairs]


def payload_bytes(specs: Sequence[TensorSpec], wire_dtype: str | None = None) -> int:
    """Bytes on the wire for these tensors, each cast to `wire_dtype` (None: sent in its own dtype)."""
    return sum(s.numel * DTYPE_BYTES[wire_dtype or s.dtype] for s in specs)


MAX_WIRE_HINTS = 8   # protocol/buckets.py MAX_HINTS: peers one header tells about


class WireHint(_Wire):
    """Peer exchange (protocol/buckets.py): a live peer the sender saw recently, with its state and round (claims)."""
    peer_id: str = Field(min_length=1, max_length=64)
    state: str = Field(max_length=16)
    round: int = Field(ge=0)


Hints = tuple[WireHint, ...]

# caps of an inline membership record (docs/membership.md): a real one is ~1.9 KB of JSON with an RSA-2048
# identity (a 1 KB signed value, a 380-byte owner subkey), ~0.7 KB with an Ed25519 one; anything far longer is
# garbage we need not parse
MAX_MEMBER_KEY_CHARS = 96
MAX_MEMBER_SUBKEY_CHARS = 1024
MAX_MEMBER_VALUE_CHARS = 4096


class WireMember(_Wire):
    """The caller's own signed DHT membership record, as its bucket holds it: the callee checks it (signature
    under the subkey's owner key, that key's peer id = the stream's remote peer, schema, run id, expiration) instead
    of looking the caller up in the DHT. Every field is the caller's claim until those checks pass."""
    key: str = Field(min_length=1, max_length=MAX_MEMBER_KEY_CHARS, description="the bucket key it is stored under")
    subkey: str = Field(min_length=1, max_length=MAX_MEMBER_SUBKEY_CHARS,
                        description="its DHT subkey: the owner's public key, b'[ed25519:<key>]' or "
                                    "b'[owner:<RSA public key>]', as ASCII text")
    value: str = Field(min_length=1, max_length=MAX_MEMBER_VALUE_CHARS,
                       description="base64 of the signed value bytes (msgpack record + its signature)")
    expiration: float = Field(description="the DHT expiration time the signature covers")


# the longest inline record a header may carry: what header caps are computed from
WIDEST_MEMBER = WireMember(key="k" * MAX_MEMBER_KEY_CHARS, subkey="s" * MAX_MEMBER_SUBKEY_CHARS,
                           value="v" * MAX_MEMBER_VALUE_CHARS, expiration=2.0**62)

# signed hints (docs/membership.md): an exchange reply carries up to this many signed records of the peers it
# hints at, ready ones first, so the initiator checks a hinted peer's record instead of looking it up in the DHT
MAX_WIRE_MEMBERS = 4
WIDEST_MEMBERS = (WIDEST_MEMBER,) * MAX_WIRE_MEMBERS


class ExchangeRequest(_Wire):
    """Initiator -> responder: "I want to exchange; this is what I will send once you accept"."""
    kind: Literal["exchange"] = "exchange"
    protocol_version: int = Field(description="PROTOCOL_VERSION of the sender")
    fingerprint: str = Field(max_length=128, description="compatibility hash, see fingerprint()")
    round: int = Field(ge=0, description="sender's outer round, for logs only (there is no global round)")
    codec: str = Field(max_length=MAX_CODEC_CHARS, description="protocol/codec.py name of the payload's codec")
    specs: tuple[TensorSpec, ...] = Field(max_length=MAX_TENSORS, description="the tensors that will follow")
    total_bytes: int = Field(ge=0, description="exact byte count of the payload that follows")
    streams: int = Field(1, ge=1, description="how many parallel streams carry the payloads (this one included)")
    auth: str = Field("", max_length=64, description="private swarm: the sender's proof of the swarm key "
                      "(protocol/auth.py); empty in an open swarm")
    peers: Hints = Field((), max_length=MAX_WIRE_HINTS, description="peer exchange: live peers the sender saw")
    member: WireMember | None = Field(None, description="the sender's own signed membership record (None: an "
                                      "older caller; the callee then looks it up in the DHT)")
    members_wanted: int = Field(0, ge=0, le=MAX_WIRE_MEMBERS, description="signed hints: how many signed records "
                                "of hinted peers the reply may carry (0: an older caller, whose reply cap has no "
                                "room for them)")
    probe_seed: int = Field(0, ge=0, lt=2**63, description="a modulo codec: the seed of the probe positions "
                            "(protocol/codec.py probe_positions), the caller's choice")
    probe: str = Field("", max_length=MAX_PROBE_CHARS, description="a modulo codec: the sender's values at the probe "
                       "positions (base64 float32), from which both sides size the codec's step")


class ExchangeReply(_Wire):
    """Responder -> initiator: a code; with OK, the description of the responder's own tensors."""
    kind: Literal["exchange_reply"] = "exchange_reply"
    protocol_version: int
    code: int = Field(ge=0, le=255, description="a Code value")
    message: str = Field("", max_length=512, description="human-readable reason, for logs")
    fingerprint: str = Field("", max_length=128)
    round: int = Field(0, ge=0)
    codec: str = Field("float32", max_length=MAX_CODEC_CHARS, description="the codec of the responder's payload")
    seed: int = Field(0, ge=0, lt=2**63, description="with OK: the seed a sparse codec picks both sides' blocks "
                      "with (protocol/codec.py block_choice); the responder's choice")
    specs: tuple[TensorSpec, ...] = Field((), max_length=MAX_TENSORS)
    total_bytes: int = Field(0, ge=0)
    token: str = Field("", max_length=64, description="with OK and streams > 1: what each extra stream presents")
    auth: str = Field("", max_length=64, description="private swarm: the sender's proof of the swarm key "
                      "(protocol/auth.py); empty in an open swarm")
    peers: Hints = Field((), max_length=MAX_WIRE_HINTS, description="peer exchange: live peers the sender saw")
    members: tuple[WireMember, ...] = Field((), max_length=MAX_WIRE_MEMBERS, description="signed hints: signed "
                                            "records of peers in `peers` (each checked before use, like a caller's)")
    probe: str = Field("", max_length=MAX_PROBE_CHARS, description="with OK and a modulo codec: the responder's "
                       "values at the caller's probe positions")


class LaneHello(_Wire):
    """Initiator -> responder, first frame of each extra stream of an accepted exchange."""
    kind: Literal["lane"] = "lane"
    protocol_version: int
    token: str = Field(max_length=64, description="the token of the responder's OK reply")
    lane: int = Field(ge=1, lt=MAX_STREAMS, description="index of this stream; the first stream is lane 0")


class StateRequest(_Wire):
    """Joiner -> donor: "send me your current state"."""
    kind: Literal["state"] = "state"
    protocol_version: int
    fingerprint: str = Field(max_length=128)
    auth: str = Field("", max_length=64, description="private swarm: the sender's proof of the swarm key "
                      "(protocol/auth.py); empty in an open swarm")
    peers: Hints = Field((), max_length=MAX_WIRE_HINTS, description="peer exchange: live peers the sender saw")
    member: WireMember | None = Field(None, description="the sender's own signed membership record (None: an "
                                      "older caller; the donor then looks it up in the DHT)")


class StateReply(_Wire):
    """Donor -> joiner: a code; with OK, the description of the state that follows (in the donor's dtypes)."""
    kind: Literal["state_reply"] = "state_reply"
    protocol_version: int
    code: int = Field(ge=0, le=255)
    message: str = Field("", max_length=512)
    fingerprint: str = Field("", max_length=128)
    round: int = Field(0, ge=0, description="the donor's outer round")
    num_outer: int = Field(0, ge=0, description="how many of the trailing tensors are outer-optimizer state")
    metadata: dict[str, Any] = Field(default_factory=dict, description="JSON metadata from the donor")
    specs: tuple[TensorSpec, ...] = Field((), max_length=MAX_TENSORS)
    total_bytes: int = Field(0, ge=0)
    sha256: str = Field("", max_length=64, description="hex sha256 of the payload bytes")
    auth: str = Field("", max_length=64, description="private swarm: the sender's proof of the swarm key "
                      "(protocol/auth.py); empty in an open swarm")
    peers: Hints = Field((), max_length=MAX_WIRE_HINTS, description="peer exchange: live peers the sender saw")


def fingerprint(**parts: Any) -> str:
    """A short stable hash of everything that must match for two peers to mix tensors.

    The caller passes the parts (model preset, seq_len, vocab size, algorithm, form, ...); key order does not
    matter, values must be JSON-serializable. 16 hex digits: a collision between two real configs is not a concern.
    """
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reply_code(reply: ExchangeReply | StateReply) -> Code:
    return Code.parse(reply.code)
