"""Joining mid-run, for the Network (peer/swarm/network.py): the state server a live peer runs for joiners (its
snapshot taken only when one asks, at the next round boundary), and the joiner's download: whom it asks and in
what order (protocol/donors.py), from the listing it takes first. The transfer itself is
peer/transport/state_transfer.py; what the daemon does with a downloaded state is peer/daemon.py
`_adopt_swarm_state`.

A mixin of Network: it reads the network's config, p2p, listing (`self.live`) and event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping

import torch
from hivemind.p2p import PeerID

from gasloc.peer.swarm.membership import PeerRecord
from gasloc.protocol.donors import pick_donors
from gasloc.runtime.aio import Stopped

log = logging.getLogger(__name__)

JOIN_RELIST_S = 0.5  # a joiner whose first listing was empty lists again at this pace (swarm.join_listing_wait_s)


class Joining:
    """Network's joining side: serving state to joiners, and downloading it as one."""

    def start_state_server(self) -> None:
        from gasloc.peer.transport.state_transfer import StateServer

        self.state_server = StateServer(self.p2p, self._get_state, self.fingerprint, self.cfg.swarm.run_id,
                                        self.cfg.state_transfer, is_member=self.confirm_member,
                                        swarm_key=self.swarm_key, hints_out=self.hints_for,
                                        hints_in=self.heard, admit=self.admit_caller,
                                        on_served=lambda **fields: self.emit("state_served", **fields))
        self.aio.run(self.state_server.start(), self.cfg.network.startup_timeout_s)

    # A joiner's snapshot is taken only when one asks: a copy of the parameters and the outer state to the CPU is
    # 3x the model's size in host memory (8 GB per round at the 1b preset), wasted in every round nobody joins.
    # The copy must be taken at a round boundary (there params == the outer anchor, and nothing writes them), so
    # the state server asks for it and waits for the training thread to reach the next boundary.

    def round_boundary(self, take: Callable[[], tuple[dict, list[torch.Tensor]]]) -> None:
        """Called by the training thread at each round boundary: takes a snapshot with `take()` when a joiner is
        waiting for one (it is then served until the next boundary), else drops the previous one."""
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, []
        if not waiters:
            self._snapshot = None  # stale now; a later joiner asks again and gets this one's successor
            return
        self._snapshot = take()
        loop = self.aio.loop
        for fut in waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    async def _get_state(self):
        """On the loop, for the state server: this boundary's snapshot, waiting for the next boundary when none
        was taken yet; None when that boundary does not come within the wait (the server answers BUSY and the
        joiner asks again; the snapshot is taken at that boundary anyway)."""
        if self._snapshot is not None:
            return self._snapshot
        fut = asyncio.get_running_loop().create_future()
        with self._waiters_lock:
            self._waiters.append(fut)
        # the joiner waits accept_timeout_s for our reply header; half of it leaves room for the answer
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.state_transfer.accept_timeout_s / 2):
                await fut
        return self._snapshot

    def _first_listing(self) -> dict[str, PeerRecord]:
        """The listing a joiner picks its donor from. The first one is taken right after our DHT node started and
        may come back before the node knows the swarm: with initial peers set, an empty one is taken again for up
        to join_listing_wait_s (a soak run's joiner started from the seed model beside five trained peers). Only
        an empty listing waits: peers started together see each other at round 0 and start at once."""
        deadline = time.monotonic() + self.cfg.swarm.join_listing_wait_s
        while not self.live and self.cfg.network.initial_peers and time.monotonic() < deadline:
            time.sleep(JOIN_RELIST_S)
            self.refresh_listing()
        return self.live

    def download_state(self, params: list[torch.Tensor], outer, exclude: Collection[str] = (),
                       first: Collection[str] = (), trust: Mapping[str, float] | None = None,
                       stop: threading.Event | None = None):
        """(donor, metadata, params) from a live peer not in `exclude`, or None when nobody is there (a fresh swarm)
        or no donor delivered a verified state in time. `donor` is the transport's peer id, metadata's round the
        reply header's (checked against the metadata: protocol/donors.py). `outer` gives the outer state's specs,
        which a donor of an older build still sends: it is downloaded, never returned. `first`: donors to ask before
        the others (a DiLoCo fork: the members holding its group's model), if they are candidates at all; `trust`
        (peer -> score) of the peers whose trust our guard lowered: asked after all others (pick_donors). Once
        `stop` is set (a stop signal) the download is given up within runtime/aio.POLL_S: None."""
        from gasloc.peer.transport.state_transfer import StateDownloadError, download_state, payload_time_s
        from gasloc.protocol.messages import TensorSpec, payload_bytes

        live = self._first_listing()
        # Only peers that trained at least one round (peers started together all hold the seed model already),
        # not peers we cannot reach (behind NAT while we are public, or NATed without a forwarder). Ordered by
        # tenure, how long we have seen them (protocol/donors.py): the announced round is a claim, and the top 3
        # by claim were a Sybil's for the asking (round 10^9). A donor that fails (dies mid-transfer, busy,
        # garbage, lying metadata) is skipped for the next.
        skip = self.uncallable()
        # a peer that announces a round past what we believe of it (protocol/claims.py) lies, and is no donor; one
        # whose reply claims more than that is refused before its payload is read
        believed = {p: r for p, r in self.believed_rounds().items() if p not in skip}
        # what each listing claims: it orders no donor, and a reply that serves a state well behind it is refused
        claimed = {p: r.round for p, r in live.items()}
        donors = pick_donors(believed, {p: r.state for p, r in live.items()}, self.tenure(),
                             pool=self.cfg.swarm.join_donor_pool, rng=random.Random(), exclude=exclude,
                             claimed_rounds=claimed, first=first, trust=trust)
        if not donors:
            log.info("join: no live peer has trained yet; starting from the seed model")
            return None
        specs = [(tuple(t.shape), t.dtype) for t in params]
        outer_specs = [(tuple(t.shape), t.dtype) for t in outer.state_dict().values()]
        low = [f"{d[-6:]}={trust[d]:.2f}" for d in donors if d in (trust or {})]
        log.info("join: downloading state, candidate donors=%d%s", len(donors),
                 f" (trust lowered by our guard, asked last: {', '.join(low)})" if low else "")
        coro = download_state(self.p2p, [PeerID.from_base58(d) for d in donors], specs, self.fingerprint,
                              self.cfg.state_transfer, self.cfg.swarm.run_id, outer_specs=outer_specs,
                              swarm_key=self.swarm_key, hints_in=self.heard, member=self.member_out(),
                              round_caps=self.round_caps(), listed_rounds=claimed)
        # join_timeout_s is for the waits (listing, replies, BUSY donors); each candidate's payload gets its own time
        # at the slowest rate we accept, or a state bigger than ~join_timeout_s x min_rate (120 s at 2 Mbit/s: 30 MB,
        # a 7.5M-parameter model; a 1b model's 4.4 GB needed 300 Mbit/s) could never be downloaded on a link that slow
        state_bytes = payload_bytes([TensorSpec.of(*s) for s in specs + outer_specs])
        budget_s = self.cfg.swarm.join_timeout_s + len(donors) * payload_time_s(self.cfg.state_transfer, state_bytes)
        try:
            metadata, tensors = self.aio.run(coro, budget_s, stop=stop)
        except Stopped:
            log.info("join: stopping; the state download is given up")
            return None
        except TimeoutError:
            log.warning("join: no state within %.0f s (join_timeout_s=%.0f and %d donors' payload time at "
                        "min_rate_mbit=%g); starting from the seed model", budget_s, self.cfg.swarm.join_timeout_s,
                        len(donors), self.cfg.state_transfer.min_rate_mbit)
            return None
        except StateDownloadError as e:
            log.warning("join: %s; starting from the seed model", e)
            return None
        # a donor of an older build also serves its outer state (momentum), and a DiLoCo donor does (its momentum
        # is the one model's): handed over in metadata["outer_tensors"], adopted by DiLoCo only (peer/daemon.py)
        n_params = len(tensors) - int(metadata.get("num_outer", 0))
        donor = str(metadata["peer_id"])      # the stream's remote peer (state_transfer.py), never a claim
        log.info("join: state of round %s from %s", metadata.get("round"), donor)
        return donor, {**metadata, "outer_tensors": tensors[n_params:]}, tensors[:n_params]
