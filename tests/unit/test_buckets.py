"""Membership that scales, the pure parts (protocol/buckets.py): buckets, levels, the size estimate, which buckets
to read, and peer exchange."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from gasloc.protocol.buckets import (
    BUCKET_TARGET,
    HINT_TTL_S,
    MAX_HINTS,
    MAX_LEVEL,
    READY_HINT_S,
    HintBook,
    PeerHint,
    SizeEstimate,
    bucket_of,
    buckets_to_read,
    from_wire,
    level_for,
    listing_interval_s,
    lookup_levels,
    merge_view,
    pick_hints,
    wire_hints,
    writer_levels,
)

IDS = [f"12D3KooW{i:06d}" for i in range(4000)]


def test_buckets_split_evenly_and_nest_across_levels():
    counts = Counter(bucket_of(p, 4) for p in IDS)
    assert set(counts) == set(range(16)) and max(counts.values()) < 1.35 * len(IDS) / 16
    # level L's bucket b is level L+1's b and b + 2**L: a peer's buckets of two levels agree on the low bits
    for p in IDS[:200]:
        assert bucket_of(p, 5) % 16 == bucket_of(p, 4)
    assert all(bucket_of(p, 0) == 0 for p in IDS[:10])


@pytest.mark.parametrize(("estimate", "level"), [(0, 0), (1, 0), (10, 0), (16, 1), (100, 4), (1000, 7),
                                                 (5000, 9), (10**9, MAX_LEVEL), (float("nan"), 0)])
def test_level_keeps_about_bucket_target_records_per_bucket(estimate, level):
    assert level_for(estimate) == level
    if 0 < estimate < 10**6:
        assert BUCKET_TARGET / 1.5 <= estimate / 2 ** level <= BUCKET_TARGET * 1.5 or level == 0


def test_level_has_hysteresis():
    assert level_for(1000) == 7
    # 1000 * 1.6 = log2 200 ~ 7.6 rounds to 8 without a current level, but stays at 7 with it
    assert level_for(1600) == 8 and level_for(1600, current=7) == 7
    assert level_for(2300, current=7) == 8 and level_for(400, current=7) == 6
    assert level_for(float("nan"), current=5) == 5


def test_writers_store_where_readers_one_level_either_way_look():
    """A reader at level R reads level R buckets; a writer at W stores at W and W-1: R in {W, W-1} always finds
    it, and a lookup tries the reader's level, the one below and the one above, so |W - R| <= 1 finds it."""
    assert writer_levels(0) == [0] and writer_levels(5) == [5, 4]
    for w in range(MAX_LEVEL + 1):
        for r in (w - 1, w, w + 1):
            if 0 <= r <= MAX_LEVEL:
                assert set(writer_levels(w)) & set(lookup_levels(r)), (w, r)
    assert lookup_levels(0) == [0, 1] and lookup_levels(MAX_LEVEL) == [MAX_LEVEL, MAX_LEVEL - 1]


def test_buckets_to_read_are_distinct_and_avoid_the_recent_ones():
    rng = random.Random(1)
    picks = buckets_to_read(4, 3, rng, skip=range(12))
    assert len(set(picks)) == 3 and set(picks) <= {12, 13, 14, 15}
    assert sorted(buckets_to_read(1, 5, rng)) == [0, 1]            # a level has only so many
    assert len(buckets_to_read(2, 2, rng, skip=range(4))) == 2     # all recent: any will do


def test_size_estimate_is_the_median_of_bucket_samples():
    est = SizeEstimate(window=5)
    assert est.value == 0.0
    rng = random.Random(0)
    for b in rng.sample(range(128), 5):   # 4000 peers at level 7: ~31 a bucket
        est.add(7, sum(bucket_of(p, 7) == b for p in IDS))
    assert 0.7 * len(IDS) < est.value < 1.3 * len(IDS)
    est.add(7, 10_000)                     # one wild sample moves a median little
    assert est.value < 1.5 * len(IDS)


def test_listing_backoff_doubles_to_a_cap():
    assert [listing_interval_s(n) for n in range(7)] == [0.3, 0.3, 0.6, 1.2, 2.4, 4.8, 4.8]


def test_hint_book_ages_out_ignores_self_and_source_and_is_bounded():
    book = HintBook("me", cap=10)
    book.heard("src", [PeerHint("me", "exchanging", 1), PeerHint("src", "exchanging", 1),
                       PeerHint("a", "exchanging", 3), PeerHint("b", "training", 2)], now=0.0)
    assert set(book.live(0.0)) == {"a", "b"} and book.source_of("a") == "src"
    assert book.ready(READY_HINT_S) == {"a"} and book.ready(READY_HINT_S + 0.1) == set()
    assert book.live(HINT_TTL_S + 0.1) == {}
    book.heard("src", [PeerHint(f"p{i}", "training", 0) for i in range(20)], now=100.0)
    assert len(book.live(100.0)) == MAX_HINTS       # one message tells of MAX_HINTS at most
    for i in range(10):
        book.saw(f"q{i}", "exchanging", 1, now=101.0 + i)
    assert len(book.live(111.0)) == 10 and "q9" in book.live(111.0)   # the oldest are forgotten first
    assert sum(p.startswith("p") for p in book.live(111.0)) == 0


def test_hints_name_ready_peers_first_and_never_the_receiver():
    book = HintBook("me")
    book.saw("h-ready", "exchanging", 4, now=0.0)
    book.saw("h-train", "training", 4, now=0.0)
    records = {f"r{i}": ("training", 1) for i in range(20)} | {"r-ready": ("exchanging", 2), "to": ("exchanging", 2)}
    hints = pick_hints(records, book, 1.0, exclude=("to", "me"), rng=random.Random(0))
    assert len(hints) == MAX_HINTS and {h.peer_id for h in hints[:2]} == {"h-ready", "r-ready"}
    assert all(h.peer_id not in ("to", "me") for h in hints)
    # a listed record beats what we saw of the same peer earlier
    book.saw("r0", "exchanging", 9, now=1.0)
    assert [h for h in pick_hints({"r0": ("training", 1)}, book, 1.0) if h.peer_id == "r0"][0].state == "training"


def test_a_hint_we_were_told_is_used_but_not_passed_on():
    book = HintBook("me")
    book.heard("x", [PeerHint("told", "exchanging", 4)], now=0.0)
    assert "told" in book.live(1.0) and book.ready(1.0) == {"told"}   # our own search may call it
    assert pick_hints({}, book, 1.0) == []


def test_two_peers_that_exchange_every_round_forget_a_departed_third():
    # a and b exchange headers every 2 s, each telling the other what it knows; c met a once, at t=0, and left.
    # Were told hints passed on, each would date c `now` on every exchange and keep it in sight for ever.
    a, b = HintBook("a"), HintBook("b")
    a.saw("c", "exchanging", 3, now=0.0)
    in_sight = []
    for step in range(40):
        now = 2.0 * step
        b.heard("a", pick_hints({"b": ("exchanging", step)}, a, now, exclude=("b", "a")), now)
        a.heard("b", pick_hints({"a": ("exchanging", step)}, b, now, exclude=("a", "b")), now)
        in_sight.append("c" in a.live(now) or "c" in b.live(now))
    assert in_sight[0] and not any(in_sight[int(2 * HINT_TTL_S / 2.0) + 1:])


def test_merge_view_adds_hinted_peers_and_their_readiness():
    book = HintBook("me")
    book.heard("x", [PeerHint("h", "exchanging", 1), PeerHint("t", "training", 1)], now=0.0)
    live, ready = merge_view({"r": ("exchanging", 1), "s": ("training", 1)}, book, 1.0)
    assert live == {"r", "s", "h", "t"} and ready == {"r", "h"}


def test_hints_round_trip_through_the_wire_and_bad_ones_are_not_sent():
    hints = [PeerHint("a", "exchanging", 1), PeerHint("x" * 65, "training", 1), PeerHint("b", "training", -1)]
    assert from_wire(wire_hints(hints)) == [PeerHint("a", "exchanging", 1)]
    assert len(wire_hints([PeerHint(f"p{i}", "training", 0) for i in range(20)])) == MAX_HINTS
