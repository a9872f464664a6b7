"""Membership that scales: which DHT bucket holds a peer's record, how many buckets there are, the swarm-size
estimate, which buckets to read, and peer exchange (hints of recently seen live peers). Pure: no I/O, no clock
(times are passed in), so it is unit-tested directly; peer/swarm/membership.py does the DHT side.

Layout. A record lives in bucket `bucket_of(peer_id, level)` of level `level`, one of 2**level buckets. A peer picks
its level from its swarm-size estimate (`level_for`: about BUCKET_TARGET records per bucket) and stores its record
in its bucket of that level and of the level below (`writer_levels`). A listing reads a bucket of the level below
the reader's own (`listing_level`), which holds the copies of every writer of the reader's level and of the level
below: about 2 x BUCKET_TARGET records, so a reader whose estimate is up to twice a writer's still finds the
writer's record. Estimates differ by little: each comes from the same buckets' counts, smoothed, with hysteresis on
the level.

Estimate. A bucket of level L read whole with n records says the swarm holds about n * 2**L peers (the hash spreads
peer ids evenly); `SizeEstimate` keeps the median of the last few such samples.

Peer exchange. Every exchange and state request and reply carries up to MAX_HINTS recently seen live peers
(`PeerHint`: id, state, round - the sender's claim). A `HintBook` keeps what we heard, ages it out after
HINT_TTL_S and picks what we tell others (`pick_hints`: our listed records and the peers we met ourselves, ready
ones first; never a hint we were told, which would come back to us as fresh). A hint only makes us
call a peer: every exchange authenticates its caller by transport identity, and a responder checks the caller's
own record in the DHT before reading anything.
"""
from __future__ import annotations

import hashlib
import math
import random
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from gasloc.protocol.messages import MAX_WIRE_HINTS, WireHint

BUCKET_TARGET = 8        # records per bucket a level aims at: one bucket is ~8 KB, well under 32 KB per round
MAX_LEVEL = 10           # 1024 buckets at most: ~8 records each at 8k peers, ~100 at 100k (still one message)
HYSTERESIS = 0.75        # the level moves only when log2(estimate / BUCKET_TARGET) is this far from it
MAX_HINTS = MAX_WIRE_HINTS  # peers one header tells about (8)
HINT_TTL_S = 20.0        # a hint older than this is forgotten (a peer's state changes every round)
READY_HINT_S = 4.0       # a hint that a peer is ready counts for this long (about one partner search)


def bucket_of(peer_id: str, level: int) -> int:
    """The bucket of `peer_id` among 2**level: low bits of sha256(peer_id), so level L's bucket b splits into
    level L+1's buckets b and b + 2**L."""
    h = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")
    return h % (1 << level)


def level_for(estimate: float, current: int | None = None) -> int:
    """The level for a swarm of about `estimate` peers: 2**level buckets of about BUCKET_TARGET records. With
    `current`, it moves only past HYSTERESIS, so estimates that wobble around a boundary do not flip it."""
    if not estimate > 0 or not math.isfinite(estimate):
        return 0 if current is None else current
    ideal = math.log2(max(estimate, 1.0) / BUCKET_TARGET)
    if current is not None and abs(ideal - current) <= HYSTERESIS:
        return current
    return max(0, min(MAX_LEVEL, round(ideal)))


def writer_levels(level: int) -> list[int]:
    """Where a peer of `level` stores its record: its own level and the one below (readers one level down)."""
    return [level, level - 1] if level > 0 else [0]


def listing_level(level: int) -> int:
    """The level whose buckets a reader of `level` lists: the one below its own, where each bucket holds the
    copies of two buckets of its level (about 2 x BUCKET_TARGET records). A get costs mostly per DHT node asked,
    not per record (twice the records: about 14 % more CPU in one measurement, docs/scale-results.md), while a bucket of 8 shows nobody
    ready 43 % of the time when 10 % are, and each such listing is one more get; a bucket of 16, 19 %."""
    return max(0, level - 1)


def lookup_levels(level: int) -> list[int]:
    """Where to look for one given peer's record, most likely first: our level (the writer agrees, or is one
    above), the level below, then the level above (a writer whose estimate is more than twice ours)."""
    return [lv for lv in (level, level - 1, level + 1) if 0 <= lv <= MAX_LEVEL]


def buckets_to_read(level: int, count: int, rng: random.Random, skip: Iterable[int] = ()) -> list[int]:
    """`count` distinct random buckets of `level` (fewer if the level has fewer), not those in `skip` while
    others remain: each listing shows another part of the swarm."""
    n = 1 << level
    skip = set(skip)
    pool = [b for b in range(n) if b not in skip] if n <= 4096 else []
    if len(pool) < count:
        pool = list(range(n))
    return rng.sample(pool, min(count, len(pool)))


def size_sample(level: int, records: int) -> float:
    """What one whole bucket of `level` holding `records` live records says the swarm's size is."""
    return records * float(1 << level)


class SizeEstimate:
    """The swarm's size as the median of the last `window` bucket samples (0.0 before the first)."""

    def __init__(self, window: int = 9):
        self.samples: deque[float] = deque(maxlen=window)

    def add(self, level: int, records: int) -> None:
        self.samples.append(size_sample(level, records))

    @property
    def value(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0


def listing_interval_s(listings_this_search: int, first_s: float = 0.3, max_s: float = 4.8) -> float:
    """Backoff of the listings during one partner search: first_s, then doubling up to max_s."""
    return min(max_s, first_s * 2 ** max(0, listings_this_search - 1))


@dataclass(frozen=True)
class PeerHint:
    """A peer someone saw live recently: its id, and the state and round it was last seen with (a claim)."""
    peer_id: str
    state: str
    round: int


@dataclass
class _Heard:
    hint: PeerHint
    at: float          # when we heard it (our monotonic clock)
    source: str        # who told us


class HintBook:
    """The peers others told us about (peer exchange), with when. Pure: times are passed in."""

    def __init__(self, own_id: str = "", cap: int = 256):
        self.own_id, self.cap = own_id, cap
        self._heard: dict[str, _Heard] = {}

    def heard(self, source: str, hints: Iterable[PeerHint], now: float) -> None:
        """Hints from `source` (a peer we just exchanged headers with). Itself and us are not hints."""
        for h in list(hints)[:MAX_HINTS]:
            if h.peer_id in (self.own_id, source) or not h.peer_id:
                continue
            self._heard[h.peer_id] = _Heard(h, now, source)
        self._bound()

    def _bound(self) -> None:
        if len(self._heard) > self.cap:   # forget the oldest: a long-lived peer must not grow without bound
            for pid, _ in sorted(self._heard.items(), key=lambda kv: kv[1].at)[:len(self._heard) - self.cap]:
                del self._heard[pid]

    def saw(self, peer_id: str, state: str, round: int, now: float) -> None:
        """A peer we met ourselves (it called us, or we called it): the best hint of all."""
        if peer_id and peer_id != self.own_id:
            self._heard[peer_id] = _Heard(PeerHint(peer_id, state, round), now, peer_id)
            self._bound()

    def forget(self, peer_id: str) -> None:
        self._heard.pop(peer_id, None)

    def live(self, now: float) -> dict[str, PeerHint]:
        self._expire(now)
        return {pid: h.hint for pid, h in self._heard.items()}

    def firsthand(self, now: float) -> dict[str, PeerHint]:
        """The peers we met ourselves (`saw`) within HINT_TTL_S: the only hints we pass on (pick_hints)."""
        self._expire(now)
        return {pid: h.hint for pid, h in self._heard.items() if h.source == pid}

    def ready(self, now: float) -> set[str]:
        """Peers heard of as ready (state exchanging) within READY_HINT_S."""
        return {pid for pid, h in self._heard.items() if h.hint.state == "exchanging" and now - h.at <= READY_HINT_S}

    def source_of(self, peer_id: str) -> str | None:
        h = self._heard.get(peer_id)
        return None if h is None else h.source

    def _expire(self, now: float) -> None:
        for pid in [p for p, h in self._heard.items() if now - h.at > HINT_TTL_S]:
            del self._heard[pid]


def pick_hints(records: dict[str, tuple[str, int]], book: HintBook, now: float, *, exclude: Iterable[str] = (),
               rng: random.Random | None = None, n: int = MAX_HINTS) -> list[PeerHint]:
    """What we tell a peer: up to `n` live peers, ready ones first (they are what a searcher needs), from our
    listed records (`records`: peer id -> (state, round)) and the peers we met ourselves, minus `exclude` (the peer
    we tell, and us). Random among equals, so a swarm's hints do not all name the same few peers.

    Never what others told us: a hint carries no age, so the receiver dates it `now`, and two peers that exchange
    every round would pass a departed peer back and forth as fresh for ever (measured: after a third peer of a
    3-peer swarm finished, the other two kept it in sight for the 23 s they ran on and passed each other over as
    recent partners for half of every round, waiting for it). Passed on first-hand only, a departed peer leaves
    our sight HINT_TTL_S after the last peer that met it, or held its record, told us of it."""
    rng = rng or random.Random()
    exclude = set(exclude)
    merged: dict[str, PeerHint] = {pid: h for pid, h in book.firsthand(now).items() if pid not in exclude}
    for pid, (state, rnd) in records.items():
        if pid not in exclude:
            merged[pid] = PeerHint(pid, state, rnd)   # a listed record wins over a sighting: the receiver gets
            #                                           the signed record it can check (members_for) with the hint
    ready = [h for h in merged.values() if h.state == "exchanging"]
    rest = [h for h in merged.values() if h.state != "exchanging"]
    rng.shuffle(ready)
    rng.shuffle(rest)
    return (ready + rest)[:n]


def merge_view(records: dict[str, tuple[str, int]], book: HintBook, now: float) -> tuple[set[str], set[str]]:
    """(live, ready): the peers in sight and those ready to exchange now, from listed records (peer id ->
    (state, round)) and hints. A listed record's state wins over a hint about the same peer unless the hint
    says ready (a hint is younger than the record's last listing, which may be up to a refresh old)."""
    hinted = book.live(now)
    ready_hints = book.ready(now)
    live = set(records) | set(hinted)
    ready = {pid for pid, (state, _) in records.items() if state == "exchanging"} | ready_hints
    return live, ready


def wire_hints(hints: Iterable[PeerHint]) -> tuple[WireHint, ...]:
    """Hints as a header carries them (at most MAX_HINTS; a round below 0 or an overlong id is not sent)."""
    out = []
    for h in hints:
        if 0 < len(h.peer_id) <= 64 and len(h.state) <= 16 and h.round >= 0:
            out.append(WireHint(peer_id=h.peer_id, state=h.state, round=h.round))
    return tuple(out[:MAX_HINTS])


def from_wire(peers: Iterable[WireHint]) -> list[PeerHint]:
    return [PeerHint(p.peer_id, p.state, p.round) for p in peers][:MAX_HINTS]


# the longest hints a header may carry: what header caps are computed from
WIDEST_HINTS = tuple(WireHint(peer_id="p" * 64, state="s" * 16, round=2**62) for _ in range(MAX_HINTS))
