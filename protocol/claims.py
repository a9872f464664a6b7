"""What a peer makes of other peers' claims about themselves: their round, that they are ready, how long their
record lives. Pure: no I/O, no clock (times and our own round are passed in).

A record is signed, so it proves who wrote it, never that what it says is true: a volunteer can announce round
10^9, "exchanging" for ever, or an expiration a century away, and a new identity costs nothing. Each rule below
bounds what such a claim can decide by something we observed ourselves:

- rounds (`RoundClaims`): a claim is believed up to the median of the claims we already believe (one vote per
  peer; our own round among them once we train) plus `slack` when we first see its peer, and from then on it may
  grow at most `speedup` rounds per round of ours (or per our round time, when time went on without our rounds).
  What is over that is cut to it: a liar then counts as a peer slightly ahead, in the "behind" median, the donor
  choice and the round a joiner takes over (the lr schedule);
- readiness (`stale_ready`): a peer we have seen announcing "exchanging" at the same round for longer than a
  round's plausible time (its search and its exchange, plus how often records are refreshed) is not in our ready
  set: a record that says "exchanging" for ever is not picked for ever;
- expiry (`expiry_cap`): we keep a record at most `max_ttl_s` past when we checked it, whatever expiration it was
  signed with; and a record whose announcement time has not changed for longer than that is dropped (honest peers
  re-announce every ttl / 3 with a new time), so a long-lived record outlives its owner by at most that.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def median_cap(rounds: Iterable[int], slack: int) -> int | None:
    """The median of `rounds` (one vote each) plus `slack`; None when there are none."""
    rs = list(rounds)
    return None if not rs else int(statistics.median(rs)) + slack


@dataclass
class RoundClaims:
    """Round claims as far as our own observation lets us believe them.

    `observe(claims, own_round, now)` after each listing: a peer seen for the first time is anchored at the lower of
    its claim and the median of the claims already believed (ours included when `own_round` is given; with nobody
    believed yet, a joiner's first listing, the median of that listing's claims). What we believe of it later
    (`plausible`) is at most anchor + slack + speedup x our progress since: our rounds since, or, when longer, the
    time since in units of our own round time (`round_s`; a peer that was stopped or suspended made no rounds while
    the swarm went on)."""
    slack: int
    speedup: float
    first: dict[str, tuple[int, int, float]] = field(default_factory=dict)   # peer -> (anchor, our round, when)

    def observe(self, claims: Mapping[str, int], own_round: int | None = None, now: float = 0.0,
                round_s: float | None = None) -> None:
        own = own_round or 0
        new = [p for p in claims if p not in self.first]
        if not new:
            return
        known = [self.plausible(p, r, own, now, round_s) for p, r in claims.items() if p in self.first]
        if own_round is not None:
            known.append(own_round)
        anchor = median_cap(known or [claims[p] for p in new], 0)
        for p in new:
            self.first[p] = (max(0, min(claims[p], anchor)), own, now)

    def plausible(self, peer: str, claim: int, own_round: int, now: float = 0.0, round_s: float | None = None) -> int:
        """`claim` cut to what we believe `peer` can have reached by our round `own_round` at `now` (unseen: as
        is)."""
        seen = self.first.get(peer)
        if seen is None:
            return claim
        r0, own0, t0 = seen
        progress = max(0.0, own_round - own0, (now - t0) / round_s if round_s else 0.0)
        return max(0, min(claim, r0 + self.slack + int(self.speedup * progress)))

    def believed(self, claims: Mapping[str, int], own_round: int, now: float = 0.0,
                 round_s: float | None = None) -> dict[str, int]:
        return {p: self.plausible(p, r, own_round, now, round_s) for p, r in claims.items()}

    def forget_absent(self, present: Iterable[str]) -> None:
        """Drop peers that left the listing (a peer that comes back is seen anew: its first claim is capped again)."""
        keep = set(present)
        for p in [p for p in self.first if p not in keep]:
            del self.first[p]


def stale_ready(seen: Mapping[str, tuple[str, int, float]], now: float, max_age_s: float) -> set[str]:
    """Peers (`seen`: peer -> (state, round, when we first saw it in that state and round, our clock)) that have
    announced "exchanging" at one round for longer than `max_age_s`: not ready, whatever their record says."""
    return {p for p, (state, _, since) in seen.items() if state == "exchanging" and now - since > max_age_s}


def ready_max_age_s(partner_deadline_s: float, exchange_timeout_s: float, ttl_s: float,
                    own_round_s: float | None = None) -> float:
    """How long an honest peer may be seen "exchanging" at one round: its search (partner_deadline_s, or with
    outer.overlap the inner phase it overlaps: twice our own round time stands for it) and the exchange it may end
    with, plus one refresh of the listing (ttl / 3) and as much again for a record that a slow DHT lags."""
    search = max(partner_deadline_s, 2 * own_round_s if own_round_s else 0.0)
    return search + exchange_timeout_s + 2 * ttl_s / 3


def expiry_cap(expiration: float, now: float, max_ttl_s: float) -> float:
    """An expiration as we keep it: at most `max_ttl_s` after `now` (when we checked the record)."""
    return min(expiration, now + max_ttl_s)


def frozen_records(seen: Mapping[str, tuple[float, float]], now: float, max_ttl_s: float) -> set[str]:
    """Peers whose record (`seen`: peer -> (its announcement time, when we first saw that time, our clock)) has
    not been re-announced for longer than `max_ttl_s`: their owner stopped refreshing it (left, or never was)."""
    return {p for p, (_, since) in seen.items() if now - since > max_ttl_s}
