"""The peer's reachability, for the Network (peer/swarm/network.py): whether we are behind NAT (the dial-back probe
at start and, with reachability auto, again while running), the forwarders we attach to when we are, how a peer
is dialled (directly or through its forwarders) and whom we do not call. The rules are pure (protocol/reach.py);
this is the part that asks probers and switches.

A mixin of Network: it reads the network's config, DHT, p2p, relay and listing (`self.live`), and runs on the
peer's event loop like the rest of it.
"""
from __future__ import annotations

import asyncio
import logging
import time

from gasloc.peer.swarm.forward import probe, probe_addrs, relay_handler_name
from gasloc.peer.swarm.membership import BucketReader, PeerRecord
from gasloc.protocol.reach import probed_reachability, record_reach, reprobe_due, reprobed_reachability, route

log = logging.getLogger(__name__)

REPROBE_CHECK_S = 5.0  # how often a running peer with reachability auto looks at its dialable addresses (one
                       # control call to its p2pd); at most this late it notices a change (network.reprobe_every_s)


class Reachability:
    """Network's reachability side (protocol/reach.py)."""

    def _learn_reachability(self, replica) -> tuple[bool, str]:
        """(behind NAT?, how we know) by the dial-back probe of up to 5 peers: our initial peers first (a gasloc
        bootstrap answers; a lone first peer has nobody else to ask), then live peers of the run whose record says
        `direct` (whatever their configuration: every gasloc peer of the run answers probes)."""
        net = self.cfg.network
        addrs = probe_addrs(list(net.announce_maddrs) or self.maddrs)
        listing = BucketReader(self.dht, run_id=self.cfg.swarm.run_id,
                               request_timeout_s=min(10.0, self.cfg.swarm.announce_ttl_s / 3), beam=self._beam())
        found = self.aio.run(listing.probe(), net.startup_timeout_s + 1) or {}
        asked, answers = self.aio.run(self._ask_probers(replica, addrs, found), net.probe_timeout_s + 2)
        self._probed_at, self._probed_addrs = time.monotonic(), addrs
        return probed_reachability(bool(addrs), asked, answers)

    async def _ask_probers(self, p2p, addrs: list[tuple[str, int]], records: dict[str, PeerRecord]
                           ) -> tuple[int, list[bool]]:
        """(probers asked, their answers): the same probe at start and while running."""
        direct = [p for p, r in records.items() if r.reach == "direct" and p != self.peer_id]
        probers = list(dict.fromkeys([*self._bootstrap_ids(), *direct]))[:5]
        if not (addrs and probers):
            return len(probers), []
        net = self.cfg.network
        return len(probers), await probe(p2p, relay_handler_name(self.cfg.swarm.run_id), probers, addrs,
                                         net.probe_timeout_s)

    async def _dialable_now(self) -> list[tuple[str, int]]:
        """What the probe would ask probers to dial now: the announced addresses, else what libp2p reports."""
        announced = list(self.cfg.network.announce_maddrs)
        if announced:
            return probe_addrs(announced)
        return probe_addrs([str(m) for m in await self.p2p.get_visible_maddrs(latest=True)])

    async def _reprober(self) -> None:
        """Reachability auto, while running: probe again by protocol.reach.reprobe_due (every reprobe_every_s, and
        at once when our addresses change), and switch when the verdict flips (`_switch_reach`)."""
        every = self.cfg.network.reprobe_every_s
        while True:
            await asyncio.sleep(min(REPROBE_CHECK_S, every))
            try:
                addrs = await self._dialable_now()
                why = reprobe_due(time.monotonic(), self._probed_at, every, addrs, self._probed_addrs)
                if why is None:
                    continue
                self._probed_at, self._probed_addrs = time.monotonic(), addrs
                # the wrapped P2P: a probe is no exchange, so RoutedP2P's `path` of the prober stays as it was
                asked, answers = await self._ask_probers(self.p2p._p2p, addrs, self.live)
                private, source = reprobed_reachability(self.private, bool(addrs), asked, answers)
                log.info("reprobe reason=%s source=%s reachability=%s", why, source,
                         "private" if private else "public")
                if private != self.private:
                    self._switch_reach(private, source, why)
            except Exception as e:  # noqa: BLE001 - a daemon hiccup must not end re-probing for the peer's life
                log.warning("reprobe failed (%s: %s); next try in %.0f s", type(e).__name__, e,
                            min(REPROBE_CHECK_S, every))

    def _switch_reach(self, private: bool, source: str, why: str) -> None:
        """On the loop: the probe's verdict flipped. Behind NAT now: stop forwarding for others (their callers
        could not reach us) and attach to forwarders, as at start; reachable again: detach and forward. Either way
        announce at once. The DHT node keeps its mode: hivemind cannot switch a running node (a restart would
        drop our connections, attachments and a running exchange), so a peer that moved behind NAT stays a DHT
        server until it restarts - the log line says so."""
        was = "private" if self.private else "public"
        self.private, self.reach_source = private, source
        self.relay.volunteer = self.cfg.network.forwarding and not private
        if private:
            self.relay.drop_attached()
            self._keep_attached()
        else:
            self.relay.detach_all()
        self._announce_wanted.set()
        now, dht = "private" if private else "public", "client" if self.dht_client else "server"
        log.info("reachability_changed from=%s to=%s source=%s reason=%s dht=%s (kept until restart)", was, now,
                 source, why, dht)
        self.emit("reachability", reachability=now, previous=was, reachability_source=source, reason=why,
                  dht_mode=dht)

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

    async def _attach_now(self) -> None:
        self._keep_attached()

    def _via_shrank(self) -> None:
        if self._announce_wanted is not None:
            self._announce_wanted.set()

    def _keep_attached(self) -> None:
        if not self.private:
            return
        before = self.relay.via
        candidates = [*self._bootstrap_ids(), *(p for p, r in self.live.items() if r.reach == "direct" and r.forwards)]
        self.relay.keep_attached(candidates, self.cfg.network.attach_forwarders)
        if self.relay.via != before:
            self._announce_wanted.set()

