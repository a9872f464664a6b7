"""The peer's network side: one DHT (and so one p2pd) per peer, the p2p replica that the Exchanger and the state
server use, the membership record and its refresh, and our view of the swarm (who is live, who is ready, which
claims of theirs we believe). Two parts live in their own modules, mixed into Network: reachability (the NAT probe,
forwarders, whom we call: peer/swarm/reachability.py) and joining (the state server and a joiner's download:
peer/swarm/joining.py, its donor policy protocol/donors.py).

Every coroutine here runs on the peer's event loop (runtime/aio.py); the methods without `async` are called from the
training thread and hand work to that loop with a deadline.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from gasloc import __version__
from gasloc.peer.swarm.absence import AbsenceWatch
from gasloc.peer.swarm.admission import Admission
from gasloc.peer.swarm.forward import RelayService, RoutedP2P
from gasloc.peer.swarm.joining import Joining
from gasloc.peer.swarm.membership import (
    DHT_CACHE_NEAREST,
    IdentityError,
    Membership,
    PeerRecord,
    StatusView,
    listing_beam,
    load_identity,
    make_validators,
    peer_id_of,
    status_view,
)
from gasloc.peer.swarm.reachability import Reachability
from gasloc.peer.swarm.signed_hints import SignedRecords
from gasloc.peer.swarm.swarmkey import load_swarm_key
from gasloc.protocol.auth import SwarmKeyError
from gasloc.protocol.buckets import HintBook, PeerHint, listing_interval_s, pick_hints
from gasloc.protocol.claims import RoundClaims, expiry_cap, frozen_records, ready_max_age_s, stale_ready
from gasloc.protocol.messages import PROTOCOL_VERSION, WireMember
from gasloc.runtime.aio import LoopThread
from gasloc.runtime.identity import write_identity_file
from gasloc.runtime.lifecycle import StartupError, shutdown_step
from gasloc.runtime.safeproc import SafeDHT

if TYPE_CHECKING:
    from gasloc.peer.config import PeerConfig

log = logging.getLogger(__name__)

LIST_IDLE_S = 60.0  # a swarm read a bucket at a time is listed when a search starts; between searches at most
                   # this often (a peer with long rounds keeps its view, estimate and forwarders current)
SEARCH_FRESH_S = 1.0  # a search that starts within this long of the last listing lists no more than that one
MAX_TTL_FACTOR = 4.0  # a record is kept at most this many of our announce_ttl_s past when we checked it, and one
                      # whose announcement time has not changed for that long is dropped (protocol/claims.py)
LEGACY_CHECK_S = 30.0  # how often the single key of the older layout is checked for peers of an older gasloc
NOT_MEMBER_CACHE_S = 5.0  # a caller whose record we did not find is not looked up again for this long


def list_period_s(level: int, ttl_s: float) -> float:
    """Seconds between background listings when no search asks for one. A swarm read whole each time (level 0 or
    1, a handful of records) is re-read before what we read expires (announce_ttl_s / 3). A larger one is read a
    random bucket at a time, and only the partner search needs one: it lists as it starts (search_begins) and with
    backoff while nobody ready is in sight, so the background only keeps a peer with rounds longer than LIST_IDLE_S
    current. Before, every 10 s: a get (~10 ms of CPU at 1,000 members, bench/scale.py) every 10 s of training, 6
    a round for a peer with 60-s rounds, that no search read."""
    return min(LIST_IDLE_S, ttl_s / 3) if level <= 1 else LIST_IDLE_S


@dataclass(frozen=True)
class PeerStatus:
    """The training side's state as our DHT record announces it."""
    state: str
    round: int
    throughput_tps: float
    bandwidth_bps: float
    view: dict = field(default_factory=dict)  # PeerRecord's optional status-view fields (loss, partners, ...)


async def _make_events() -> tuple[asyncio.Event, asyncio.Event]:
    return asyncio.Event(), asyncio.Event()  # created on the loop that waits on them


class Network(Reachability, Joining):
    def __init__(self, cfg: PeerConfig, status: Callable[[], PeerStatus], emit: Callable[..., None] | None = None):
        self.cfg = cfg
        self.status = status  # what our record says about us, read at each announcement
        self.emit = emit or (lambda event, **fields: None)  # the peer's metrics sink (joins served)
        self.dht: SafeDHT | None = None
        self.aio: LoopThread | None = None
        self.p2p = None
        self.membership: Membership | None = None
        self.state_server = None
        self._live: dict[str, PeerRecord] = {}     # compatible live peers we hold a record of (`live`)
        self._entered: dict[str, tuple[str, int, float]] = {}  # peer -> (state, round, DHT time it entered them)
        # what we observed ourselves (monotonic clock), against which others' claims are weighed (protocol/claims.py)
        self._seen_at: dict[str, float] = {}          # peer -> when we first saw it live: its tenure
        self._seen_state: dict[str, tuple[str, int, float]] = {}  # peer -> (state, round, when we first saw them)
        self._announced: dict[str, tuple[float, float]] = {}  # peer -> (its record's time, when we first saw it)
        self.claims = RoundClaims(slack=cfg.swarm.round_claim_slack, speedup=cfg.swarm.round_claim_speedup)
        self.max_record_ttl_s = MAX_TTL_FACTOR * cfg.swarm.announce_ttl_s
        self.records: dict[str, PeerRecord] = {}   # every record read (any configuration), until its expiration
        self.hints = HintBook()                    # peer exchange: who others told us is live (protocol/buckets.py)
        self.signed = SignedRecords()              # signed hints: records to pass on, and handed to us (unchecked)
        self._not_members: dict[str, float] = {}   # caller -> when its lookup found no record (monotonic)
        self._search_listings = 0                  # listings asked for during the partner search in progress
        self._list_asked_at = 0.0                  # when the latest listing was asked for (monotonic)
        self.legacy_seen: set[str] = set()         # peers of the older single-key layout, reported once each
        self.protocol_seen: set[str] = set()       # peers of another protocol, reported once each
        self._bytes_reported = self._gets_reported = 0   # membership reads already in an earlier round's metrics
        self._hints_reported = [0, 0]              # signed hints used / refused, already in an earlier round's
        self.peer_id, self.maddrs, self.fingerprint = "", [], ""
        self.signer = None
        self._tasks: list = []
        self.listed_at = 0.0
        self._announce_wanted: asyncio.Event | None = None   # made on the loop (start_services)
        self._list_wanted: asyncio.Event | None = None
        self._snapshot = None       # the state a joiner downloads, taken on demand (round_boundary)
        self._waiters: list[asyncio.Future] = []  # state-server requests waiting for the next round boundary
        self._waiters_lock = threading.Lock()
        self.absence: AbsenceWatch | None = None  # set when the loop that ticks it starts
        self.swarm_key: bytes | None = None        # a private swarm's shared secret (swarm.key_path)
        self._fresh_key: bytes | None = None       # the identity made at start (no --identity-path), for a restart
        self.relay: RelayService | None = None
        self.private, self.reach_source = False, "config"
        self.dht_client = False                    # our DHT node hosts no keys (behind NAT)
        self._probed_at, self._probed_addrs = 0.0, []  # the last reachability probe: when (monotonic), what it asked
        self.admission: Admission | None = None    # checks callers' inline records (admission.py)
        self._validators: list = []

    @contextlib.contextmanager
    def _identity_file(self):
        """The libp2p identity file p2pd starts with, and whether it is ours alone (made for this run). Records are
        signed with this key, so even a peer without --identity-path runs p2pd with a key file we can read: a fresh
        key, kept in memory and written to a private temporary file only while p2pd starts (it reads the file once
        then), so that a peer killed later leaves no key file behind."""
        path = self.cfg.network.identity_path
        if path is not None:
            path = Path(path).expanduser()
            if not path.exists():
                try:
                    # an Ed25519 key (runtime/identity.py: records less than half the size of RSA-signed ones), made
                    # before p2pd starts, so that we can sign with it
                    write_identity_file(path)
                except OSError as e:
                    raise StartupError(f"cannot create identity file {path}: {e}") from None
            yield str(path), False
            return
        home = tempfile.mkdtemp(prefix="gasloc-identity-")   # mode 0700
        fresh = Path(home) / "identity.key"
        try:
            if self._fresh_key is None:
                write_identity_file(fresh)
                self._fresh_key = fresh.read_bytes()
            else:   # a restart as a DHT client keeps the identity
                fresh.write_bytes(self._fresh_key)
            yield str(fresh), True
        finally:
            shutil.rmtree(home, ignore_errors=True)

    # ------------------------------------------------------------------ startup (main thread)
    def start_dht(self) -> None:
        """Start the DHT node and learn our reachability. Known to be behind NAT (`private`), the node starts as a
        DHT client; with `auto`, the dial-back probe runs right after the start, and a peer that learns it is behind
        NAT starts its DHT again as a client - before anything is announced, and before the model exists (so the
        fork of the DHT child stays small). hivemind cannot switch a running DHT node to client mode."""
        net = self.cfg.network
        self._start_dht(client=net.reachability == "private")
        if net.reachability != "auto":
            self.private, self.reach_source = net.reachability == "private", "config"
            return
        self.aio = LoopThread()
        # a client of the DHT's daemon for the probe only: closed here (the daemon itself is the DHT's)
        replica = self.aio.run(self.dht.replicate_p2p(), net.startup_timeout_s)
        try:
            self.private, self.reach_source = self._learn_reachability(replica)
        finally:
            shutdown_step("p2p.shutdown", lambda: self.aio.run(replica.shutdown(), 10))
        if self.private:
            t0 = time.monotonic()
            shutdown_step("dht.shutdown", self.dht.shutdown)
            self._start_dht(client=True, restart=True)
            log.info("dht_restarted mode=client reason=%s took_s=%.1f", self.reach_source, time.monotonic() - t0)

    def _start_dht(self, client: bool, restart: bool = False) -> None:
        extra = {}
        if self.cfg.swarm.key_path is not None:
            from gasloc.peer.swarm.private import SwarmKeyAuthorizer
            try:
                self.swarm_key = load_swarm_key(self.cfg.swarm.key_path)
            except SwarmKeyError as e:
                raise StartupError(str(e)) from None
            extra["authorizer"] = SwarmKeyAuthorizer(self.swarm_key)
        # known to be behind NAT: a DHT client (a NATed node that hosts keys makes them flaky for everyone, and
        # others' requests to it only time out) with libp2p's auto-relay on (circuit addresses, hole punching where
        # the addresses allow it; our exchanges do not rely on it: docs/nat.md)
        if client:
            extra.update(client_mode=True, use_auto_relay=True)
        with self._identity_file() as (identity_path, fresh):
            self._start_node(identity_path, fresh, restart, extra)

    def _start_node(self, identity_path: str, fresh: bool, restart: bool, extra: dict) -> None:
        net = self.cfg.network
        if fresh or restart:
            # a key made this instant cannot be in use elsewhere; on a restart it was ours until a moment ago
            extra["check_if_identity_free"] = False
        try:
            identity = load_identity(identity_path)
        except IdentityError as e:
            raise StartupError(str(e)) from None
        # our records are signed with the libp2p identity itself: that binds them to our peer id
        self.signer, validators = make_validators(self.cfg.swarm.run_id, identity)
        self._validators = validators
        m = self.cfg.metrics
        p2pd_flags = {"metricsAddr": f"{m.host}:{m.p2pd_port}"} if m.p2pd_port else None
        dht = SafeDHT(p2pd_flags=p2pd_flags, initial_peers=net.initial_peers or None, start=False,
                      record_validators=validators, cache_nearest=DHT_CACHE_NEAREST,
                      host_maddrs=net.listen_maddrs, announce_maddrs=net.announce_maddrs or None,
                      identity_path=identity_path, startup_timeout=net.startup_timeout_s, **extra)
        self.dht = dht
        try:
            dht.run_in_background(await_ready=True, timeout=net.startup_timeout_s + 5)
        except Exception as e:  # noqa: BLE001 - whatever hivemind raised, the user gets one line and exit 1
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise StartupError(f"could not start the DHT node ({type(e).__name__}: {first}); check "
                                   f"--initial-peers (are those peers running and reachable?), --host-maddrs, "
                                   f"and --swarm-key (a private swarm ignores peers without its key)") from None
        self.peer_id = dht.peer_id.to_base58()
        if peer_id_of(self.signer.local_public_key) != self.peer_id:   # others would drop every record of ours
            raise StartupError(f"p2pd runs as {self.peer_id}, not as the identity in {identity_path}")
        self.maddrs = [str(m) for m in dht.get_visible_maddrs()]
        self.dht_client = bool(dht.client_mode)   # the node's own answer, not our request
        if restart:
            return
        if not net.initial_peers:
            public = [m for m in self.maddrs if "/127.0.0.1/" not in m and "/::1/" not in m] or self.maddrs
            log.warning("no initial peers: starting a new swarm; others join with --initial-peers %s",
                        public[0] if public else "<this peer's multiaddr>")
        log.info("dht_started peer_id=%s maddrs=%s mode=%s", self.peer_id, ",".join(self.maddrs),
                 "client" if self.dht_client else "server")

    def _beam(self) -> int:
        """DHT nodes a get of a bucket asks: in a private swarm (a swarm key) the nearest alone (listing_beam)."""
        return listing_beam(self.cfg.swarm.key_path is not None)

    def start_services(self) -> None:
        """The event loop thread, the p2p replica (same daemon and peer id as the DHT) and the membership."""
        if self.aio is None:
            self.aio = LoopThread()
        timeout = self.cfg.network.startup_timeout_s
        self.p2p = RoutedP2P(self.aio.run(self.dht.replicate_p2p(), timeout), self.cfg.swarm.run_id, self._via_of)
        self.admission = Admission(self.cfg.swarm.run_id, fingerprint=self.fingerprint, protocol=PROTOCOL_VERSION,
                                   validators=self._validators)
        self.membership = Membership(self.dht, self.signer, run_id=self.cfg.swarm.run_id, peer_id=self.peer_id,
                                     fingerprint=self.fingerprint, protocol=PROTOCOL_VERSION,
                                     ttl_s=self.cfg.swarm.announce_ttl_s,
                                     # a store or get stuck on an unresponsive DHT node must not outlive a refresh
                                     request_timeout_s=min(10.0, self.cfg.swarm.announce_ttl_s / 3),
                                     beam=self._beam())
        net = self.cfg.network
        self.relay = RelayService(self.p2p, is_member=self.confirm_member, volunteer=False,
                                  max_circuits=net.forward_max_circuits, max_attached=net.forward_max_attached,
                                  circuit_timeout_s=self.cfg.exchange.exchange_timeout_s + 5,
                                  on_detached=self._via_shrank)
        self.aio.run(self.relay.start(), timeout)
        self.hints = HintBook(self.peer_id)
        self.membership.signed_sink = self.signed.keep   # our bucket reads' records, with their signatures
        self._check_layout(self.aio.run(self.membership.legacy_peers(), timeout), starting=True)
        self._take(self.aio.run(self.membership.probe(), timeout), starting=True)
        self.relay.volunteer = net.forwarding and not self.private
        self.aio.run(self.membership.announce(self._record()), timeout)
        self.listed_at = time.monotonic()
        self._announce_wanted, self._list_wanted = self.aio.run(_make_events(), timeout)
        # behind NAT: attach now, not at the first background listing (1-2 s on), so that the record the announcer
        # stores next names our forwarders from our first round on; until then nobody can call us (docs/nat.md)
        self.aio.run(self._attach_now(), timeout)
        self.absence = AbsenceWatch()
        self._tasks = [self.aio.submit(self._announcer()), self.aio.submit(self._lister()),
                       self.aio.submit(self._watch()), self.aio.submit(self._legacy_watch())]
        if net.reachability == "auto" and net.reprobe_every_s > 0:
            self._tasks.append(self.aio.submit(self._reprober()))
        log.info("membership level=%d buckets=%d estimate=%.0f in_sight=%d", self.membership.level,
                 1 << self.membership.level, self.membership.estimate.value, len(self.live))

    # ------------------------------------------------------------------ membership
    # Two background tasks own the DHT traffic, so no round ever awaits the DHT: a slow or frozen DHT node (its
    # RPCs time out after seconds) then delays what others learn about us, never our training or partner search.

    def _record(self) -> PeerRecord:
        s = self.status()
        return self.membership.record(state=s.state, round=s.round, throughput_tps=s.throughput_tps,
                                      bandwidth_bps=s.bandwidth_bps, reach=self.reach, via=self.relay.via,
                                      forwards=self.relay.volunteer, **s.view)

    def announce(self, wait: bool = False) -> None:
        """Announce the peer's current state: in the background (one store at a time, the latest state wins), or
        with `wait`, right now from the calling (training) thread."""
        if wait:
            self.aio.run(self.membership.announce(self._record()), self.membership.request_timeout_s + 1)
        else:
            self.aio.loop.call_soon_threadsafe(self._announce_wanted.set)

    def search_begins(self) -> None:
        """On the loop: a partner search starts. It lists now (who is ready has changed since our last search),
        unless a listing was asked for within SEARCH_FRESH_S; further listings back off (listing_interval_s)."""
        self._search_listings = 0
        if time.monotonic() - max(self.listed_at, self._list_asked_at) >= SEARCH_FRESH_S:
            self._ask_listing()

    def search_listing(self) -> None:
        """On the loop, from a partner search with nobody ready in sight: a listing of another bucket, at most
        every listing_interval_s (0.3 s, doubling up to 4.8 s within one search) after the last one asked for."""
        if time.monotonic() - max(self.listed_at, self._list_asked_at) >= listing_interval_s(self._search_listings + 1):
            self._ask_listing()

    def _ask_listing(self) -> None:
        self._search_listings += 1
        self._list_asked_at = time.monotonic()
        self._list_wanted.set()

    async def _announcer(self) -> None:
        every = self.cfg.swarm.announce_ttl_s / 3
        # asyncio.timeout, not wait_for: withdraw() cancels this task, and 3.11's wait_for drops a cancel that lands
        # just after the event was set (a state change as we stop): we would announce again after withdrawing
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await self._announce_wanted.wait()
            self._announce_wanted.clear()
            await self.membership.announce(self._record())

    async def _lister(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(list_period_s(self.membership.level, self.cfg.swarm.announce_ttl_s)):
                    await self._list_wanted.wait()
            self._list_wanted.clear()
            level = self.membership.level
            self._take(await self.membership.listing())
            if self.membership.level != level:
                log.info("membership level=%d buckets=%d estimate=%.0f (was level %d)", self.membership.level,
                         1 << self.membership.level, self.membership.estimate.value, level)
                self._announce_wanted.set()   # store in the buckets of the new level now, not at the next refresh
            self.listed_at = time.monotonic()
            self._keep_attached()

    def _take(self, found: dict[str, PeerRecord] | None, *, starting: bool = False) -> None:
        """Merge records just read into what we know, and drop what expired. A DHT that did not answer (None)
        leaves what we know, minus what expired: an empty view would make every partner a stranger."""
        gone = self.membership.withdrawn   # peers whose withdrawal (None) a read just saw
        for pid in gone:
            self.hints.forget(pid)         # a hint about it predates its withdrawal
        known = self.membership.prune({p: r for p, r in {**self.records, **(found or {})}.items() if p not in gone})
        known = self._unfrozen(known)
        self.records = known
        self.live = self.membership.compatible(known)
        self._check_protocols(found or {}, starting=starting)

    def _unfrozen(self, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """`records` minus those whose owner stopped re-announcing: an honest peer stores a new `time` every
        announce_ttl_s / 3, so a record that has carried the same `time` for max_record_ttl_s of our own clock was
        left behind (or stored with an expiration far ahead), whatever expiration the DHT holds for it
        (protocol/claims.py frozen_records). Its first sighting is remembered while it keeps being read."""
        now = time.monotonic()
        for pid, r in records.items():
            old = self._announced.get(pid)
            if old is None or old[0] != r.time:
                self._announced[pid] = (r.time, now)
        if len(self._announced) > 8192:          # bounded: forget the sightings of peers we no longer read
            self._announced = {p: v for p, v in self._announced.items() if p in records}
        frozen = frozen_records({p: self._announced[p] for p in records}, now, self.max_record_ttl_s)
        if frozen:
            log.debug("records_frozen peers=%s", ",".join(sorted(frozen)))
        return {p: r for p, r in records.items() if p not in frozen}

    def _check_protocols(self, records: dict[str, PeerRecord], *, starting: bool) -> None:
        """Peers of the run that speak another protocol: we cannot exchange with them, and across the change to
        protocol 2 a peer of protocol 1 does not even hold our records (their Ed25519 signatures fail its schema),
        so the swarm would split without a word. Refuse to start; while running, an ERROR per new one."""
        others = {pid: r for pid, r in records.items()
                  if pid != self.peer_id and r.protocol != PROTOCOL_VERSION and pid not in self.protocol_seen}
        if not others:
            return
        self.protocol_seen |= set(others)
        pid = sorted(others)[0]
        version = (status_view(others[pid]) or StatusView()).version or "unknown"
        what = (f"mixed swarm: {len(others)} peer(s) of run {self.cfg.swarm.run_id!r} speak protocol "
                f"{others[pid].protocol} (e.g. {pid}, gasloc version {version}); this peer (gasloc {__version__}) "
                f"speaks protocol {PROTOCOL_VERSION}; peers of different protocols cannot exchange, so the swarm "
                f"would split: run one gasloc version on every peer of the run")
        if starting:
            raise StartupError(what)
        log.error("%s", what)

    async def _legacy_watch(self) -> None:
        while True:
            await asyncio.sleep(LEGACY_CHECK_S)
            self._check_layout(await self.membership.legacy_peers(), starting=False)

    def _check_layout(self, legacy: dict[str, PeerRecord] | None, *, starting: bool) -> None:
        """Peers of an older gasloc under the single key of the layout before buckets: they cannot see us nor we
        them, so the swarm would split without a word. Refuse to start; while running, an ERROR per new one."""
        others = {pid: r for pid, r in (legacy or {}).items() if pid != self.peer_id}
        new = sorted(set(others) - self.legacy_seen)
        if not new:
            return
        self.legacy_seen |= set(new)
        version = (status_view(others[new[0]]) or StatusView()).version or "unknown"
        what = (f"mixed swarm: {len(others)} peer(s) of run {self.cfg.swarm.run_id!r} announce under the single "
                f"DHT key {self.cfg.swarm.run_id}_peers of an older gasloc (e.g. {new[0]}, version {version}); this "
                f"version keeps records in bucket keys, so neither side sees the other: upgrade every peer of the run")
        if starting:
            raise StartupError(what)
        log.error("%s", what)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.absence.TICK_S)
            self.absence.tick()

    def refresh_listing(self) -> None:
        """A listing taken now, from the training thread (after a stop, the cached one predates it)."""
        try:
            found = self.aio.run(self.membership.listing(), self.membership.request_timeout_s + 1)
        except TimeoutError:
            return
        if found is not None:
            self._take(found)
            self.listed_at = time.monotonic()

    @property
    def live(self) -> dict[str, PeerRecord]:
        return self._live

    @live.setter
    def live(self, records: dict[str, PeerRecord]) -> None:
        # when each peer entered its announced (state, round): the earliest announcement time seen for it (the
        # announcer re-stores the same state every announce_ttl_s / 3 with a newer time)
        entered = {}
        for pid, r in records.items():
            old = self._entered.get(pid)
            same = old is not None and old[:2] == (r.state, r.round)
            entered[pid] = (r.state, r.round, min(old[2], r.time) if same else r.time)
        self._live, self._entered = records, entered
        now = time.monotonic()
        self._seen_at = {pid: self._seen_at.get(pid, now) for pid in records}
        seen = {}
        for pid, r in records.items():
            old = self._seen_state.get(pid)
            seen[pid] = old if old is not None and old[:2] == (r.state, r.round) else (r.state, r.round, now)
        self._seen_state = seen
        self.claims.forget_absent(records)
        s = self.status()
        # our round is a vote among the claims, except while we join (or resync) and right after a stop of this
        # process longer than our record's TTL, before the daemon resyncs: then it is stale. (Every record had
        # expired in our view during the stop, so every peer is seen anew here; anchored at our stale round plus
        # slack, the swarm's real rounds read as lies, no peer was a donor, and the resync found nobody: e2e
        # test_swarm_gossip's frozen peer, once in a fresh clone.)
        away = self.absence is not None and self.absence.peek() > self.cfg.swarm.announce_ttl_s
        self.claims.observe({p: r.round for p, r in records.items() if r.state != "joining"},
                            None if s.state == "joining" or away else s.round, now, s.view.get("round_s"))

    def believed_rounds(self) -> dict[str, int]:
        """Listed peers past joining -> their announced round as far as we believe it (protocol/claims.py)."""
        s = self.status()
        return self.claims.believed({p: r.round for p, r in self.live.items() if r.state != "joining"}, s.round,
                                    time.monotonic(), s.view.get("round_s"))

    def round_caps(self) -> dict[str, int]:
        """Listed peers past joining -> the highest round we believe each can have reached by now: the bound a
        donor's reply is held to (its listed claim may be a round or two old by the time it answers)."""
        s = self.status()
        return self.claims.believed({p: 2**62 for p, r in self.live.items() if r.state != "joining"}, s.round,
                                    time.monotonic(), s.view.get("round_s"))

    def tenure(self) -> dict[str, float]:
        """Listed peers -> how long (s) we have seen them live: our own observation, not a claim."""
        now = time.monotonic()
        return {p: now - t for p, t in self._seen_at.items()}

    def _stale_ready(self, now: float) -> set[str]:
        """Listed peers that have announced "exchanging" at one round for longer than a round's plausible time."""
        c = self.cfg
        limit = ready_max_age_s(c.swarm.partner_deadline_s, c.exchange.exchange_timeout_s, c.swarm.announce_ttl_s,
                                self.status().view.get("round_s"))
        return stale_ready(self._seen_state, now, limit)

    def ready_at(self, now: float) -> dict[str, float]:
        """Peers in state "training" -> when they are expected to be ready, on the clock of `now` (monotonic): the
        time they announced entering the inner phase plus how long it takes them (our inner steps at the tokens/s
        they announce). Unknown speed (their first round): expected now. Claims both; at worst we wait up to our
        deadline for a peer that is not coming, or go solo a round early (protocol/search.py Sight.coming)."""
        c = self.cfg
        tokens = c.inner.inner_steps * c.data.batch_size * c.model.seq_len
        offset = now - get_dht_time()
        out = {}
        for pid, r in self._live.items():
            if r.state != "training":
                continue
            since = self._entered.get(pid, (r.state, r.round, r.time))[2]
            out[pid] = since + tokens / r.throughput_tps + offset if r.throughput_tps > 0 else now
        return out

    def entered_at(self, now: float) -> dict[str, float]:
        """Listed peers -> when they entered the state they announce, on the clock of `now` (monotonic). Their
        claim, on their clock: a skewed one at worst costs one call more, or keeps a "no free offer" standing."""
        offset = now - get_dht_time()
        return {pid: since + offset for pid, (_, _, since) in self._entered.items()}

    def ready_peers(self) -> set[str]:
        """Compatible peers ready to exchange: listed as such (at most a refresh old), or heard of as ready from a
        peer we just exchanged headers with (peer exchange, protocol/buckets.py)."""
        now = time.monotonic()
        # an "exchanging" that outlives a round's plausible time is not believed: a record that says so for ever
        # would otherwise be in every search's ready set (protocol/claims.py stale_ready)
        # (and a hint that it is ready does not override that: its accomplices, or honest peers it keeps calling,
        # would pass it on)
        stale = self._stale_ready(now)
        listed = {pid for pid, r in self.live.items() if r.state == "exchanging"}
        return (listed | self.hints.ready(now)) - stale - {self.peer_id}

    def in_sight(self) -> set[str]:
        """Every compatible peer we hold a record of, and those others told us about."""
        return (set(self.live) | set(self.hints.live(time.monotonic()))) - {self.peer_id}

    def hints_for(self, peer: str) -> list[PeerHint]:
        """What we tell `peer` in an exchange or state header: a handful of live peers, ready ones first."""
        records = {pid: (r.state, r.round) for pid, r in self.live.items()}
        return pick_hints(records, self.hints, time.monotonic(), exclude=(peer, self.peer_id))

    def members_for(self, peer: str, hints) -> tuple[WireMember, ...]:
        """Signed hints: the signed records we hold of the peers `hints` name (ready ones come first in hints),
        for a reply to `peer`, which checks each before it calls that peer (signed_hints.py)."""
        return self.signed.attach([h.peer_id for h in hints if h.peer_id != peer], get_dht_time())

    def members_heard(self, peer: str, members) -> None:
        """Signed records `peer` handed us with its hints: kept unchecked until we are about to call one."""
        self.signed.offered(peer, members)

    def heard(self, peer: str, hints, *, state: str | None = None, round: int = 0) -> None:
        """Hints from `peer` (a member: its header came after the membership check); with `state`, what we saw
        of `peer` itself (a caller is searching, so ready)."""
        now = time.monotonic()
        self.hints.heard(peer, hints, now)
        if state is not None:
            self.hints.saw(peer, state, round, now)

    def is_member(self, peer_id: PeerID) -> bool:
        """Whether we hold a live, compatible record of `peer_id` (no DHT traffic)."""
        return str(peer_id) in self.live

    def member_out(self) -> WireMember | None:
        """Our own signed record for the requests we send (None before the first announcement)."""
        return None if self.membership is None else self.membership.inline

    async def admit_caller(self, peer_id: PeerID, member: WireMember | None) -> bool:
        """On the loop, for the exchange handler and the state server: whether a caller is a live, compatible
        member. Held in our view: yes. Else its inline record decides (admission.py: signature, its owner is the
        caller, run, schema, expiration, configuration), and a valid one joins our view until it expires. Only a
        caller without one (an older gasloc) is looked up in the DHT (`confirm_member`)."""
        pid = str(peer_id)
        if self.is_member(peer_id):
            return True
        if member is None:
            return await self.confirm_member(peer_id)
        rec, why = self.admission.check(pid, member, get_dht_time())
        if rec is None:
            log.debug("caller_refused peer=%s why=%s", pid, why)
            return False
        self.signed.keep(pid, member)   # checked: we may pass it on with our hints of this caller
        return self._join_view(peer_id, rec, member.expiration)

    def _join_view(self, peer_id: PeerID, rec: PeerRecord, expiration: float) -> bool:
        """A checked record joins our view until it expires; whether its peer is now a live, compatible member."""
        pid = str(peer_id)
        # kept at most max_record_ttl_s: the expiration is whatever its owner signed (protocol/claims.py)
        expiration = expiry_cap(expiration, get_dht_time(), self.max_record_ttl_s)
        self.membership.expirations[pid] = max(self.membership.expirations.get(pid, 0.0), expiration)
        self._take({pid: rec})
        return self.is_member(peer_id)

    async def confirm_member(self, peer_id: PeerID) -> bool:
        """On the loop: whether `peer_id` has a live, compatible record. Not in our partial view: its own bucket
        is looked up (one DHT get when its level is ours; a joiner's first announcement is found at once). A
        caller found missing is not looked up again for NOT_MEMBER_CACHE_S, so a stranger costs a get at most
        that often."""
        pid = str(peer_id)
        if self.is_member(peer_id):
            return True
        if self.signed.has_offer(pid) and self.admission is not None:
            # a peer hinted at with its signed record: check the record (one signature verification) instead of a get
            rec, _why = self.signed.check(pid, self.admission, get_dht_time())
            if rec is not None and self._join_view(peer_id, rec, self.signed.kept(pid).expiration):
                return True
        now = time.monotonic()
        if now - self._not_members.get(pid, -1e9) < NOT_MEMBER_CACHE_S:
            return False
        rec = await self.membership.find(pid)
        if rec is not None:
            self._take({pid: rec})
        if self.is_member(peer_id):
            self._not_members.pop(pid, None)
            return True
        self._not_members[pid] = now
        self.hints.forget(pid)   # whoever told us of it is out of date: it is no longer a candidate
        if len(self._not_members) > 1024:
            self._not_members = {p: t for p, t in self._not_members.items() if now - t < NOT_MEMBER_CACHE_S}
        return False

    def membership_metrics(self) -> dict:
        """For each round's metrics line: the swarm-size estimate, our level, what we read from the DHT."""
        m = self.membership
        if m is None:
            return {}
        read, self._bytes_reported = m.bytes_read - self._bytes_reported, m.bytes_read   # since the last round
        gets, self._gets_reported = m.gets - self._gets_reported, m.gets
        # signed hints since the last round: handed records checked and used instead of a lookup, and refused
        used, self._hints_reported[0] = self.signed.accepted - self._hints_reported[0], self.signed.accepted
        refused, self._hints_reported[1] = self.signed.refused - self._hints_reported[1], self.signed.refused
        return {"swarm_estimate": round(m.estimate.value, 1), "buckets": 1 << m.level, "dht_bytes_read": read,
                "dht_gets": gets, "signed_hints_used": used, "signed_hints_refused": refused}

    # ------------------------------------------------------------------ shutdown (main thread)
    def withdraw(self) -> None:
        """Stop announcing and remove our record from the listing (a None with a later expiration)."""
        if self.aio is None or self.membership is None:
            return
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self.aio.run(self.membership.withdraw(), self.membership.request_timeout_s + 1)

    def close(self) -> None:
        """Stop the loop's services, then the DHT child (which takes its p2pd along). Call withdraw() first."""
        if self.aio is not None:
            if self.state_server is not None:
                shutdown_step("state_server.stop", lambda: self.aio.run(self.state_server.stop(), 10))
            if getattr(self, "relay", None) is not None:
                shutdown_step("relay.stop", lambda: self.aio.run(self.relay.stop(), 10))
            if self.p2p is not None:
                shutdown_step("p2p.shutdown", lambda: self.aio.run(self.p2p.shutdown(), 10))
            self.aio.stop()
        if self.dht is not None:
            shutdown_step("dht.shutdown", self.dht.shutdown)
