"""Ed25519 peer identities, and the DHT record signatures made with them.

Why: a membership record signed with an RSA-2048 identity is about 1,040 bytes, of which 391 are the owner key in
its subkey and 356 the signature; with Ed25519 the key is 32 bytes and the signature 64, and an entry is about 460
bytes. Every bucket a listing reads is that many entries, and an open swarm's get takes three copies of it
(docs/membership.md). So new identities are Ed25519; RSA identity files made before still work.

The key is the peer's libp2p identity (runtime/identity.py: the file p2pd runs with), so the peer id derives from
the record's owner key (`runtime.identity.peer_id_of_public`), and a record is bound to its peer as an RSA-signed
one is.

Records: the subkey holds `[ed25519:<base64 public key>]`, the value ends with `[ed25519sig:<base64 signature>]`
over msgpack (key, subkey, value without the signature, expiration), as hivemind's RSASignatureValidator does with
`[owner:...]` and `[signature:...]`. The markers differ from those on purpose: the RSA validator takes any
`[owner:...]` for an RSA key and strips any `[signature:...]`, so each validator passes the other's records by.
"""
from __future__ import annotations

import base64
import binascii
import functools
import re

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from gasloc.runtime.identity import Ed25519Identity

OWNER_FORMAT = b"[ed25519:%s]"
SIGNATURE_FORMAT = b"[ed25519sig:%s]"
# strict: exactly one base64 encoding of 32 bytes (a key) or 64 bytes (a signature); base64 has no brackets, so a
# marker cannot be nested in another
OWNER_RE = re.compile(rb"\[ed25519:([A-Za-z0-9+/]{43}=)\]")
SIGNATURE_RE = re.compile(rb"\[ed25519sig:([A-Za-z0-9+/]{86}==)\]")
SIGNATURE_BYTES = len(SIGNATURE_FORMAT % (b"A" * 88))   # what a signature adds to a value (101)


def owner_marker(public: bytes) -> bytes:
    return OWNER_FORMAT % base64.b64encode(public)


def _canonical_b64(text: bytes) -> bytes | None:
    """The bytes of a base64 text that is their one canonical encoding, else None: the last character of a key's
    43 carries two unused bits, so four texts decode to one key, and one peer could hold four subkeys."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if base64.b64encode(raw) == text else None


def owner_public(subkey: bytes) -> bytes | None:
    """The public key of the one `[ed25519:...]` marker in `subkey`; None if there is none, more than one, or it is
    not canonical base64."""
    found = OWNER_RE.findall(subkey)
    return _canonical_b64(found[0]) if len(found) == 1 else None


@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> Ed25519PublicKey:
    """Loaded once per owner: a swarm's records come from the same few thousand keys round after round."""
    return Ed25519PublicKey.from_public_bytes(raw)


def _signed_bytes(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps((record.key, record.subkey, record.value, record.expiration_time))


class Ed25519SignatureValidator(RecordValidatorBase):
    """Protected records for Ed25519 owners (module docstring): a record whose key or subkey holds an
    `[ed25519:...]` marker must carry exactly one signature by that key; other records pass (other validators
    judge them). Signs the records whose subkey holds our own marker."""

    def __init__(self, identity: Ed25519Identity):
        self.identity = identity
        self.local_public_key = owner_marker(identity.public)

    def validate(self, record: DHTRecord) -> bool:
        keys = OWNER_RE.findall(record.key) + OWNER_RE.findall(record.subkey or b"")
        if not keys:
            return True
        if len(set(keys)) > 1:
            return False
        signatures = SIGNATURE_RE.findall(record.value)
        if len(signatures) != 1:
            return False
        raw, signature = _canonical_b64(keys[0]), _canonical_b64(signatures[0])
        if raw is None or signature is None:
            return False
        try:
            public = _public_key(raw)
        except ValueError:
            return False
        stripped = DHTRecord(record.key, record.subkey, self.strip_value(record), record.expiration_time)
        try:
            public.verify(signature, _signed_bytes(stripped))
        except InvalidSignature:
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.local_public_key not in record.key and self.local_public_key not in (record.subkey or b""):
            return record.value
        signature = base64.b64encode(self.identity.sign(_signed_bytes(record)))
        return record.value + SIGNATURE_FORMAT % signature

    def strip_value(self, record: DHTRecord) -> bytes:
        return SIGNATURE_RE.sub(b"", record.value)

    @property
    def priority(self) -> int:
        # before the schema check (which parses the value), and before the RSA validator, whose strip_value would
        # otherwise run first on our records (it removes `[signature:...]` only; fixed order, fixed meaning)
        return 11

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # one instance per DHT node: a second one (another signer) would only verify the same way
        return isinstance(other, Ed25519SignatureValidator)
