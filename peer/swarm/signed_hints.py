"""Signed hints: other peers' signed membership records, passed on with peer-exchange hints, so that a peer about
to call a hinted peer checks the record it was handed (one signature verification, cached) instead of looking the peer
up in its DHT bucket (one get: ~10 ms of CPU at 1,000 members, bench/scale.py). docs/membership.md.

Where the records come from: our DHT node's reads (it checked every signature before we see a value; the signed
bytes are kept by `CachedSignatureValidator`, membership.py), callers' inline records we admitted, and handed-to-us
records once they passed the check. Only those are passed on (`attach`): we never forward what we did not check.

What was handed to us is hostile until `check` passes (Admission, admission.py: our run's bucket key, the record's
owner key derives to the hinted peer id, the peer's own bucket, not expired, signature and strict schema, our
configuration and protocol). A record that fails is dropped, counted (`refused`) and logged with why; the caller
then falls back to the DHT lookup, as without signed hints.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from gasloc.peer.swarm.membership import PeerRecord, peer_id_of
from gasloc.protocol.messages import MAX_WIRE_MEMBERS, WireMember

log = logging.getLogger(__name__)

KEEP_CAP = 1024      # checked records we can pass on (a few buckets and callers' worth, many times over)
OFFERED_CAP = 256    # handed-to-us records awaiting a check (a reply carries at most MAX_WIRE_MEMBERS)


class SignedRecords:
    """Signed records we hold of other peers (to pass on) and those handed to us (to check before use)."""

    def __init__(self, *, keep_cap: int = KEEP_CAP, offered_cap: int = OFFERED_CAP):
        self.keep_cap, self.offered_cap = keep_cap, offered_cap
        self._kept: OrderedDict[str, WireMember] = OrderedDict()
        self._offered: OrderedDict[str, tuple[WireMember, str]] = OrderedDict()   # owner -> (record, who sent it)
        self.refused = 0     # handed-to-us records that failed their check
        self.accepted = 0    # ... that passed it (each one DHT lookup saved)

    def keep(self, owner: str, member: WireMember) -> None:
        """A record known valid: read by our DHT node (signature checked there) or a caller's record we admitted.
        The one with the later expiration wins (a newer announcement)."""
        old = self._kept.get(owner)
        if old is not None and old.expiration > member.expiration:
            return
        self._kept[owner] = member
        self._kept.move_to_end(owner)
        while len(self._kept) > self.keep_cap:
            self._kept.popitem(last=False)

    def offered(self, source: str, members: Iterable[WireMember]) -> int:
        """Records `source` handed us with its hints: kept unchecked, under the peer id their owner key derives to
        (never a claimed one). Returns how many were taken."""
        taken = 0
        for m in list(members)[:MAX_WIRE_MEMBERS]:
            try:
                owner = peer_id_of(m.subkey.encode("ascii"))
            except UnicodeEncodeError:
                owner = None
            if owner is None:
                self._refuse("?", source, "record's subkey holds no owner key")
                continue
            self._offered[owner] = (m, source)
            self._offered.move_to_end(owner)
            taken += 1
        while len(self._offered) > self.offered_cap:
            self._offered.popitem(last=False)
        return taken

    def has_offer(self, peer_id: str) -> bool:
        return peer_id in self._offered

    def kept(self, peer_id: str) -> WireMember | None:
        return self._kept.get(peer_id)

    def check(self, peer_id: str, admission, now: float) -> tuple[PeerRecord | None, str]:
        """The record handed to us for `peer_id`, checked by `admission` (Admission.check) at DHT time `now`:
        (record, "") and it is kept to pass on, or (None, why) and it is dropped. Each offer is checked once."""
        got = self._offered.pop(peer_id, None)
        if got is None:
            return None, "no signed record was handed to us"
        member, source = got
        rec, why = admission.check(peer_id, member, now)
        if rec is None:
            self._refuse(peer_id, source, why)
            return None, why
        self.accepted += 1
        self.keep(peer_id, member)
        return rec, ""

    def attach(self, peer_ids: Iterable[str], now: float, n: int = MAX_WIRE_MEMBERS) -> tuple[WireMember, ...]:
        """The unexpired records we hold of these peers (in their order, at most `n`): what a reply carries."""
        out = []
        for pid in peer_ids:
            m = self._kept.get(pid)
            if m is not None and m.expiration > now:
                out.append(m)
                if len(out) >= n:
                    break
        return tuple(out)

    def _refuse(self, peer_id: str, source: str, why: str) -> None:
        self.refused += 1
        log.info("signed_hint_refused peer=%s from=%s why=%s", peer_id, source, why)
