"""The DHT side of membership that scales (peer/swarm/membership.py BucketReader / Membership) on an in-memory
DHT with hivemind's get/store semantics (latest expiration wins per subkey), and the mixed-swarm check of
peer/swarm/network.py. The real DHT: tests/integration/test_bench_scale.py and the e2e swarms."""
from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from pathlib import Path

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration

from gasloc.peer.config import PeerConfig
from gasloc.peer.swarm.ed25519 import Ed25519SignatureValidator
from gasloc.peer.swarm.membership import (
    GET_BEAM,
    REPROBE_S,
    TRUSTED_GET_BEAM,
    BucketReader,
    Membership,
    bucket_key,
    listing_beam,
    peer_id_of,
    peers_key,
)
from gasloc.peer.swarm.network import Network, PeerStatus
from gasloc.protocol.buckets import BUCKET_TARGET, MAX_LEVEL, bucket_of, level_for
from gasloc.protocol.messages import PROTOCOL_VERSION
from gasloc.runtime.lifecycle import StartupError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from scale import ed25519_identities  # noqa: E402  (the bench's seeded identities)

RUN = "bucketrun"


class FakeDHT:
    """hivemind.DHT's store/get as Membership uses them: one dictionary value per key, per subkey the value with
    the latest expiration; get returns unexpired entries."""

    def __init__(self):
        self.data: dict[str, dict[bytes, tuple[object, float]]] = {}
        self.gets: list[str] = []

    async def store(self, key, value, expiration, subkey, return_future=True):
        entries = self.data.setdefault(key, {})
        if subkey not in entries or entries[subkey][1] < expiration:
            entries[subkey] = (value, expiration)
        return True

    async def get(self, key, latest=True, return_future=True, **kwargs):
        self.gets.append(key)
        now = time.time()
        entries = {k: ValueWithExpiration(v, e) for k, (v, e) in self.data.get(key, {}).items() if e > now}
        return ValueWithExpiration(entries, now + 60) if entries else None


# keys from a fixed seed: the tests below count records per bucket, and where peer ids fall decides those counts
# (with fresh random keys one of them failed once in a full unit run); the 161st is an extra writer
SIGNERS = [Ed25519SignatureValidator(i) for i in ed25519_identities(161, seed=1)]


@pytest.fixture(scope="module")
def signers():
    return SIGNERS[:160]


def _member(dht, signer, level=0, **kw) -> Membership:
    m = Membership(dht, signer, run_id=RUN, peer_id=peer_id_of(signer.local_public_key), fingerprint="f",
                   protocol=1, ttl_s=30.0, rng=random.Random(len(kw)), **kw)
    m.level = level
    return m


def _announce(m: Membership, state="training") -> bool:
    return asyncio.run(m.announce(m.record(state=state, round=1, throughput_tps=1.0, bandwidth_bps=0.0)))


def _reader_of_swarm(dht, signers, level: int, seed: int) -> BucketReader:
    """A reader at `level` of a swarm whose members (one per signer) all announced at `level`."""
    for s in signers:
        assert _announce(_member(dht, s, level=level))
    reader = BucketReader(dht, run_id=RUN, rng=random.Random(seed))
    reader.level = level
    return reader


def test_a_record_goes_to_its_bucket_of_its_level_and_the_one_below_and_leaves_them_all(signers):
    dht = FakeDHT()
    m = _member(dht, signers[0], level=5)
    assert _announce(m)
    pid = m.peer_id
    assert set(dht.data) == {bucket_key(RUN, 5, bucket_of(pid, 5)), bucket_key(RUN, 4, bucket_of(pid, 4))}
    m.level = 6                     # the swarm grew: the next announcement goes to levels 6 and 5
    assert _announce(m)
    assert len(dht.data) == 3
    assert asyncio.run(m.withdraw())
    reader = BucketReader(dht, run_id=RUN)
    for lv in (4, 5, 6):
        assert asyncio.run(reader.read([(lv, bucket_of(pid, lv))])) == {}, lv   # withdrawn everywhere
        assert reader.withdrawn == {pid}                 # seen as a withdrawal, not just absent


def test_a_reader_finds_the_level_estimates_the_size_and_reads_a_bucket_not_the_swarm(signers):
    dht = FakeDHT()
    n = len(signers)
    level = level_for(n)
    members = [_member(dht, s, level=level) for s in signers]
    for m in members:
        assert _announce(m, state="exchanging" if m.peer_id[-1] in "abcdefgh" else "training")
    reader = BucketReader(dht, run_id=RUN, rng=random.Random(3))
    seen = asyncio.run(reader.probe())
    assert reader.gets == MAX_LEVEL + 1 and seen
    assert abs(reader.level - level) <= 1 and n / 2.5 < reader.estimate.value < n * 2.5
    reader.level = level
    before = reader.bytes_read
    listed = asyncio.run(reader.listing())
    assert 1 <= len(listed) <= 4 * BUCKET_TARGET
    # one bucket: a few KB, against ~n records for a whole listing
    assert reader.bytes_read - before < 4 * BUCKET_TARGET * 1200 and reader.bytes_read - before < n * 900 / 4
    # every member is found from its own bucket, in one get when its level is ours
    reader.level = level
    gets = reader.gets
    for m in random.Random(0).sample(members, 20):
        assert asyncio.run(reader.find(m.peer_id)).peer_id == m.peer_id
    assert reader.gets - gets == 20
    # a writer one level lower than the reader is found too (the level below is the second place to look)
    low = _member(dht, SIGNERS[160], level=level - 1)
    assert _announce(low)
    assert asyncio.run(reader.find(low.peer_id)).peer_id == low.peer_id
    assert asyncio.run(reader.find("12D3KooWnobody")) is None


def test_listings_cover_other_buckets_and_an_empty_level_sends_the_reader_to_probe(signers):
    dht = FakeDHT()
    reader = _reader_of_swarm(dht, signers[:100], level=3, seed=5)
    seen = set()
    for _ in range(8):
        seen |= set(asyncio.run(reader.listing()) or {})
    assert len(seen) > 60            # eight listings of one bucket of level 2 each: most of its four buckets
    lost = BucketReader(dht, run_id=RUN, rng=random.Random(5))
    lost.level = 8                   # an estimate far too high: its buckets are empty
    assert len(asyncio.run(lost.listing())) > 0 and lost.level in (2, 3, 4)


def test_a_listing_reads_one_bucket_of_the_level_below_with_the_writers_of_ours_and_the_one_below(signers):
    dht = FakeDHT()
    # writers whose estimate is half ours: two in each bucket of level 3, so whichever bucket the listing reads
    # holds some (chosen by bucket, not blindly: 40 random keys left one bucket without any in 0.5 % of sessions,
    # when the signers were random); the other 144 write at our level
    by_bucket: dict[int, list] = {}
    for s in signers:
        by_bucket.setdefault(bucket_of(peer_id_of(s.local_public_key), 3), []).append(s)
    low = {id(s) for b in range(8) for s in by_bucket[b][:2]}
    ours = [_member(dht, s, level=4) for s in signers if id(s) not in low]
    lower = [_member(dht, s, level=3) for s in signers if id(s) in low]
    for m in ours + lower:
        assert _announce(m)
    reader = BucketReader(dht, run_id=RUN, rng=random.Random(7))
    reader.level = 4
    listed = asyncio.run(reader.listing())
    assert len(dht.gets) == 1 and dht.gets[0].startswith(f"{RUN}_m3_")      # one get, of level 3
    b = int(dht.gets[0].rsplit("_", 1)[1])
    want = {m.peer_id for m in ours + lower if bucket_of(m.peer_id, 3) == b}
    assert set(listed) == want and any(m.peer_id in want for m in lower)
    assert len(want) > BUCKET_TARGET      # twice the records of one bucket of our level (~9 here)
    # level 1: the one bucket of level 0 is the whole swarm, one get (before: both buckets of level 1)
    small = FakeDHT()
    few = [_member(small, s, level=1) for s in signers[:20]]
    for m in few:
        assert _announce(m)
    reader = BucketReader(small, run_id=RUN)
    reader.level = 1
    assert set(asyncio.run(reader.listing())) == {m.peer_id for m in few} and small.gets == [f"{RUN}_m0_0"]


class Blackout(FakeDHT):
    """A loaded DHT: while `dark`, every get answers None, as hivemind's does when the nodes it asked time out."""
    dark = False

    async def get(self, key, latest=True, return_future=True, **kwargs):
        found = await super().get(key, latest=latest, **kwargs)
        return None if self.dark else found


def test_an_empty_probe_keeps_the_level_and_a_reader_alone_at_level_0_probes_again(signers):
    dht = Blackout()
    reader = _reader_of_swarm(dht, signers[:120], level=4, seed=2)
    dht.dark = True
    assert asyncio.run(reader.listing()) == {}     # empty listing -> probe, which also sees nothing
    assert reader.level == 4                       # nothing anywhere says nothing about the size (was: level 0)
    dht.dark = False
    gets = len(dht.gets)
    listed = asyncio.run(reader.listing())
    # still at level 4: one get, of a level-3 bucket, and all of it (about 15 of the 120 records; a count such as
    # "more than BUCKET_TARGET" depends on where the keys fall: 8 of them in one fresh-clone run)
    assert len(dht.gets) - gets == 1 and dht.gets[-1].startswith(f"{RUN}_m3_")
    b = int(dht.gets[-1].rsplit("_", 1)[1])
    want = {peer_id_of(s.local_public_key) for s in signers[:120] if bucket_of(peer_id_of(s.local_public_key), 3) == b}
    assert want and set(listed) == want
    # a peer that came to level 0 anyway (it started while the DHT was dark) lists only itself there
    lost = _member(dht, signers[150], level=0)
    assert _announce(lost)
    assert set(asyncio.run(lost.listing())) > {lost.peer_id} and lost.level in (3, 4, 5)   # it probed
    alone = _member(Blackout(), signers[151], level=0)
    assert _announce(alone)
    gets = alone.gets
    assert set(asyncio.run(alone.listing())) == {alone.peer_id} and alone.gets - gets == 1 + MAX_LEVEL + 1
    gets = alone.gets
    asyncio.run(alone.listing())
    assert alone.gets - gets == 1                  # a lone peer probes again only after REPROBE_S
    alone._probed_at -= REPROBE_S                  # as if REPROBE_S had passed
    gets = alone.gets
    asyncio.run(alone.listing())
    assert alone.gets - gets == 1 + MAX_LEVEL + 1


def test_legacy_records_under_the_single_key_are_found(signers):
    dht = FakeDHT()
    old = _member(dht, signers[1])
    rec = old.record(state="training", round=7, throughput_tps=1.0, bandwidth_bps=0.0)
    asyncio.run(dht.store(peers_key(RUN), rec.dict(), time.time() + 30, subkey=old.subkey))  # as gasloc < buckets
    reader = BucketReader(dht, run_id=RUN)
    assert set(asyncio.run(reader.legacy_peers())) == {old.peer_id}
    assert asyncio.run(BucketReader(FakeDHT(), run_id=RUN).legacy_peers()) == {}


def test_a_mixed_swarm_refuses_to_start_and_is_an_error_while_running(signers, caplog):
    dht = FakeDHT()
    old = _member(dht, signers[2])
    rec = old.record(state="training", round=7, throughput_tps=1.0, bandwidth_bps=0.0)
    rec.view["version"] = "0.1.0"
    net = Network(PeerConfig.model_validate({"swarm": {"run_id": RUN}}),
                  lambda: PeerStatus("training", 0, 0.0, 0.0))
    net.peer_id = "12D3KooWme"
    with pytest.raises(StartupError, match=r"mixed swarm: 1 peer\(s\) of run 'bucketrun' announce under the single "
                                           r"DHT key bucketrun_peers of an older gasloc .*version 0.1.0.*upgrade"):
        net._check_layout({old.peer_id: rec}, starting=True)
    net.legacy_seen = set()
    net._check_layout({"12D3KooWme": rec}, starting=True)      # our own old record (an upgrade in place): no
    with caplog.at_level(logging.ERROR):
        net._check_layout({old.peer_id: rec}, starting=False)
        net._check_layout({old.peer_id: rec}, starting=False)  # once per peer, not every check
    assert sum("mixed swarm" in r.message for r in caplog.records) == 1


def test_peers_of_another_protocol_stop_the_start_and_are_an_error_while_running(signers, caplog):
    """Protocol 2 signs records with Ed25519 keys, which peers of protocol 1 refuse to hold: each side would miss
    the other without a word, so the newer one says so (Network._check_protocols)."""
    old = _member(FakeDHT(), signers[3])
    rec = old.record(state="training", round=7, throughput_tps=1.0, bandwidth_bps=0.0)
    rec.protocol, rec.view["version"] = PROTOCOL_VERSION - 1, "0.1.0"
    net = Network(PeerConfig.model_validate({"swarm": {"run_id": RUN}}),
                  lambda: PeerStatus("training", 0, 0.0, 0.0))
    net.peer_id = "12D3KooWme"
    same = _member(FakeDHT(), signers[4]).record(state="training", round=7, throughput_tps=1.0, bandwidth_bps=0.0)
    same.protocol = PROTOCOL_VERSION
    net._check_protocols({"12D3KooWsame": same, "12D3KooWme": rec}, starting=True)   # ours, and our own old record
    with pytest.raises(StartupError, match=rf"mixed swarm: 1 peer\(s\) of run 'bucketrun' speak protocol "
                                           rf"{PROTOCOL_VERSION - 1} \(e.g. {old.peer_id}, gasloc version 0.1.0\); "
                                           rf"this peer .* speaks protocol {PROTOCOL_VERSION}.*one gasloc version"):
        net._check_protocols({old.peer_id: rec}, starting=True)
    net.protocol_seen = set()
    with caplog.at_level(logging.ERROR):
        net._check_protocols({old.peer_id: rec}, starting=False)
        net._check_protocols({old.peer_id: rec}, starting=False)  # once per peer, not every listing
    assert sum("mixed swarm" in r.message for r in caplog.records) == 1


def test_a_large_swarm_is_listed_by_searches_and_a_small_one_before_it_expires():
    from gasloc.peer.swarm.network import LIST_IDLE_S, list_period_s
    assert list_period_s(0, 15.0) == list_period_s(1, 15.0) == 5.0     # read whole: again before a record expires
    assert list_period_s(1, 600.0) == LIST_IDLE_S == 60.0
    assert list_period_s(7, 15.0) == 60.0   # a bucket at a time: searches list; the background only for long rounds


class _Wanted:
    def __init__(self):
        self.times = 0

    def set(self):
        self.times += 1


def test_a_search_lists_as_it_starts_then_backs_off(monkeypatch):
    """One listing when a search starts (unless one was asked for within SEARCH_FRESH_S), then, while nobody ready
    is in sight, at 0.3, 0.6, 1.2 ... s after the last one asked for: a search costs about one get, not one per
    10 s of training (bench/scale.py models exactly that)."""
    from gasloc.peer.swarm import network as netmod
    clock = [100.0]
    monkeypatch.setattr(netmod.time, "monotonic", lambda: clock[0])
    net = Network(PeerConfig.model_validate({"swarm": {"run_id": RUN}}), lambda: PeerStatus("training", 0, 0.0, 0.0))
    net._list_wanted = wanted = _Wanted()
    net.listed_at = 90.0
    net.search_begins()
    assert wanted.times == 1
    # the first came with the search (at 100.0): the next after 0.6 s, then 1.2 s, 2.4 s
    for t, expected in [(100.3, 1), (100.65, 2), (101.8, 2), (101.9, 3), (104.2, 3), (104.35, 4)]:
        clock[0] = t
        net.search_listing()
        assert wanted.times == expected, t
    net.listed_at = 104.4          # the last listing came back
    clock[0] = 105.0               # the next search starts within SEARCH_FRESH_S of it: nothing more
    net.search_begins()
    assert wanted.times == 4
    clock[0] = 105.5
    net.search_begins()
    assert wanted.times == 5



class BeamLog(FakeDHT):
    """Records the beam of every get; with `nearest_gone`, a get that asks one node finds nothing (that node died,
    or joined after the stores) while a wider one finds what the other holders keep."""

    def __init__(self, nearest_gone: bool = False):
        super().__init__()
        self.nearest_gone = nearest_gone
        self.beams: list[int] = []

    async def get(self, key, latest=True, return_future=True, beam_size=None, **kwargs):
        self.beams.append(beam_size)
        found = await super().get(key, latest=latest, return_future=return_future)
        return None if self.nearest_gone and beam_size == 1 else found


def test_a_private_swarm_asks_one_node_per_get_and_an_open_one_three():
    assert listing_beam(private_swarm=True) == TRUSTED_GET_BEAM == 1
    assert listing_beam(private_swarm=False) == GET_BEAM == 3


@pytest.mark.parametrize("nearest_gone", [False, True])
def test_one_node_per_get_and_an_empty_answer_asked_again_of_the_wider_beam(signers, nearest_gone):
    dht = BeamLog(nearest_gone)
    m = _member(dht, signers[0], level=0)
    assert _announce(m, state="exchanging")
    trusted = BucketReader(dht, run_id=RUN, beam=TRUSTED_GET_BEAM)
    assert set(asyncio.run(trusted.read([(0, 0)]))) == {m.peer_id}
    # the nearest node answers: one node asked; it has nothing: the bucket is asked again of three
    assert dht.beams == ([1, GET_BEAM] if nearest_gone else [1])
    assert trusted.wide_retries == int(nearest_gone)
    # among strangers three nodes are asked at once, and an empty answer is believed (nothing wider to ask)
    dht.beams.clear()
    open_reader = BucketReader(dht, run_id=RUN)
    assert asyncio.run(open_reader.read([(1, 0)])) == {} and dht.beams == [GET_BEAM]
    assert open_reader.wide_retries == 0
