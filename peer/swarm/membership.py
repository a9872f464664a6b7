"""Who is in the swarm: each peer's signed, schema-checked DHT record under the run's key.

One DHT key per run (`<run_id>_peers`), one subkey per peer: that peer's RSA public key, so only its owner can
write it (RSASignatureValidator). Every value must match `PeerRecord` exactly (SchemaValidator, strict types).
A record expires `ttl_s` after its last announcement; a peer re-announces every ttl/3 and, when it leaves, stores
None with a later expiration (the DHT keeps the record with the latest expiration, so a plain re-store with a shorter
TTL would be ignored; see docs/hivemind.md §4).

The listing is what a peer believes about the swarm, nothing more: a record proves that its owner held the signing
key, not that the libp2p peer id inside it is the owner's. The exchange layer therefore authenticates partners by
their transport identity (context.remote_id) and treats this list only as a set of candidates.
"""
from __future__ import annotations

import asyncio
import logging

import pydantic.v1 as pv1
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from gasloc.protocol.reach import MAX_VIA, RECORD_REACH

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


class SwarmSchema(pv1.BaseModel):
    peers: dict[BytesWithPublicKey, PeerRecord | None]


def peers_key(run_id: str) -> str:
    """The DHT key of a run's peer list (SchemaValidator names it `<prefix>_<field>`)."""
    return f"{run_id}_peers"


def make_validators(run_id: str) -> tuple[RSASignatureValidator, list]:
    """A fresh signing key for this peer (never RSAPrivateKey.process_wide(): forked peers would share it) and the
    validators to give the DHT."""
    signer = RSASignatureValidator(RSAPrivateKey())
    return signer, [signer, SchemaValidator(SwarmSchema, prefix=run_id)]


class Membership:
    """Announce, refresh, list and withdraw this peer's record. All methods are coroutines for the peer's event loop
    (the DHT calls return MPFutures, awaited without blocking the loop)."""

    def __init__(self, dht, signer: RSASignatureValidator, *, run_id: str, peer_id: str, fingerprint: str,
                 protocol: int, ttl_s: float, request_timeout_s: float = 10.0):
        self.dht, self.signer = dht, signer
        self.key, self.subkey = peers_key(run_id), signer.local_public_key
        self.peer_id, self.fingerprint, self.protocol = peer_id, fingerprint, protocol
        self.ttl_s, self.request_timeout_s = ttl_s, request_timeout_s
        self._last_expiration = 0.0
        self._failed_in_a_row = 0

    def record(self, *, state: str, round: int, throughput_tps: float, bandwidth_bps: float, reach: str = "direct",
               via: list[str] | None = None, forwards: bool = False) -> PeerRecord:
        return PeerRecord(peer_id=self.peer_id, protocol=self.protocol, fingerprint=self.fingerprint, state=state,
                          round=int(round), throughput_tps=float(throughput_tps), bandwidth_bps=float(bandwidth_bps),
                          time=float(get_dht_time()), reach=reach, via=list(via or [])[:MAX_VIA], forwards=forwards)

    async def announce(self, record: PeerRecord) -> bool:
        """Store our record with expiration now + ttl. False if no DHT node accepted it (logged, retried later)."""
        expiration = max(get_dht_time() + self.ttl_s, self._last_expiration + 1e-3)
        ok = await self._store(record.dict(), expiration)
        if ok:
            self._last_expiration = expiration
            self._failed_in_a_row = 0
        else:
            # one replica refusing or not answering is routine (the next announce is due in ttl/3); only a run of
            # failures means others are about to lose sight of us
            self._failed_in_a_row += 1
            log.log(logging.WARNING if self._failed_in_a_row >= 3 else logging.DEBUG,
                    "announce_failed key=%s state=%s round=%d in_a_row=%d", self.key, record.state, record.round,
                    self._failed_in_a_row)
        return ok

    async def withdraw(self) -> bool:
        """Leave the listing: None with an expiration later than any record we stored (a later expiration wins)."""
        expiration = max(get_dht_time(), self._last_expiration) + 1.0
        ok = await self._store(None, expiration)
        log.info("withdrawn key=%s ok=%s", self.key, ok)
        return ok

    async def _store(self, value, expiration: float) -> bool:
        try:
            return bool(await asyncio.wait_for(
                self.dht.store(self.key, value, expiration, subkey=self.subkey, return_future=True),
                self.request_timeout_s))
        except TimeoutError:
            log.warning("dht_store_timeout key=%s timeout_s=%.1f", self.key, self.request_timeout_s)
            return False

    async def list_all(self) -> dict[str, PeerRecord] | None:
        """Every valid, unexpired record under the run's key, including ours and other configurations'; None when
        the DHT did not answer in time (which says nothing about who is alive)."""
        try:
            found = await asyncio.wait_for(self.dht.get(self.key, latest=True, return_future=True),
                                           self.request_timeout_s)
        except TimeoutError:
            log.warning("dht_get_timeout key=%s timeout_s=%.1f", self.key, self.request_timeout_s)
            return None
        return parse_listing(found, now=get_dht_time())

    async def live_peers(self) -> dict[str, PeerRecord] | None:
        """Peers we can pair with: same fingerprint and protocol, unexpired, not us; None if the DHT did not
        answer."""
        found = await self.list_all()
        if found is None:
            return None
        return compatible(found, peer_id=self.peer_id, fingerprint=self.fingerprint, protocol=self.protocol)

    def prune(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """An older listing minus the records that must have expired by now (announced more than a TTL ago):
        what to believe while the DHT does not answer."""
        now = get_dht_time()
        return {pid: r for pid, r in records.items() if r.time + self.ttl_s > now}


def parse_listing(found, now: float) -> dict[str, PeerRecord]:
    """peer_id -> record from a DHT `get` result (None, or a dict subkey -> ValueWithExpiration); withdrawn (None),
    expired or malformed entries are dropped. When two subkeys claim one peer id, the newest announcement wins."""
    out: dict[str, PeerRecord] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for entry in found.value.values():
        if entry.value is None or entry.expiration_time <= now:
            continue
        try:
            rec = PeerRecord.parse_obj(entry.value)
        except (pv1.ValidationError, TypeError):
            continue  # the DHT validators should have rejected it; a node without them may still serve it
        if rec.peer_id not in out or rec.time > out[rec.peer_id].time:
            out[rec.peer_id] = rec
    return out


def compatible(records: dict[str, PeerRecord], *, peer_id: str, fingerprint: str, protocol: int
               ) -> dict[str, PeerRecord]:
    return {pid: r for pid, r in records.items()
            if pid != peer_id and r.fingerprint == fingerprint and r.protocol == protocol}
