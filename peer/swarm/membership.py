"""Who is in the swarm: each peer's signed, schema-checked DHT record, spread over bucket keys.

Layout (protocol/buckets.py): a peer's record lives under the bucket keys `<run_id>_m<level>_<bucket>` of its
level and the level below, the level following the swarm-size estimate (about 8 records a bucket); a reader lists
a bucket or two of its own level, never the whole swarm. One subkey per peer in each bucket: that peer's public
key, so only its owner can write it: an Ed25519 key (`Ed25519SignatureValidator`, peer/swarm/ed25519.py; every new
identity), or an RSA key of an identity file made before those (hivemind's RSASignatureValidator). Every value must
match `PeerRecord` exactly (`BucketSchemaValidator`: hivemind's SchemaValidator, with every bucket key mapped to the
one schema, strict types).

A record is bound to its owner: the key that signs it is the peer's libp2p identity key (the key file p2pd runs
with), so the subkey's public key determines the libp2p peer id, and `parse_listing` drops a record whose `peer_id`
is not the one its subkey derives to. Hence one subkey per identity, and no record can speak for another peer: a
forged record for a live victim is simply not the victim's, and the victim stays listed.
A record expires `ttl_s` after its last announcement; a peer re-announces every ttl/3 and, when it leaves, stores
None with a later expiration in every bucket it wrote (the DHT keeps the record with the latest expiration, so a
plain re-store with a shorter TTL would be ignored; see docs/hivemind.md §4).

The single key of gasloc before buckets (`<run_id>_peers`, every record under one key) is still validated and read
now and then, only to notice a peer of that older layout: it cannot see our records nor we its, so a mixed swarm
would split silently; instead the newer peer refuses to start, or logs an ERROR while running (`legacy_peers`).

What a record says beyond who wrote it (state, round, throughput, bandwidth) is its owner's claim: partner choice
weighs our own measured rates, never `bandwidth_bps`. Freshness comes from the DHT's expiration of the entry, never
from the self-declared `time`. The exchange layer still authenticates every caller by its transport identity.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import base58
import multihash
import pydantic.v1 as pv1
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator, conbytes
from hivemind.dht.validation import DHTRecord
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from gasloc import __version__
from gasloc.peer.swarm import ed25519
from gasloc.peer.swarm.ed25519 import Ed25519SignatureValidator
from gasloc.protocol.buckets import (
    MAX_LEVEL,
    SizeEstimate,
    bucket_of,
    buckets_to_read,
    level_for,
    listing_level,
    lookup_levels,
    writer_levels,
)
from gasloc.protocol.messages import WireMember
from gasloc.protocol.reach import MAX_VIA, RECORD_REACH
from gasloc.runtime.identity import Ed25519Identity, peer_id_of_public

log = logging.getLogger(__name__)

PEER_STATES: tuple[str, ...] = ("joining", "training", "exchanging")


class PeerRecord(pv1.BaseModel):
    """What a peer announces about itself. Strict types: the DHT schema check forbids any type conversion."""

    peer_id: pv1.StrictStr                      # libp2p id (base58) to dial for exchanges and state downloads
    protocol: pv1.StrictInt                     # wire protocol version; peers only pair with equal versions
    fingerprint: pv1.StrictStr                  # model/config fingerprint; peers only pair with equal ones
    state: pv1.StrictStr                        # one of PEER_STATES
    round: pv1.StrictInt                        # outer rounds this peer has completed
    throughput_tps: pv1.StrictFloat             # training tokens per second over the last inner phase
    bandwidth_bps: pv1.StrictFloat              # measured exchange bandwidth, bytes/s (0.0: not measured yet)
    time: pv1.StrictFloat                       # DHT (wall clock) time of this announcement
    # A record may also carry `view` (StatusView as a dict), for status views only. It is an extra field, not a
    # declared one: hivemind's schema check compares the parsed record, defaults included, with the stored value, so a
    # declared field with a default would make records of peers without it fail that check.

    class Config:
        # petals-style rolling upgrades: a newer peer may add fields; older peers must still accept its record
        extra = pv1.Extra.allow

    @pv1.validator("state")
    def _known_state(cls, v: str) -> str:
        if v not in PEER_STATES:
            raise ValueError(f"unknown peer state {v!r}")
        return v

    # NAT (protocol/reach.py): `reach`, `via`, `forwards` travel as extra fields, not declared ones - hivemind's
    # SchemaValidator refuses a record whose parse differs from what was stored, and a declared field with a
    # default would add itself to every record of a peer that predates it. So they are read here, with the
    # defaults of such a peer, and a malformed claim reads as the least that it could mean.
    @property
    def reach(self) -> str:
        """direct | relayed | outbound-only; absent: direct (an older peer); anything else: outbound-only."""
        v = self.__dict__.get("reach", "direct")
        return v if v in RECORD_REACH else "outbound-only"

    @property
    def via(self) -> list[str]:
        """Forwarders this peer is attached to (reach it through them)."""
        v = self.__dict__.get("via", [])
        return [f for f in v if isinstance(f, str)][:MAX_VIA] if isinstance(v, list) else []

    @property
    def forwards(self) -> bool:
        """It forwards streams for peers behind NAT that attach to it."""
        return self.__dict__.get("forwards") is True


class StatusView(pv1.BaseModel):
    """What a record tells status views (gasloc status) beyond what partner choice needs. All of it is the peer's
    own claim, like its round and throughput; nothing in the protocol relies on it."""
    loss: pv1.StrictFloat | None = None         # mean training loss of its last inner phase
    val_loss: pv1.StrictFloat | None = None     # its last validation loss
    round_s: pv1.StrictFloat | None = None      # mean wall time of its recent rounds
    partners: list[pv1.StrictStr] = []          # peer ids of its most recent ok exchanges, newest last (at most 4)
    version: pv1.StrictStr | None = None        # gasloc software version

    class Config:
        extra = pv1.Extra.allow  # later versions may add to it

    @pv1.validator("partners")
    def _few(cls, v: list[str]) -> list[str]:
        return v[-8:]  # a status view draws edges from it: a long list from a misbehaving peer is cut, not drawn


def status_view(record: PeerRecord) -> StatusView | None:
    """The record's StatusView; None when it has none (an older peer) or it does not parse (not trusted anyway)."""
    raw = getattr(record, "view", None)
    if not isinstance(raw, dict):
        return None
    # an extra key named like a model attribute (`dict`, `_iter`, ...) would shadow it on the instance, and the
    # status views' view.dict() would raise on another peer's record: such keys are dropped, not shown
    raw = {k: v for k, v in raw.items()
           if isinstance(k, str) and (k in StatusView.__fields__ or not hasattr(StatusView, k))}
    try:
        return StatusView.parse_obj(raw)
    except pv1.ValidationError:
        return None


# a subkey holding an owner's public key: RSA (hivemind's `[owner:...]`, its BytesWithPublicKey) or Ed25519
OwnerSubkey = conbytes(regex=b".*(?:" + RSASignatureValidator.PUBLIC_KEY_REGEX + b"|" + ed25519.OWNER_RE.pattern
                       + b").*")


class SwarmSchema(pv1.BaseModel):
    peers: dict[OwnerSubkey, PeerRecord | None]


# The keys a record of ours carries: PeerRecord's fields and the extras Membership.record writes. A newer peer's
# further extras are accepted too, by the full check (`plain_record` leaves them to it)
_FIELD_TYPES: dict[str, type] = {
    name: next(t for t in (str, int, float) if issubclass(f.type_, t)) for name, f in PeerRecord.__fields__.items()}
_RECORD_KEYS = frozenset(_FIELD_TYPES) | {"view", "reach", "via", "forwards"}


def plain_record(value: Any) -> bool:
    """A record value exactly as our peers write it: a dict of PeerRecord's fields, each of its exact type (str,
    int that is not bool, float), a known state, and no keys beyond the extras we write. Every such value passes
    hivemind's SchemaValidator with SwarmSchema (the pydantic v1 parse and its no-conversion comparison), which
    costs ~50 us a record against ~2 us here; anything else is left to that check (tests/unit/test_plain_record.py
    holds the two against each other)."""
    return (type(value) is dict and value.keys() <= _RECORD_KEYS
            and all(type(value.get(f)) is t for f, t in _FIELD_TYPES.items()) and value["state"] in PEER_STATES)


def _owner_subkey(subkey: Any) -> bool:
    """A subkey the schema's OwnerSubkey accepts as it is: bytes holding an `[owner:...]` or `[ed25519:...]` public
    key (its own regex check, which raises on a mismatch)."""
    if type(subkey) is not bytes:
        return False
    try:
        OwnerSubkey.match_regex(subkey)
    except ValueError:
        return False
    return True


def record_of(value: Any) -> PeerRecord:
    """A PeerRecord from a record value; pv1.ValidationError or TypeError when it is not one. A plain record
    (`plain_record`) is built without a second parse."""
    return PeerRecord.construct(**value) if plain_record(value) else PeerRecord.parse_obj(value)


def peers_key(run_id: str) -> str:
    """The single DHT key of the layout before buckets (SchemaValidator names it `<prefix>_<field>`): read only to
    notice a peer of that older layout (`legacy_peers`)."""
    return f"{run_id}_peers"


def bucket_key(run_id: str, level: int, bucket: int) -> str:
    """The DHT key of one bucket of records (protocol/buckets.py)."""
    return f"{run_id}_m{level}_{bucket}"


def record_digest(record: DHTRecord) -> bytes:
    """sha256 of a DHT record's bytes (key, subkey, value, expiration), length-prefixed so that no two records
    share one: the key of every cache of record checks (_CachedChecks here, admission.py's of inline records)."""
    h = hashlib.sha256(record.key)
    for part in (record.subkey or b"", record.value):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    h.update(repr(record.expiration_time).encode())
    return h.digest()


VALIDATION_CACHE = 8192   # records whose check result a DHT node keeps (a few buckets' worth, many times over)


class _CachedChecks:
    """The result of `validate` kept by the record's bytes (key, subkey, value, expiration): the DHT checks every
    entry of every replica's answer to every get (a bucket read from 5 replicas is 5 checks of each record, and the
    next listing reads many of the same records again), and each check is a signature verification or a pydantic
    parse. The result is a function of those bytes alone, so a record seen before costs a sha256 and a dict lookup."""

    def _cached(self, record, check) -> bool:
        cache = self.__dict__.setdefault("_checked", OrderedDict())
        k = record_digest(record)
        ok = cache.get(k)
        if ok is None:
            ok = cache[k] = bool(check(record))
            if len(cache) > VALIDATION_CACHE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(k)
        return ok


SIGNED_KEEP = 4096   # signed values the DHT node keeps of what it read, for signed hints (signed_hints.py)


class _SignedChecks(_CachedChecks):
    """A signature validator's checks, cached (_CachedChecks). It also keeps the signed bytes of each value it
    strips (the DHT strips a value only after its signature passed), so that a get run in the DHT process
    (`_signed_get`) can return records with their signatures: what a peer passes on as signed hints, checkable by
    anyone."""

    def validate(self, record) -> bool:
        return self._cached(record, super().validate)

    def strip_value(self, record) -> bytes:
        stripped = super().strip_value(record)
        if len(stripped) < len(record.value):
            kept = self.__dict__.setdefault("_signed", OrderedDict())
            kept[(record.key, record.subkey, record.expiration_time)] = record.value
            if len(kept) > SIGNED_KEEP:
                kept.popitem(last=False)
        return stripped

    def signed_value(self, key_id: bytes, subkey: bytes, expiration: float) -> bytes | None:
        return self.__dict__.get("_signed", {}).get((key_id, subkey, expiration))


class CachedSignatureValidator(_SignedChecks, RSASignatureValidator):
    """hivemind's RSASignatureValidator (signs with an RSA identity, checks RSA owners' signatures), cached."""


class CachedEd25519Validator(_SignedChecks, Ed25519SignatureValidator):
    """Ed25519SignatureValidator (signs with an Ed25519 identity, checks Ed25519 owners' signatures), cached."""


Signer = CachedEd25519Validator | CachedSignatureValidator   # what signs our records (make_validators)


class BucketSchemaValidator(_CachedChecks, SchemaValidator):
    """hivemind's SchemaValidator with every bucket key of every level (2**(MAX_LEVEL+1) - 1 of them) checked
    against SwarmSchema's one field, as the single key is: the same strict record check wherever a record lives.
    Results cached by the record's bytes (_CachedChecks)."""

    def __init__(self, run_id: str):
        super().__init__(SwarmSchema, prefix=run_id)
        self._field = field = next(iter(SwarmSchema.__fields__))
        # the keys whose records are SwarmSchema's (the fast path's); the map may also hold keys of validators
        # merged into this one (hivemind merges a node's SchemaValidators), which other schemas judge
        self._swarm_keys = {DHTID.generate(source=peers_key(run_id)).to_bytes()}
        for level in range(MAX_LEVEL + 1):
            for b in range(1 << level):
                key_id = DHTID.generate(source=bucket_key(run_id, level, b)).to_bytes()
                self._key_id_to_field_name[key_id] = field
                self._swarm_keys.add(key_id)

    def merge_with(self, other) -> bool:
        merged = super().merge_with(other)
        if merged and isinstance(other, BucketSchemaValidator):
            self._swarm_keys |= other._swarm_keys
        return merged

    def validate(self, record) -> bool:
        return self._cached(record, self._check)

    def _check(self, record: DHTRecord) -> bool:
        """A record of one of our keys whose subkey is an owner's key and whose value is None (a withdrawal) or a
        plain record is accepted here; hivemind's check decides everything else (and would accept these)."""
        if (record.subkey not in DHTProtocol.RESERVED_SUBKEYS and record.key in self._swarm_keys
                and self._key_id_to_field_name.get(record.key) == self._field):
            try:
                subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
            except Exception:  # noqa: BLE001 - not ours to judge: hivemind's check below says what it says
                subkey = value = None
            if _owner_subkey(subkey) and (value is None or plain_record(value)):
                return True
        try:
            return super().validate(record)
        except Exception as e:  # noqa: BLE001 - e.g. an extra key `dict` breaks pydantic v1's .dict(): refused
            log.debug("record_check_failed error=%s", type(e).__name__)
            return False


class IdentityError(ValueError):
    """The identity key file cannot sign records; one line that says why."""


Identity = Ed25519Identity | RSAPrivateKey


def load_identity(path: str | Path) -> Identity:
    """The key of a libp2p identity file (protobuf PrivateKey): Ed25519 (runtime/identity.py, every identity gasloc
    makes now) or RSA (hivemind's P2P.generate_identity, identity files made before)."""
    try:
        pb = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
    except OSError as e:
        raise IdentityError(f"cannot read identity file {path}: {e.strerror}") from None
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: the file is not a key, whatever broke
        raise IdentityError(f"identity file {path} is not a libp2p private key") from None
    if pb.key_type == crypto_pb2.KeyType.Ed25519:
        try:
            return Ed25519Identity.from_libp2p_data(pb.data)
        except ValueError as e:
            raise IdentityError(f"identity file {path} holds a malformed Ed25519 key: {e}") from None
    if pb.key_type != crypto_pb2.KeyType.RSA:
        raise IdentityError(f"identity file {path} holds a {crypto_pb2.KeyType.Name(pb.key_type)} key; gasloc "
                            f"peers need an Ed25519 or RSA identity (remove the file and a new one is made)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    try:
        # RSAPrivateKey has no constructor from bytes; its unpickling path loads exactly this DER encoding
        key.__setstate__({"_private_key": pb.data})
    except ValueError:
        raise IdentityError(f"identity file {path} holds a malformed RSA key") from None
    return key


@functools.lru_cache(maxsize=4096)
def peer_id_of(owner_subkey: bytes) -> str | None:
    """The libp2p peer id (base58) of the one owner key in a subkey, `[ed25519:...]` or `[owner:<ssh-rsa ...>]`;
    None if there is none, or more than one. libp2p's rule for RSA: sha2-256 multihash of the protobuf PublicKey
    holding the DER SubjectPublicKeyInfo (Ed25519: runtime/identity.py peer_id_of_public)."""
    if not isinstance(owner_subkey, bytes):
        return None
    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(owner_subkey)
    eds = ed25519.OWNER_RE.findall(owner_subkey)
    if len(found) + len(eds) != 1:
        return None
    if eds:
        public = ed25519.owner_public(owner_subkey)
        return peer_id_of_public(public) if public is not None else None
    try:
        public = RSAPublicKey.from_bytes(found[0])._public_key
    except (ValueError, TypeError):
        return None
    der = public.public_bytes(encoding=serialization.Encoding.DER,
                              format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def make_validators(run_id: str, identity: Identity | None = None) -> tuple[Signer, list]:
    """The record signer and the validators to give the DHT: both signature kinds (records of peers with either
    identity are read and checked) and the schema. A peer passes its libp2p identity key (so its records are bound
    to its peer id); a bootstrap, which announces nothing, may let a fresh key be made. The RSA validator of an
    Ed25519 peer only verifies: its key is a throwaway, never RSAPrivateKey.process_wide() (forked peers would
    share it)."""
    identity = identity or Ed25519Identity()
    ed = CachedEd25519Validator(identity if isinstance(identity, Ed25519Identity) else Ed25519Identity())
    rsa = CachedSignatureValidator(identity if isinstance(identity, RSAPrivateKey) else _verify_only_rsa_key())
    return (ed if isinstance(identity, Ed25519Identity) else rsa), [ed, rsa, BucketSchemaValidator(run_id)]


@functools.lru_cache(maxsize=1)
def _verify_only_rsa_key() -> RSAPrivateKey:
    """The key of an RSA validator that never signs (an Ed25519 peer's): made once per process (~50 ms), never
    used to sign, since no subkey of ours holds it."""
    return RSAPrivateKey()


# A get of a bucket asks the nearest GET_BEAM nodes, not hivemind's default beam of 20: a store writes to the 5
# nearest (hivemind's num_replicas), so the 3 nearest a reader sees are among them unless its view and the writer's
# differ by more than two nodes, and every node asked is one more RPC, parsed and checked in our DHT process and
# carried by our p2pd: 3 instead of 5 cut a listing's CPU by about a third (bench/scale.py, docs/scale-results.md).
# A single DHT node cannot hide a record from three: the answers are merged, and every record is signed.
# Each node asked sends its whole copy of the bucket: 3 copies on the wire (bench/scale.py's wire bytes).
GET_BEAM = 3
# In a private swarm every DHT node holds the swarm key, so no node is a stranger that could hide records: a get
# asks the nearest node alone, one copy on the wire. A bucket it answers empty is asked again of GET_BEAM nodes
# (BucketReader.read): the nearest node may have died, or joined since the records were stored.
TRUSTED_GET_BEAM = 1
# A peer at level 0 whose listings show nobody else probes every level again at most this often (11 small gets):
# alone in a small swarm, or stuck at level 0 in a large one (its probe came back empty).
REPROBE_S = 30.0


def listing_beam(private_swarm: bool) -> int:
    """How many DHT nodes a get of a bucket asks: the nearest alone among key holders, three among strangers."""
    return TRUSTED_GET_BEAM if private_swarm else GET_BEAM


# Our DHT node pushes no result of a get to the nearest node that lacked it (hivemind's cache_nearest=1): that is
# Kademlia's remedy for hot keys, and bucket keys are not hot; it cost one more store RPC per get, and a holder
# answers from such a cached snapshot in place of its own storage when the snapshot's expiration is later
DHT_CACHE_NEAREST = 0

# what an entry's signature adds to its value (the DHT strips it before we see a value): b"[signature:<344 base64
# chars>]" of an RSA-2048 one (356 bytes; 357 until 2026-12-04, one too many), ed25519.SIGNATURE_BYTES (101) of an
# Ed25519 one
SIGNATURE_BYTES = len(RSASignatureValidator.SIGNATURE_FORMAT.replace(b"_value_", b"A" * 344))


async def _signed_get(key: str, beam: int, _dht, node):
    """Run in the DHT process (DHT.run_coroutine): the get a listing does, plus, for each entry, its signed value
    bytes as the node read and checked them (the _SignedChecks validators: Ed25519 and RSA). Returns (found,
    {subkey: signed bytes}); an entry whose kept bytes are not exactly its value plus a signature gets none."""
    found = await node.get(key, latest=True, beam_size=beam)
    signed: dict[bytes, bytes] = {}
    checkers = [v for v in getattr(node.protocol.record_validator, "_validators", ()) if isinstance(v, _SignedChecks)]
    if checkers and found is not None and isinstance(found.value, dict):
        key_id = DHTID.generate(source=key).to_bytes()
        for subkey, entry in found.value.items():
            if entry.value is None:
                continue
            packed = MSGPackSerializer.dumps(subkey)
            raw = next((r for c in checkers if (r := c.signed_value(key_id, packed, entry.expiration_time))), None)
            if raw is not None and raw.startswith(MSGPackSerializer.dumps(entry.value)):
                signed[subkey] = raw
    return found, signed


def entry_bytes(found) -> int:
    """About how many bytes a DHT `get` result carried: each entry's subkey and value as msgpack, its signature
    and expiration. An estimate for metrics and bench/scale.py (the DHT strips signatures before we see values)."""
    if found is None or not isinstance(found.value, dict):
        return 0
    return sum(len(MSGPackSerializer.dumps(k)) + len(MSGPackSerializer.dumps(e.value)) + _signature_bytes(k) + 8
               for k, e in found.value.items())


def _signature_bytes(subkey) -> int:
    return ed25519.SIGNATURE_BYTES if isinstance(subkey, bytes) and b"[ed25519:" in subkey else SIGNATURE_BYTES


class BucketReader:
    """Reads the run's bucket keys: a few buckets of our level for a listing, every level once for a probe (at
    start: the level is unknown), one peer's buckets to confirm it (`find`), and keeps the swarm-size estimate
    those reads give. Coroutines for an event loop (the DHT calls return MPFutures, awaited without blocking).
    Counters for metrics and bench/scale.py: bytes_read (entry_bytes), gets."""

    def __init__(self, dht, *, run_id: str, request_timeout_s: float = 10.0, rng: random.Random | None = None,
                 beam: int = GET_BEAM):
        self.dht, self.run_id, self.request_timeout_s = dht, run_id, request_timeout_s
        self.beam = beam                          # DHT nodes a get asks (listing_beam)
        self.wide_retries = 0                     # buckets asked again of GET_BEAM nodes after an empty answer
        self.rng = rng or random.Random()
        self.estimate = SizeEstimate()
        self.level = 0
        self.peer_id: str | None = None           # our own record, when we have one (Membership): not company
        self._probed_at = -math.inf               # monotonic time of the last probe
        self.bytes_read = 0
        self.gets = 0
        self.expirations: dict[str, float] = {}   # peer id -> DHT expiration of its entry, as of the last read
        self.withdrawn: set[str] = set()          # peers whose withdrawal (None) the last read saw
        self._recent: list[int] = []              # buckets of our level read lately: the next listing reads others
        # where the signed records of our bucket reads go (owner, WireMember): signed hints (signed_hints.py
        # SignedRecords.keep); None: not kept, and reads take the plain get
        self.signed_sink: Callable[[str, WireMember], None] | None = None

    async def _get(self, key: str, *, signed: bool = False, beam: int | None = None):
        """A DHT get of one key, asking `beam` nodes (default: ours); None when it did not answer in time (which
        says nothing about who is alive). With `signed` (bucket reads), the records' signed bytes go to
        `signed_sink` (signed hints)."""
        self.gets += 1
        beam = beam or self.beam
        with_signed = signed and self.signed_sink is not None and hasattr(self.dht, "run_coroutine")
        try:
            async with asyncio.timeout(self.request_timeout_s):
                if with_signed:
                    found, raw = await self.dht.run_coroutine(functools.partial(_signed_get, key, beam),
                                                              return_future=True)
                else:
                    found = await self.dht.get(key, latest=True, return_future=True, beam_size=beam)
        except TimeoutError:
            log.warning("dht_get_timeout key=%s timeout_s=%.1f", key, self.request_timeout_s)
            return None, False
        self.bytes_read += entry_bytes(found)
        if with_signed:
            self._keep_signed(key, found, raw)
        return found, True

    def _keep_signed(self, key: str, found, raw: dict[bytes, bytes]) -> None:
        """Signed records of a bucket just read, as WireMembers (built without validation: our DHT node checked
        the signatures, and we only pass them on; every receiver checks them again)."""
        now = get_dht_time()
        for subkey, value in raw.items():
            entry = found.value.get(subkey)
            owner = peer_id_of(subkey)
            if entry is None or owner is None or entry.expiration_time <= now:
                continue
            self.signed_sink(owner, WireMember.model_construct(
                key=key, subkey=subkey.decode("ascii"), value=base64.b64encode(value).decode(),
                expiration=float(entry.expiration_time)))

    async def read(self, buckets: list[tuple[int, int]], *, sample: bool = True) -> dict[str, PeerRecord] | None:
        """Every valid, unexpired record in these (level, bucket)s; None if none of the gets was answered. With
        `sample`, each answered bucket adds to the size estimate."""
        results = await asyncio.gather(*(self._get(bucket_key(self.run_id, lv, b), signed=True)
                                         for lv, b in buckets))
        if self.beam < GET_BEAM:   # one node asked, and it had nothing: ask the wider beam before believing it
            empty = [i for i, (found, ok) in enumerate(results) if ok and found is None]
            self.wide_retries += len(empty)
            again = await asyncio.gather(*(self._get(bucket_key(self.run_id, *buckets[i]), signed=True,
                                                     beam=GET_BEAM) for i in empty))
            for i, result in zip(empty, again):
                results[i] = result
        now = get_dht_time()
        out: dict[str, PeerRecord] = {}
        answered = False
        self.withdrawn = set()
        for (lv, _b), (found, ok) in zip(buckets, results):
            if not ok:
                continue
            answered = True
            expirations: dict[str, float] = {}
            records = parse_listing(found, now=now, expirations=expirations, withdrawn=self.withdrawn)
            self.expirations.update(expirations)
            out.update(records)
            if sample:
                self.estimate.add(lv, len(records))
        if answered and sample:
            self.level = level_for(self.estimate.value, self.level)
        return out if answered else None

    async def probe(self) -> dict[str, PeerRecord] | None:
        """One random bucket of every level: records are only where writers are (a writer stores in its level
        and the one below), so the estimate restarts from the levels that hold any, each a sample (the median of
        them: a lone writer with a wild estimate, high up, moves it little)."""
        self._probed_at = time.monotonic()
        buckets = [(lv, self.rng.randrange(1 << lv)) for lv in range(MAX_LEVEL + 1)]
        results = await asyncio.gather(*(self._get(bucket_key(self.run_id, lv, b)) for lv, b in buckets))
        if not any(ok for _, ok in results):
            return None
        now = get_dht_time()
        out: dict[str, PeerRecord] = {}
        estimate = SizeEstimate()
        self.withdrawn = set()
        for (lv, _b), (found, ok) in zip(buckets, results):
            expirations: dict[str, float] = {}
            records = parse_listing(found, now=now, expirations=expirations, withdrawn=self.withdrawn) if ok else {}
            self.expirations.update(expirations)
            out.update(records)
            if records:
                estimate.add(lv, len(records))
        # Nothing at any level says nothing about the size: hivemind's get answers None when the nodes it asked
        # timed out, so a loaded DHT looks empty. Resetting to level 0 on that left a reader of a 100-member
        # swarm at level 0 (a CI run of bench/scale.py), whose buckets hold only level-0 and level-1 writers:
        # it would have listed nobody from then on. The estimate and level stand; a listing that shows nobody but us
        # probes again (listing).
        if estimate.samples:
            self.estimate = estimate
            self.level = level_for(estimate.value)
        log.debug("membership_probe estimate=%.0f level=%d", self.estimate.value, self.level)
        return out

    async def listing(self, count: int = 1) -> dict[str, PeerRecord] | None:
        """`count` random buckets of the level below ours (`listing_level`: each holds the copies of two of our
        level's buckets; at level 0 or 1 the one bucket of level 0 is the whole swarm), others than the last
        ones read. An answer with nobody but us sends us to `probe`: the swarm shrank, or our level is off (at
        level 0, where a lone peer lists only itself, at most every REPROBE_S: a reader stuck there in a large
        swarm would otherwise see only the few peers as lost as itself)."""
        lv = listing_level(self.level)
        picks = buckets_to_read(lv, count, self.rng, skip=self._recent)
        self._recent = (self._recent + picks)[-max(1, (1 << lv) // 2):]
        found = await self.read([(lv, b) for b in picks])
        alone = found is not None and not (found.keys() - {self.peer_id})
        if alone and (self.level > 0 or time.monotonic() - self._probed_at >= REPROBE_S):
            return await self.probe()
        return found

    async def find(self, peer_id: str) -> PeerRecord | None:
        """`peer_id`'s record, from its own bucket: at our level, then the levels around it (a writer whose
        estimate differs from ours by more than half). One get when the writer agrees with us."""
        for lv in lookup_levels(self.level):
            found = await self.read([(lv, bucket_of(peer_id, lv))], sample=False)
            if found and peer_id in found:
                return found[peer_id]
        return None

    async def legacy_peers(self) -> dict[str, PeerRecord] | None:
        """Live records under the single key of the layout before buckets: peers of an older gasloc, which
        cannot see us nor we them. An empty key costs a get of nothing."""
        found, ok = await self._get(peers_key(self.run_id))
        return parse_listing(found, now=get_dht_time()) if ok else None

    def prune(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """Records minus the entries whose DHT expiration has passed: what to believe between reads. (The record's
        own `time` is its owner's claim and decides nothing.)"""
        now = get_dht_time()
        return {pid: r for pid, r in records.items() if self.expirations.get(pid, 0.0) > now}


class Membership(BucketReader):
    """Announce, refresh and withdraw this peer's record, and read others' (BucketReader)."""

    def __init__(self, dht, signer: Signer, *, run_id: str, peer_id: str, fingerprint: str,
                 protocol: int, ttl_s: float, request_timeout_s: float = 10.0, rng: random.Random | None = None,
                 beam: int = GET_BEAM):
        super().__init__(dht, run_id=run_id, request_timeout_s=request_timeout_s, rng=rng, beam=beam)
        self.signer, self.subkey = signer, signer.local_public_key
        self.peer_id, self.fingerprint, self.protocol = peer_id, fingerprint, protocol
        self.ttl_s = ttl_s
        self._last_expiration = 0.0
        self._failed_in_a_row = 0
        self._written: dict[str, float] = {}   # bucket key -> when we last stored there (monotonic)
        self.inline: WireMember | None = None  # our last announced record as signed for our bucket (admission.py)
        # A DHT client (behind NAT, or a bench writer) answers nobody's gets, yet hivemind counts a copy in its own
        # storage as one of the stored replicas: with every server store timing out (a loaded swarm blacklists
        # them), a store "succeeded" that nobody else can read. So a client stores on servers only.
        self._store_kwargs = {"exclude_self": True} if getattr(dht, "client_mode", False) is True else {}

    @property
    def key(self) -> str:
        """Our bucket key at our level (for logs)."""
        return bucket_key(self.run_id, self.level, bucket_of(self.peer_id, self.level))

    def record(self, *, state: str, round: int, throughput_tps: float, bandwidth_bps: float, reach: str = "direct",
               via: list[str] | None = None, forwards: bool = False, **view: Any) -> PeerRecord:
        """Our record; `view` holds StatusView's fields (loss, val_loss, round_s, partners), `reach`/`via`/`forwards`
        what others need to call us from behind NAT (protocol/reach.py). A non-finite float goes out as None: the
        DHT's schema check compares values with ==, and NaN != NaN would make it drop the record."""
        view = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in view.items()}
        return PeerRecord(peer_id=self.peer_id, protocol=self.protocol, fingerprint=self.fingerprint, state=state,
                          round=int(round), throughput_tps=float(throughput_tps), bandwidth_bps=float(bandwidth_bps),
                          time=float(get_dht_time()), view=StatusView(version=__version__, **view).dict(),
                          reach=reach, via=list(via or [])[:MAX_VIA], forwards=forwards)

    def _keys(self) -> list[str]:
        return [bucket_key(self.run_id, lv, bucket_of(self.peer_id, lv)) for lv in writer_levels(self.level)]

    async def announce(self, record: PeerRecord) -> bool:
        """Store our record with expiration now + ttl in our buckets (our level's and the one below). False if no
        DHT node accepted it in any (logged, retried later)."""
        expiration = max(get_dht_time() + self.ttl_s, self._last_expiration + 1e-3)
        keys = self._keys()
        # what our exchange and state requests carry, so that a callee needs no lookup of us (admission.py)
        self.inline = signed_member(self.signer, keys[0], record.dict(), expiration)
        oks = await asyncio.gather(*(self._store(k, record.dict(), expiration) for k in keys))
        ok = any(oks)
        if ok:
            self._last_expiration = expiration
            self._failed_in_a_row = 0
            now = time.monotonic()
            self._written.update({k: now for k, stored in zip(keys, oks) if stored})
        else:
            # one replica refusing or not answering is routine (the next announce is due in ttl/3); only a run of
            # failures means others are about to lose sight of us
            self._failed_in_a_row += 1
            log.log(logging.WARNING if self._failed_in_a_row >= 3 else logging.DEBUG,
                    "announce_failed key=%s state=%s round=%d in_a_row=%d", keys[0], record.state, record.round,
                    self._failed_in_a_row)
        return ok

    async def withdraw(self) -> bool:
        """Leave every bucket we stored in within a TTL: None with an expiration later than any record we stored
        (a later expiration wins)."""
        expiration = max(get_dht_time(), self._last_expiration) + 1.0
        now = time.monotonic()
        keys = [k for k, at in self._written.items() if now - at < self.ttl_s + 1] or self._keys()
        oks = await asyncio.gather(*(self._store(k, None, expiration) for k in keys))
        log.info("withdrawn keys=%d ok=%s", len(keys), all(oks))
        return all(oks)

    async def _store(self, key: str, value, expiration: float) -> bool:
        try:
            async with asyncio.timeout(self.request_timeout_s):
                return bool(await self.dht.store(key, value, expiration, subkey=self.subkey, return_future=True,
                                                 **self._store_kwargs))
        except TimeoutError:
            log.warning("dht_store_timeout key=%s timeout_s=%.1f", key, self.request_timeout_s)
            return False

    def compatible(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """Peers we can pair with: same fingerprint and protocol, not us."""
        return compatible(records, peer_id=self.peer_id, fingerprint=self.fingerprint, protocol=self.protocol)


def signed_member(signer: Signer, key: str, record: dict, expiration: float) -> WireMember:
    """A record as bucket `key` holds it, signed as our DHT node signs it (with the same key): an inline
    membership record (peer/swarm/admission.py). One signature, once per announcement."""
    subkey = signer.local_public_key
    rec = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                    MSGPackSerializer.dumps(record), expiration)
    return WireMember(key=key, subkey=subkey.decode("ascii"), value=base64.b64encode(signer.sign_value(rec)).decode(),
                      expiration=float(expiration))


def parse_listing(found, now: float, expirations: dict[str, float] | None = None,
                  withdrawn: set[str] | None = None) -> dict[str, PeerRecord]:
    """peer_id -> record from a DHT `get` result (None, or a dict subkey -> ValueWithExpiration); withdrawn (None),
    expired, malformed entries and entries whose peer_id is not their subkey's owner are dropped. `expirations`,
    when given, receives each kept peer's DHT expiration; `withdrawn` the peer ids whose entry is a withdrawal.

    Each peer id has exactly one possible subkey (its own public key), so no two kept entries can claim one id."""
    out: dict[str, PeerRecord] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for subkey, entry in found.value.items():
        if entry.value is None and withdrawn is not None:
            pid = peer_id_of(subkey)
            if pid is not None:
                withdrawn.add(pid)
        if entry.value is None or entry.expiration_time <= now:
            continue
        try:
            rec = record_of(entry.value)
        except (pv1.ValidationError, TypeError):
            continue  # the DHT validators should have rejected it; a node without them may still serve it
        if peer_id_of(subkey) != rec.peer_id:
            log.debug("record_not_bound subkey_owner=%s claims=%s", peer_id_of(subkey), rec.peer_id)
            continue
        out[rec.peer_id] = rec
        if expirations is not None:
            expirations[rec.peer_id] = entry.expiration_time
    return out


def compatible(records: dict[str, PeerRecord], *, peer_id: str, fingerprint: str, protocol: int
               ) -> dict[str, PeerRecord]:
    return {pid: r for pid, r in records.items()
            if pid != peer_id and r.fingerprint == fingerprint and r.protocol == protocol}
