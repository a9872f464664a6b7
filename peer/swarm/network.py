"""The peer's network side: one DHT (and so one p2pd) per peer, the p2p replica that the Exchanger and the state
server use, the membership record and its refresh, and the state download of a joining peer.

Every coroutine here runs on the peer's event loop (runtime/aio.py); the methods without `async` are called from the
training thread and hand work to that loop with a deadline.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import PeerID

from gasloc.peer.swarm.absence import AbsenceWatch
from gasloc.peer.swarm.forward import RelayService, RoutedP2P, probe_addrs
from gasloc.peer.swarm.membership import Membership, PeerRecord, make_validators
from gasloc.protocol.messages import PROTOCOL_VERSION, fingerprint
from gasloc.protocol.reach import probed_reachability, record_reach, route
from gasloc.runtime.aio import LoopThread
from gasloc.runtime.lifecycle import StartupError, shutdown_step
from gasloc.runtime.safeproc import SafeDHT

if TYPE_CHECKING:
    from gasloc.peer.config import PeerConfig

log = logging.getLogger(__name__)

LIST_PERIOD_S = 1.0   # how often the live-peer cache is refreshed (a DHT get costs ~20 ms on a healthy swarm)


@dataclass(frozen=True)
class PeerStatus:
    """The training side's state as our DHT record announces it."""
    state: str
    round: int
    throughput_tps: float
    bandwidth_bps: float


async def _make_events() -> tuple[asyncio.Event, asyncio.Event]:
    return asyncio.Event(), asyncio.Event()  # created on the loop that waits on them


class Network:
    def __init__(self, cfg: PeerConfig, status: Callable[[], PeerStatus]):
        self.cfg = cfg
        self.status = status  # what our record says about us, read at each announcement
        self.dht: SafeDHT | None = None
        self.aio: LoopThread | None = None
        self.p2p = None
        self.membership: Membership | None = None
        self.state_server = None
        self.live: dict[str, PeerRecord] = {}      # compatible live peers, as of the last listing
        self.peer_id, self.maddrs, self.fingerprint = "", [], ""
        self.signer = None
        self._tasks: list = []
        self.listed_at = 0.0
        self._snapshot = None
        self.absence: AbsenceWatch | None = None  # set when the loop that ticks it starts
        self.relay: RelayService | None = None
        self.private, self.reach_source = False, "config"

    # ------------------------------------------------------------------ startup (main thread)
    def start_dht(self) -> None:
        net = self.cfg.network
        self.signer, validators = make_validators(self.cfg.swarm.run_id)
        # known to be behind NAT: a DHT client (a NATed node that hosts keys makes them flaky for everyone, and
        # others' requests to it only time out) with libp2p's auto-relay on (circuit addresses, hole punching where
        # the addresses allow it; our exchanges do not rely on it: docs/nat.md)
        nat = {"client_mode": True, "use_auto_relay": True} if net.reachability == "private" else {}
        dht = SafeDHT(initial_peers=net.initial_peers or None, start=False, record_validators=validators,
                      host_maddrs=net.listen_maddrs, announce_maddrs=net.announce_maddrs or None,
                      identity_path=net.identity_path, startup_timeout=net.startup_timeout_s, **nat)
        self.dht = dht
        try:
            dht.run_in_background(await_ready=True, timeout=net.startup_timeout_s + 5)
        except Exception as e:  # noqa: BLE001 - whatever hivemind raised, the user gets one line and exit 1
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise StartupError(f"could not start the DHT node ({type(e).__name__}: {first}); check "
                                   f"--initial-peers (are those peers running and reachable?) and "
                                   f"--host-maddrs") from None
        self.peer_id = dht.peer_id.to_base58()
        self.maddrs = [str(m) for m in dht.get_visible_maddrs()]
        if not net.initial_peers:
            public = [m for m in self.maddrs if "/127.0.0.1/" not in m and "/::1/" not in m] or self.maddrs
            log.warning("no initial peers: starting a new swarm; others join with --initial-peers %s",
                        public[0] if public else "<this peer's multiaddr>")
        log.info("dht_started peer_id=%s maddrs=%s", self.peer_id, ",".join(self.maddrs))

    def compute_fingerprint(self, model: torch.nn.Module, vocab_size: int) -> str:
        """Everything two peers must share to mix tensors: shapes, and what the sent tensors mean."""
        m, o = self.cfg.model, self.cfg.outer
        self.fingerprint = fingerprint(
            protocol=PROTOCOL_VERSION, preset=m.preset, seq_len=m.seq_len, rope_theta=m.rope_theta,
            vocab_size=vocab_size, shapes=[list(p.shape) for p in model.parameters()],
            algorithm=o.algorithm, form=o.form if o.algorithm in ("gasloc", "gossip") else None, seed=self.cfg.run.seed)
        return self.fingerprint

    def start_services(self) -> None:
        """The event loop thread, the p2p replica (same daemon and peer id as the DHT) and the membership."""
        self.aio = LoopThread()
        timeout = self.cfg.network.startup_timeout_s
        self.p2p = RoutedP2P(self.aio.run(self.dht.replicate_p2p(), timeout), self.cfg.swarm.run_id, self._via_of)
        self.membership = Membership(self.dht, self.signer, run_id=self.cfg.swarm.run_id, peer_id=self.peer_id,
                                     fingerprint=self.fingerprint, protocol=PROTOCOL_VERSION,
                                     ttl_s=self.cfg.swarm.announce_ttl_s,
                                     # a store or get stuck on an unresponsive DHT node must not outlive a refresh
                                     request_timeout_s=min(10.0, self.cfg.swarm.announce_ttl_s / 3))
        net = self.cfg.network
        self.relay = RelayService(self.p2p, is_member=self.is_member, volunteer=False,
                                  max_circuits=net.forward_max_circuits, max_attached=net.forward_max_attached,
                                  circuit_timeout_s=self.cfg.exchange.exchange_timeout_s + 5)
        self.aio.run(self.relay.start(), timeout)
        self.live = self.aio.run(self.membership.live_peers(), timeout) or {}
        self.private, self.reach_source = self._learn_reachability()
        self.relay.volunteer = net.forwarding and not self.private
        self.aio.run(self.membership.announce(self._record()), timeout)
        self.listed_at = time.monotonic()
        self._announce_wanted, self._list_wanted = self.aio.run(_make_events(), timeout)
        self.absence = AbsenceWatch()
        self._tasks = [self.aio.submit(self._announcer()), self.aio.submit(self._lister()),
                       self.aio.submit(self._watch())]

    # ------------------------------------------------------------------ reachability (protocol/reach.py)
    def _learn_reachability(self) -> tuple[bool, str]:
        """(behind NAT?, how we know): the config, or the dial-back probe of up to 5 live peers."""
        net = self.cfg.network
        if net.reachability != "auto":
            return net.reachability == "private", "config"
        addrs = probe_addrs(list(net.announce_maddrs) or self.maddrs)
        # bootstrap nodes first: they are meant to be public, and a lone first peer has nobody else to ask
        probers = [*self._bootstrap_ids(), *(p for p, r in self.live.items() if r.reach == "direct")][:5]
        answers = []
        if addrs and probers:
            answers = self.aio.run(self.relay.probe(probers, addrs, net.probe_timeout_s), net.probe_timeout_s + 2)
        return probed_reachability(bool(addrs), len(probers), answers)

    @property
    def reach(self) -> str:
        return record_reach(self.private, len(self.relay.via))

    def _via_of(self, peer: str) -> list[str] | None:
        """RoutedP2P's question: None to dial `peer` directly, else its forwarders."""
        rec = self.live.get(peer)
        if rec is None or rec.reach == "direct":
            return None
        # a forwarder of theirs that is us: we hold their attachment, so a direct stream rides on it
        via = [f for f in rec.via if f != self.peer_id]
        return via if len(via) == len(rec.via) else None

    def uncallable(self) -> set[str]:
        """Live peers we do not call (they call us, or nobody can reach them): protocol.reach.route."""
        ours = "direct" if not self.private else self.reach
        return {p for p, r in self.live.items() if route(ours, r.reach, r.via) is None}

    def _bootstrap_ids(self) -> list[str]:
        """Peer ids of our initial peers (a gasloc bootstrap answers probes and forwards; a peer id that turns
        out to be a plain hivemind node just refuses, and we try the next)."""
        ids = [m.rsplit("/p2p/", 1)[1] for m in self.cfg.network.initial_peers if "/p2p/" in m]
        return [i for i in dict.fromkeys(ids) if i != self.peer_id and i not in self.live]

    def nat_metrics(self) -> dict:
        """For each round's metrics line: our record's reachability, forwarders held, what we forwarded so far."""
        r = self.relay
        if r is None:
            return {}
        return {"reach": self.reach, "via": len(r.via), "forwarded_bytes": r.forwarded_bytes,
                "forwarded_circuits": r.forwarded_circuits}

    def _keep_attached(self) -> None:
        if not self.private:
            return
        before = self.relay.via
        candidates = [*self._bootstrap_ids(), *(p for p, r in self.live.items() if r.reach == "direct" and r.forwards)]
        self.relay.keep_attached(candidates, self.cfg.network.attach_forwarders)
        if self.relay.via != before:
            self._announce_wanted.set()

    def start_state_server(self) -> None:
        from gasloc.peer.transport.state_transfer import StateServer

        self.state_server = StateServer(self.p2p, self._get_state, self.fingerprint, self.cfg.swarm.run_id,
                                        self.cfg.state_transfer)
        self.aio.run(self.state_server.start(), self.cfg.network.startup_timeout_s)

    # ------------------------------------------------------------------ membership
    # Two background tasks own the DHT traffic, so no round ever awaits the DHT: a slow or frozen DHT node (its
    # RPCs time out after seconds) then delays what others learn about us, never our training or partner search.

    def _record(self) -> PeerRecord:
        s = self.status()
        return self.membership.record(state=s.state, round=s.round, throughput_tps=s.throughput_tps,
                                      bandwidth_bps=s.bandwidth_bps, reach=self.reach, via=self.relay.via,
                                      forwards=self.relay.volunteer)

    def announce(self, wait: bool = False) -> None:
        """Announce the peer's current state: in the background (one store at a time, the latest state wins), or
        with `wait`, right now from the calling (training) thread."""
        if wait:
            self.aio.run(self.membership.announce(self._record()), self.membership.request_timeout_s + 1)
        else:
            self.aio.loop.call_soon_threadsafe(self._announce_wanted.set)

    def request_listing(self, max_age_s: float = 0.0) -> None:
        """On the loop: ask the lister for a fresh listing unless the cached one is younger than max_age_s."""
        if time.monotonic() - self.listed_at >= max_age_s:
            self._list_wanted.set()

    async def _announcer(self) -> None:
        every = self.cfg.swarm.announce_ttl_s / 3
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._announce_wanted.wait(), every)
            self._announce_wanted.clear()
            await self.membership.announce(self._record())

    async def _lister(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._list_wanted.wait(), LIST_PERIOD_S)
            self._list_wanted.clear()
            found = await self.membership.live_peers()
            # a DHT that did not answer (a frozen or overloaded node) keeps the last listing, minus what expired:
            # an empty list here would make every partner a stranger to our Exchanger (NOT_MEMBER)
            self.live = found if found is not None else self.membership.prune(self.live)
            self.listed_at = time.monotonic()
            self._keep_attached()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.absence.TICK_S)
            self.absence.tick()

    def refresh_listing(self) -> None:
        """A listing taken now, from the training thread (after a stop, the cached one predates it)."""
        try:
            found = self.aio.run(self.membership.live_peers(), self.membership.request_timeout_s + 1)
        except TimeoutError:
            return
        if found is not None:
            self.live, self.listed_at = found, time.monotonic()

    def ready_peers(self) -> dict[str, PeerRecord]:
        """Compatible peers that were ready to exchange at the last listing (at most LIST_PERIOD_S old)."""
        return {pid: r for pid, r in self.live.items() if r.state == "exchanging"}

    def is_member(self, peer_id: PeerID) -> bool:
        return str(peer_id) in self.live

    # ------------------------------------------------------------------ state transfer
    def publish_state(self, snapshot) -> None:
        """Called by the training thread at each round boundary: what joiners download until the next one."""
        self._snapshot = snapshot

    def _get_state(self):
        return self._snapshot

    def download_state(self, params: list[torch.Tensor], outer):
        """(donor, metadata, params, outer_state) from a live peer, or None when nobody is there (a fresh swarm)
        or no donor delivered a verified state in time (then the peer starts from the seed model, logged)."""
        from gasloc.peer.transport.state_transfer import StateDownloadError, download_state

        live = self.live
        # most advanced first; a donor that fails (dies mid-transfer, busy, garbage) is skipped for the next
        # Only peers that trained at least one round: peers started together all hold the seed model already.
        # (and not peers we cannot reach: behind NAT while we are public, or NATed without a forwarder)
        skip = self.uncallable()
        donors = sorted((pid for pid, r in live.items() if r.state != "joining" and r.round > 0 and pid not in skip),
                        key=lambda p: -live[p].round)
        if not donors:
            log.info("join: no live peer has trained yet; starting from the seed model")
            return None
        outer_names = list(outer.state_dict())
        specs = [(tuple(t.shape), t.dtype) for t in params]
        outer_specs = [(tuple(t.shape), t.dtype) for t in outer.state_dict().values()]
        log.info("join: downloading state, candidate donors=%d", len(donors))
        coro = download_state(self.p2p, [PeerID.from_base58(d) for d in donors], specs, self.fingerprint,
                              self.cfg.state_transfer, self.cfg.swarm.run_id, outer_specs=outer_specs)
        try:
            metadata, tensors = self.aio.run(coro, self.cfg.swarm.join_timeout_s)
        except TimeoutError:
            log.warning("join: no state within join_timeout_s=%.0f; starting from the seed model",
                        self.cfg.swarm.join_timeout_s)
            return None
        except StateDownloadError as e:
            log.warning("join: %s; starting from the seed model", e)
            return None
        n_outer = int(metadata.get("num_outer", 0))
        n_params = len(tensors) - n_outer
        outer_state = dict(zip(outer_names, tensors[n_params:])) if n_outer == len(outer_names) else {}
        donor = str(metadata.get("peer_id", "peer"))
        log.info("join: state of round %s from %s (outer state: %s)", metadata.get("round"), donor,
                 "yes" if outer_state else "no")
        return donor, metadata, tensors[:n_params], outer_state

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
