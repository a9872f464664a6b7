"""A caller's inline membership record: what a peer puts in its exchange and state requests (`signed_member`), and
how the callee checks it (`Admission.check`; the caller's side is `Membership.inline`) instead of looking the caller up in the DHT.

The record is exactly what the caller's bucket holds: the bucket key, the owner subkey (its Ed25519 or RSA public key), the
signed value and the expiration the signature covers. So the callee runs the DHT's own validators on it (the
signature checks, peer/swarm/ed25519.py and hivemind's RSASignatureValidator, and our BucketSchemaValidator: the checks every DHT node runs before storing a record), and
on top what a read of the bucket would tell: the key is a bucket of our run, the record is not expired, its owner
key's peer id is the stream's remote peer (libp2p authenticates that), the record names that peer id, and it has
our fingerprint and protocol (what `Membership.compatible` asks of a listed record). A private swarm's key is
checked by the stream proof, before this (a peer without the key could sign a record, but never store one).

A withdrawal in the DHT does not revoke an inline record: only its owner can present it, on a stream it opened,
so the caller is alive and calling; what a callee learns from it is that it was admitted to the run and when
that admission ends. That end is the owner's choice (the signature covers any expiration, a century away
included), so the network keeps an admitted record at most a few of its own TTLs (peer/swarm/network.py
`_join_view`, protocol/claims.py `expiry_cap`).

Checked records are cached by their signed bytes, so a caller that calls again (every round) costs a dict lookup,
not a signature verification.
"""
from __future__ import annotations

import base64
import binascii
import math
import re
from collections import OrderedDict

import pydantic.v1 as pv1
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from gasloc.peer.swarm.membership import PeerRecord, make_validators, peer_id_of, record_digest, record_of
from gasloc.protocol.buckets import MAX_LEVEL, bucket_of
from gasloc.protocol.messages import WireMember

CACHE_SIZE = 4096   # checked records kept (one per caller and announcement; a round re-uses the same one)


class Admission:
    """Checks inline records of callers for one run, configuration and protocol."""

    def __init__(self, run_id: str, *, fingerprint: str, protocol: int, validators: list | None = None):
        self.run_id, self.fingerprint, self.protocol = run_id, fingerprint, protocol
        # the peer's own DHT validators (a fresh key otherwise: we only validate here, never sign)
        self.validator = CompositeValidator(validators if validators is not None else make_validators(run_id)[1])
        self._key_re = re.compile(rf"^{re.escape(run_id)}_m(\d{{1,2}})_(\d{{1,4}})$")
        self._cache: OrderedDict[bytes, PeerRecord] = OrderedDict()
        self.verified = 0      # signature verifications done (cache misses that got that far), for tests and the bench

    def check(self, caller: str, member: WireMember, now: float) -> tuple[PeerRecord | None, str]:
        """(the caller's record, "") when `member` admits `caller` at DHT time `now`, else (None, why). Cheap checks
        first, so a forged or foreign record costs no signature verification."""
        m = self._key_re.match(member.key)
        if m is None:
            return None, "record is not under a bucket key of this run"
        try:
            subkey = member.subkey.encode("ascii")
            value = base64.b64decode(member.value, validate=True)
        except (UnicodeEncodeError, binascii.Error, ValueError):
            return None, "record is not base64 / ASCII"
        if peer_id_of(subkey) != caller:       # lru-cached: a caller's key is parsed once
            return None, "record belongs to another peer"
        level, bucket = int(m.group(1)), int(m.group(2))
        if level > MAX_LEVEL or bucket >= 1 << level or bucket != bucket_of(caller, level):
            return None, "record is not in the caller's bucket"
        if not math.isfinite(member.expiration) or member.expiration <= now:
            return None, "record expired"
        record = DHTRecord(DHTID.generate(source=member.key).to_bytes(), MSGPackSerializer.dumps(subkey), value,
                           member.expiration)
        cache_key = record_digest(record)
        rec = self._cache.get(cache_key)
        if rec is None:
            self.verified += 1
            try:
                if not self.validator.validate(record):
                    return None, "signature or schema invalid"
                rec = record_of(MSGPackSerializer.loads(self.validator.strip_value(record)))
            except (pv1.ValidationError, TypeError, ValueError):   # a malformed value the validators let by
                return None, "record does not parse"
            except Exception:  # noqa: BLE001 - msgpack / key parsing of hostile bytes raise many kinds
                return None, "record does not parse"
            self._cache[cache_key] = rec
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(cache_key)
        if rec.peer_id != caller:
            return None, "record names another peer id"
        if rec.fingerprint != self.fingerprint or rec.protocol != self.protocol:
            return None, "record of another configuration or protocol"
        return rec, ""
