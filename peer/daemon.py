"""`gasloc peer`: one live peer's lifecycle, startup -> main_loop -> shutdown.

Threads: the training loop runs in the main thread (which also owns the signal handlers and forks the DHT and
averager children: their death signal is tied to it); the peer's asyncio work - DHT calls, announcements, the
Exchanger, the state server - runs on a uvloop in its own thread (runtime/aio.py). The training thread only waits on
that loop where a round explicitly asks for it (finding a partner), always with a deadline.

Failure semantics: a round's communication either completes and passes its checks (outcome ok, mixed in) or is
skipped (a solo round: outer.apply(params, sent)); nothing waits for the swarm. SIGINT/SIGTERM set a flag: the
current round finishes (or its exchange aborts at its deadline), a checkpoint is written if configured, the DHT
record is withdrawn, and every child (DHT, p2pd, averager) is shut down before exit 0. A second signal (more than a
second after the first: gasloc.runtime.procs.StopSignals) exits at once (130); the children then die through their death
signal (runtime/safeproc.py).
"""
from __future__ import annotations

import fcntl
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from gasloc.peer.checkpoint import CheckpointWriter
from gasloc.peer.config import PeerConfig
from gasloc.peer.fault import NoFault, guard_seen, make_fault
from gasloc.peer.fingerprint import run_fingerprint
from gasloc.peer.metrics import JsonlSink, MetricsSink, NullSink
from gasloc.peer.swarm.absence import resync_due
from gasloc.peer.swarm.gossip import Background
from gasloc.peer.swarm.network import Network, PeerStatus
from gasloc.peer.swarm.round_report import RoundExchange, relative_distance
from gasloc.peer.train.data import build_data, evaluate, private_batches
from gasloc.peer.train.inner import make_inner_optimizer, run_inner_phase
from gasloc.peer.train.memory import (
    DoesNotFit,
    RoundPeak,
    check_fit,
    compact_host_heap,
    evaluate_with,
    is_out_of_memory,
    oom_refusal,
    outgoing_specs,
    write_oom_marker,
)
from gasloc.peer.train.model import autocast_for, build_model, maybe_compile
from gasloc.peer.train.outer import make_outer, round_mix_momentum_applied
from gasloc.peer.transport.staging import Staging
from gasloc.protocol.averaging import mix_pair_, pair_weight, round_mix_momentum
from gasloc.protocol.decision import Decision, MixJudge, PrivateChecks
from gasloc.protocol.donors import adopted_round, cross_check
from gasloc.protocol.guard import FarStreak, swarm_ahead
from gasloc.runtime.lifecycle import StartupError, shutdown_step
from gasloc.runtime.procs import StopSignals
from gasloc.runtime.safeproc import remove_own_shm

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ERROR, EXIT_FORCED = 0, 1, 130
# out of memory: at start (the round does not fit) or mid-run; the same settings then refuse at once on a restart
EXIT_NO_MEMORY = DoesNotFit.exit_code
LINK_DECAY = 0.9  # per exchange: a link estimate from 20 exchanges ago counts for 0.9^20 = 12%
MAX_RECOVERIES = 3  # non-finite losses in a row, each recovered from the last checkpoint, before the peer gives up


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise StartupError("run.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu")


def lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on <run_dir>/.lock for the peer's lifetime: two peers never share metrics or
    checkpoints. The kernel drops the lock when the process dies, so a kill -9 leaves nothing stale."""
    run_dir.mkdir(parents=True, exist_ok=True)
    f = (run_dir / ".lock").open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StartupError(f"run directory {run_dir} is in use by another peer; give each peer its own "
                               f"--run-dir") from None
    return f


def worker_seed(run_dir: Path) -> str:
    """This peer's data-stream seed: random on first start, kept in the run directory, so two peers never read
    the same window sequence and a resumed peer continues its own stream where its checkpoint left it."""
    path = run_dir / "worker_seed"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(secrets.token_hex(8) + "\n")
        os.replace(tmp, path)
    return path.read_text().strip()


@dataclass
class InnerPhase:
    steps: int
    loss: float
    compute_s: float
    lr: float  # the inner lr of the phase's last step


@dataclass
class RoundStart:
    """What a round cut short by a stop signal is rolled back to (the parameters come back from the outer anchor,
    which is the previous round boundary's state)."""
    data_state: dict
    inner_steps_total: int


@dataclass
class Pending:
    """outer.overlap: a round whose exchange is still running in the background."""
    sent: list[torch.Tensor]
    background: Background
    eval_due: bool


class Peer:
    def __init__(self, cfg: PeerConfig, sink: MetricsSink | None = None):
        self.cfg = cfg
        self.metrics_url: str | None = None  # the Prometheus endpoint, when metrics.port is set
        self.stopping = threading.Event()
        self.stop_reason = "finished"
        self._signals = StopSignals()
        self._sink_override = sink
        self.sink: MetricsSink = NullSink()
        self.round = 0
        self.inner_steps_total = 0
        self.state = "joining"
        self.throughput_tps = 0.0
        self.bandwidth_bps = 0.0
        self.peer_id = ""
        self.net = None        # gasloc.peer.swarm.network.Network: DHT, p2p, membership, state server
        self.averaging = None  # GossipAveraging | DilocoAveraging
        self._lock_file = None
        self._saved_round = 0
        self._round_s: deque[float] = deque(maxlen=10)  # recent round durations: the yardstick for an absence
        # what our DHT record tells status views (gasloc status): last losses and recent partners
        self._last_loss: float | None = None
        self._last_val_loss: float | None = None
        self._partners: deque[str] = deque(maxlen=4)
        self._pending: Pending | None = None  # outer.overlap: the previous round's exchange in the background
        self._landed: tuple[RoundExchange, float | None, float | None] | None = None  # ... once mixed in
        # False from a round's first inner step to its boundary: an exception in between leaves a state that is
        # neither the last round's nor the next one's, and shutdown then writes no checkpoint
        self._at_boundary = True
        self._recoveries = 0
        self._checkpoints = CheckpointWriter()  # checkpoints are written off the training thread
        self.fault: NoFault = NoFault()
        self._resumed = False  # started from our own checkpoint: maybe far behind a swarm that went on
        self._far = FarStreak(cfg.guard.catch_up_after_rejections)  # our recent far rejections in a row
        self._catch_up: str | None = None  # why the guard's verdicts say we should download the swarm's state
        self._donors_first: tuple[str, ...] = ()  # DiLoCo, our group's model held by another: ask them first

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Start, train until a limit or a signal, shut down; returns the exit code. StartupError (one line
        for the user) propagates after everything started so far was shut down."""
        self._install_signals()
        try:
            self._startup()
            if not self.stopping.is_set():
                self._main_loop()
        except StartupError:
            self.stop_reason = "startup_failed"
            raise
        except DoesNotFit:
            self.stop_reason = "out_of_memory"
            raise
        finally:
            self._shutdown()
        return EXIT_OK

    def _install_signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        kind = self._signals.classify()
        if kind == "force":
            os.write(2, b"second signal: exiting now without a clean shutdown\n")
            os._exit(EXIT_FORCED)
        if kind == "repeat":
            return
        self.stop_reason = signal.Signals(signum).name
        log.info("stopping signal=%s (send it again in a second to exit at once)", self.stop_reason)
        self.stopping.set()

    def _startup(self) -> None:
        from gasloc.runtime.procs import emit_ready

        cfg = self.cfg
        self.run_dir = cfg.run_dir
        self._lock_file = lock_run_dir(self.run_dir)
        self.sink = self._sink_override or self._make_sink()
        self.device = pick_device(cfg.run.device)
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        if self.device.type == "cpu" and cfg.run.compact_host_heap:   # before the dry run and the model
            compact_host_heap()
        refusal = oom_refusal(self.run_dir, cfg, self.device)  # before anything starts: no crash loop
        if refusal is not None:
            raise DoesNotFit(refusal)

        try:  # before any networking: a bad data setting fails in a second, not after joining the swarm
            self.data, tok = build_data(cfg.data, cfg.model.seq_len, worker_seed=worker_seed(self.run_dir))
        except ValueError as e:
            raise StartupError(f"data: {e}") from None

        # The DHT child is forked from the main thread (its death signal is tied to this thread), before the model
        # exists: a small fork.
        self.net = Network(cfg, status=self._status, emit=self.sink.emit)
        self.net.start_dht()
        self.peer_id = self.net.peer_id

        # one dry inner and outer step on a throwaway model: refuse now, in one line, what would run out of memory
        # mid-round (peer/train/memory.py); before the model exists, so the two never coexist
        self.fit = check_fit(cfg, tok.vocab_size, self.device, staging=Staging)
        self._peak = RoundPeak(self.device)
        self.model = build_model(cfg.model, tok.vocab_size, seed=cfg.run.seed).to(self.device)
        maybe_compile(self.model, cfg.model, self.device)
        self.params = list(self.model.parameters())
        self.opt = make_inner_optimizer(self.model, cfg.inner)
        self.outer = make_outer(cfg.outer, self.params)
        self.fingerprint = self.net.fingerprint = run_fingerprint(cfg, self.model, tok)
        self.tokenizer_name = cfg.data.tokenizer
        # our mix decisions (protocol/decision.py); its sketch's seed is ours alone, so no partner can aim at it
        self.guard = MixJudge(cfg.guard, seed=secrets.randbits(63))
        self._far = self.guard.streak  # one far-rejection streak: the judge's
        self.val_batches = self.data.val_batches()
        # tests only (peer/fault.py; a no-op otherwise); the hostile bias modes size their offers from our guard's tau
        self.fault = make_fault(cfg.fault, self.params, seen=lambda: guard_seen(self.guard),
                                anchor=lambda: self.outer.anchor)

        self.averaging = self._make_averaging()  # DiLoCo forks its averager here (main thread)
        self._install_signals()  # hivemind's averager start sets SIGINT to SIG_IGN in this process
        self.net.start_services()
        joined_from = self._resume_or_join()
        self.net.start_state_server()
        # what the exchange carries: the shapes of outer.outgoing (NoLoCo sends two tensors per parameter)
        self.averaging.start(outgoing_specs(cfg.outer, self.params), self.fingerprint)
        self._set_state("training", wait=True)

        initial_loss = evaluate(self.model, self.val_batches, autocast_for(self.device))
        n_params = sum(p.numel() for p in self.params)
        self.sink.emit("start", peer_id=self.peer_id, fingerprint=self.fingerprint,
                       algorithm=cfg.outer.algorithm, initial_loss=initial_loss, joined_from=joined_from,
                       memory_need_mb=self.fit.need_bytes / 1e6, memory_headroom_mb=self.fit.headroom.bytes / 1e6,
                       peak_mem_per_round=self._peak.resettable,
                       round=self.round, num_params=n_params, device=str(self.device), maddrs=self.net.maddrs,
                       metrics_url=self.metrics_url,
                       reachability="private" if self.net.private else "public",
                       reachability_source=self.net.reach_source,
                       dht_mode="client" if self.net.dht_client else "server", codec=self.cfg.exchange.codec)
        log.info("ready peer_id=%s round=%d initial_loss=%.4f joined_from=%s device=%s params=%d reachability=%s "
                 "source=%s dht=%s codec=%s", self.peer_id, self.round, initial_loss, joined_from, self.device,
                 n_params, "private" if self.net.private else "public", self.net.reach_source,
                 "client" if self.net.dht_client else "server", self.cfg.exchange.codec)
        emit_ready("peer", self.peer_id, self.net.maddrs)

    def _make_sink(self) -> MetricsSink:
        """metrics.jsonl, and with metrics.port the Prometheus endpoint: the same events feed both."""
        jsonl = JsonlSink(self.run_dir / "metrics.jsonl")
        if self.cfg.metrics.port is None:
            return jsonl
        from gasloc.peer.prometheus import PrometheusSink, TeeSink
        try:
            prom = PrometheusSink(self.cfg.metrics)
        except OSError as e:
            jsonl.close()
            raise StartupError(f"metrics.port {self.cfg.metrics.port} on {self.cfg.metrics.host}: {e.strerror or e}"
                               ) from None
        self.metrics_url = prom.url
        return TeeSink(jsonl, prom)

    def _make_averaging(self):
        if self.cfg.outer.algorithm == "diloco":
            from gasloc.peer.swarm.diloco import DilocoAveraging
            return DilocoAveraging(self.cfg, self.net, self.params, stopping=self.stopping,
                                   set_state=self._set_state, anchor=lambda: self.outer.anchor,
                                   serve=lambda: self.net.round_boundary(self._anchor_snapshot))
        from gasloc.peer.swarm.gossip import GossipAveraging
        # a CPU peer hands the exchange's buffers back between rounds: the inner phase's gradients reuse that memory
        return GossipAveraging(self.cfg, self.net, stopping=self.stopping, set_state=self._set_state,
                               own_link=lambda: self.bandwidth_bps, keep_buffers=self.device.type != "cpu")

    def _resume_or_join(self) -> str | None:
        """Resume beats downloading: a checkpoint holds this peer's own inner-optimizer state and data position."""
        loaded = self._load_checkpoint()
        if loaded is not None:
            self.round = self._saved_round = loaded.round
            self.data.load_state_dict(loaded.data_state)
            self.inner_steps_total = int(loaded.meta.get("inner_steps", 0))
            self._resumed = True
            return "checkpoint"
        if not self.cfg.swarm.join_from_peers or self.stopping.is_set():
            return None
        return self._adopt_swarm_state(fresh=True)

    def _adopt_swarm_state(self, donors_first: Collection[str] = (), fresh: bool = False) -> str | None:
        """Download the swarm's parameters and round and take them over; the donor's id (the transport's), or None
        when no donor delivered. Our inner optimizer and data position stay ours, and so does our outer state: it
        is reset to the adopted parameters (a donor's momentum is never adopted: a shifted z_prev would jump the
        model at our next outer step).

        Each state is checked on batches only we know (data.private_batches: the validation batches are the same
        for every peer, so a state could be tuned to pass them). A `fresh` joiner's must beat its own untrained
        model by guard.val_margin: a donor claims rounds of training, and "no worse than untrained" let in the seed
        state itself (a donor serving its start state as round 14, bench/adversary.py donor-zprev: 4 adoptions) and,
        on a lucky batch, a state fitted to the shared validation batch (donor-tuned: 1 in 12 joins). A resync's
        must be no worse than our trained model by guard.val_margin. With swarm.join_cross_check a second donor's
        state is downloaded too, and the two are compared by distance (protocol/donors.py cross_check). The round
        taken over is the lower of the donors' rounds, cut to what we believe of the donor (protocol/claims.py).

        A stop signal gives the download up (None: we keep, and checkpoint, the state we hold): a donor that
        trickles its state, or several in turn, would otherwise hold the stop for its whole join budget, past the
        grace a supervisor gives (docker's 10 s by default) and into a SIGKILL that loses every unsaved round. A
        state already checked is dropped too: adopted without the second donor's cross-check it would be one
        donor's word, and a restarted peer catches up anyway (_catch_up_at_resume)."""
        swarm = self.cfg.swarm
        checks = private_batches(self.data, swarm.join_check_batches)
        own_loss = self._evaluate_at(self.params, checks)
        tried: set[str] = set()
        states: list[tuple[str, int, list[torch.Tensor], float]] = []   # (donor, round, params, loss) that passed
        outer_of: dict[str, list[torch.Tensor]] = {}  # DiLoCo: each donor's outer state (its momentum)
        trust = self._lowered_trust()   # no partner is judged while we download: one reading for every donor
        for _ in range(swarm.join_donor_pool + (1 if swarm.join_cross_check else 0)):
            got = self.net.download_state(self.params, self.outer, exclude=tried, first=donors_first, trust=trust,
                                          stop=self.stopping)
            if got is None or self.stopping.is_set():
                break
            donor, metadata, params = got
            tried.add(donor)
            params = [t.to(self.device) for t in params]
            # the donor's sha256 proves transit integrity only: check what it sent on batches of our own
            loss = self._evaluate_at(params, checks)
            margin = self.cfg.guard.val_margin
            if not (math.isfinite(loss) and loss <= own_loss * (1 - margin if fresh else 1 + margin)):
                log.warning("join: rejected the state of %s code=DISTRUSTED: its loss on our own batches is %.4f, "
                            "our own %smodel's %.4f; trying another donor", _short(donor), loss,
                            "untrained " if fresh else "", own_loss)
                continue
            states.append((donor, int(metadata["round"]), params, loss))
            outer_of[donor] = metadata.get("outer_tensors") or []
            if len(states) == (2 if swarm.join_cross_check else 1):
                break
        if self.stopping.is_set():
            log.info("join: stopping; %d checked state%s given up, the state we hold is kept", len(states),
                     "" if len(states) == 1 else "s")
            return None
        if not states:
            return None
        donor, _, params, _ = states[0]
        if len(states) == 2:
            (a, ra, pa, la), (b, rb, pb, lb) = states
            check = cross_check(relative_distance(pb, pa), la, lb, agree=swarm.join_agree)
            first = check.first
            if check.agreed and not self.outer.solo_steps:
                # DiLoCo: two checked states of one model a few epochs apart; the later one, or we are behind at
                # once (a joiner that took a donor 3 epochs back spent 30 s rate-limited at every other donor)
                first = ra >= rb
            donor, params = (a, pa) if first else (b, pb)
            log.log(logging.INFO if check.agreed else logging.WARNING, "join: cross-check of %s and %s: %s; "
                    "adopting %s", _short(a), _short(b), check.reason, _short(donor))
        elif swarm.join_cross_check:
            log.info("join: no second donor to cross-check %s against", _short(donor))
        with torch.no_grad():
            for p, t in zip(self.params, params):
                p.copy_(t)
        self._adopt_outer(outer_of.get(donor, []))
        believed = self.net.round_caps().get(donor)   # the most we believe it can have reached by now
        # DiLoCo: the round is the epoch of the adopted anchor itself (the other donor's would key our next group to
        # an epoch our model is not at)
        taken = [r for d, r, _, _ in states if self.outer.solo_steps or d == donor]
        self.round = adopted_round(taken, believed)
        # the one line that names the adopted donor in full (the transport's id): bench/adversary.py counts these
        log.info("join: adopted the state of %s round=%d (donors checked: %s)", donor, self.round,
                 ",".join(d for d, _, _, _ in states))
        self.guard.clear()  # a new model: distances measured from the old one say nothing (fresh-joiner rule)
        self._far.clear()
        return donor

    def _lowered_trust(self) -> dict[str, float]:
        """peer -> trust of the peers whose tensors our guard clipped or rejected lately: asked last for a state
        (protocol/donors.py pick_donors)."""
        policy = getattr(self.averaging, "policy", None)    # gossip's partner policy; DiLoCo has no trust book
        return policy.lowered_trust(time.monotonic()) if policy is not None else {}

    def _adopt_outer(self, outer: list[torch.Tensor]) -> None:
        """Our outer state after a download: reset to the adopted parameters, except for DiLoCo, which takes the
        donor's momentum when it came: DiLoCo is one model, and with a momentum of its own a peer's next steps would
        part from its group's for good (its groupmates are trusted with the mean anyway: peer/swarm/diloco.py)."""
        names = list(self.outer.state_dict())
        if not self.outer.solo_steps and outer and len(outer) == len(names):
            try:
                self.outer.load_state_dict({n: t.to(self.device) for n, t in zip(names, outer)}, self.params)
                return
            except ValueError as e:  # wrong shapes: a donor of another build
                log.warning("join: the donor's outer state does not fit (%s); starting it afresh", e)
        self.outer.reset(self.params)

    def _maybe_resync(self) -> bool:
        """After a stop that outlived our DHT record (peer/swarm/absence.py), rejoin like a joiner: download the swarm's
        state instead of mixing our stale model in. True when the state was replaced (the round's own work is
        then dropped: it was computed on the stale model)."""
        absent_s = self.net.absence.take()
        swarm = self.cfg.swarm
        if not swarm.join_from_peers or not resync_due(absent_s, ttl_s=swarm.announce_ttl_s,
                                                       recent_round_s=self._round_s,
                                                       after_rounds=swarm.resync_after_rounds):
            return False
        log.warning("resync: this process was stopped for %.1f s (longer than announce_ttl_s=%.0f and %.0f rounds); "
                    "downloading the swarm's state", absent_s, swarm.announce_ttl_s, swarm.resync_after_rounds)
        return self._resync("absent", absent_s=absent_s)

    def _resync(self, reason: str, donors_first: Collection[str] = (), **detail) -> bool:
        """Rejoin like a joiner: download the swarm's state (checked on a local batch) and take over its
        parameters, outer state and round; our inner optimizer and data position stay. True when the state was
        replaced; event `resync` with `reason`: absent (a long stop), behind (resumed or returned far behind
        the swarm, or a DiLoCo fork: `donors_first`, the members that hold its group's model, are asked first),
        odd one out (far from several partners in a row)."""
        from_round = self.round
        self._set_state("joining")
        self.net.refresh_listing()
        donor = self._adopt_swarm_state(donors_first)
        if donor is None:
            if not self.stopping.is_set():  # else given up for the stop (_adopt_swarm_state said so)
                log.warning("resync (%s): no state downloaded; mixing our own model back in", reason)
            self._set_state("training")
            return False
        self.net.round_boundary(self.snapshot)
        val_loss = evaluate(self.model, self.val_batches, autocast_for(self.device))
        self.sink.emit("resync", peer_id=self.peer_id, reason=reason, joined_from=donor, from_round=from_round,
                       round=self.round, val_loss=val_loss, **detail)
        log.info("resync (%s): round %d -> %d from %s val_loss=%.4f", reason, from_round, self.round, donor,
                 val_loss)
        return True

    def _listed_rounds(self) -> list[int]:
        """The rounds the other training peers announce, as far as we believe them (protocol/claims.py: a claim
        far past the swarm's plausible progress is cut); they only ever make us download a checked state."""
        return list(self.net.believed_rounds().values()) if self.net is not None else []

    def _catch_up_at_resume(self) -> None:
        """Resumed from our checkpoint while the swarm went on: when the listed peers' median round is more than
        swarm.resync_behind_rounds past ours, download their state (like a joiner) instead of mixing our stale
        model in: partners would reject it as far, and it would train alone."""
        if not (self._resumed and self.cfg.swarm.join_from_peers) or self.stopping.is_set():
            return
        self._resumed = False
        self.net.refresh_listing()
        rounds = self._listed_rounds()
        if swarm_ahead(self.round, rounds, self.cfg.swarm.resync_behind_rounds):
            log.warning("resync: resumed at round %d, the swarm is at round %d (median of %d peers); downloading "
                        "its state", self.round, sorted(rounds)[len(rounds) // 2], len(rounds))
            self._resync("behind")

    def _catch_up_if_due(self) -> None:
        """At a round boundary: the guard's verdicts this round said we are the far one (catch_up_due)."""
        why, self._catch_up = self._catch_up, None
        first, self._donors_first = self._donors_first, ()
        if why is not None and self.cfg.swarm.join_from_peers and not self.stopping.is_set():
            log.warning("resync: %s (far from our partners: %s); downloading the swarm's state", why,
                        ", ".join(_short(p) for p, _ in self._far.partners) or "-")
            if self._pending is not None:  # overlap: the exchange in flight carries the old model's tensors
                self.averaging.settle(self._pending.background)
                self._pending, self._landed = None, None
            self._resync(why, donors_first=first)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_cfg(self):
        if self.cfg.checkpoint is None:
            return None
        return self.cfg.checkpoint.model_copy(update={"dir": self.cfg.checkpoint_dir})

    def _load_checkpoint(self):
        from gasloc.peer.checkpoint import load_latest
        ck = self._checkpoint_cfg()
        if ck is None:
            return None
        self._checkpoints.flush()  # a write in flight is the newest checkpoint
        return load_latest(ck, model=self.model, inner_opt=self.opt, outer=self.outer, fingerprint=self.fingerprint)

    def _save_checkpoint(self, wait: bool = False) -> None:
        """Copy the state now (a round boundary: consistent) and write it on the checkpoint thread, so training
        goes on while it is serialized, hashed and fsynced; `wait`: until it is on disk (shutdown). A CPU peer
        copies nothing and waits for the write instead: the copy would be 4 parameter copies of host memory (its
        training memory) on top of the round's peak, the wait a second or so every checkpoint.every_rounds."""
        from gasloc.peer.checkpoint import stage
        in_line = self.device.type == "cpu"
        staged = stage(model=self.model, inner_opt=self.opt, outer=self.outer, data_state=self.data.state_dict(),
                       round=self.round, fingerprint=self.fingerprint, copy=not in_line,
                       meta={"inner_steps": self.inner_steps_total, "tokenizer": self.tokenizer_name,
                             "peer_id": self.peer_id, "model": self.cfg.model.model_dump(mode="json")})
        wait = wait or in_line
        round_no = staged.round

        def done(path, err) -> None:  # on the checkpoint thread
            if err is not None:  # non-finite state or a failed write: the older checkpoints stay the newest valid
                log.error("checkpoint round=%d refused: %s", round_no, err)
                return
            log.info("checkpoint round=%d path=%s", round_no, path)
            self.sink.emit("checkpoint", round=round_no, path=str(path))
            self._saved_round = max(self._saved_round, round_no)

        self._checkpoints.submit(self._checkpoint_cfg(), staged, done)
        if wait:
            self._checkpoints.flush()

    def _main_loop(self) -> None:
        self._catch_up_at_resume()
        t0 = time.monotonic()
        max_rounds, max_s = self.cfg.run.max_rounds, self.cfg.run.max_seconds
        rounds_done = 0
        while not self.stopping.is_set():
            if max_rounds is not None and rounds_done >= max_rounds:
                break
            if max_s is not None and time.monotonic() - t0 >= max_s:
                break
            try:
                self._one_round()
            except FloatingPointError as e:
                if not self._recover(e):
                    raise
                continue
            except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
                if not is_out_of_memory(e):
                    raise
                self._out_of_memory(e)
            self._recoveries = 0
            rounds_done += 1

    def _out_of_memory(self, err: BaseException) -> None:
        """Out of memory mid-round: end the peer with one line and EXIT_NO_MEMORY, and leave a marker so that a
        restart with the same settings refuses at once (a restart would meet the same peak: a crash loop). The
        round is lost; shutdown writes no checkpoint of its half-done state."""
        round_no = self.round + 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # room for the shutdown's own steps
        path = write_oom_marker(self.run_dir, self.cfg, self.device, round_no, err)
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        msg = (f"out of memory in round {round_no} on {self.device} (peak {self._peak.mb():.0f} MB this round; the "
               f"start-up check measured {self.fit.need_bytes / 1e6:.0f} MB of {self.fit.headroom.bytes / 1e6:.0f} MB "
               f"{self.fit.headroom.source}): {first}; lower data.batch_size or model.seq_len (a restart with the same "
               f"settings refuses: {path.name})")
        log.error("%s", msg)
        raise DoesNotFit(msg) from None

    def _one_round(self) -> None:
        (self._overlap_round if self.cfg.outer.overlap else self._plain_round)()

    def _recover(self, err: FloatingPointError) -> bool:
        """The loss turned non-finite mid-round: go back to the newest finite checkpoint and train on (a supervisor
        loop that rebuilds what broke). False when there is none, or after MAX_RECOVERIES in a row: the error then
        ends the peer, and shutdown writes no checkpoint of the broken state."""
        self._recoveries += 1
        if self._recoveries > MAX_RECOVERIES:
            log.error("recover: %d non-finite rounds in a row; giving up", self._recoveries - 1)
            return False
        if self._pending is not None:  # overlap: the exchange in flight carries the broken state's tensors
            self.averaging.settle(self._pending.background)
            self._pending, self._landed = None, None
        from_round = self.round
        loaded = self._load_checkpoint()
        if loaded is None:
            log.error("recover: %s, and no finite checkpoint to go back to", err)
            return False
        self.round = self._saved_round = loaded.round
        self.data.load_state_dict(loaded.data_state)
        self.inner_steps_total = int(loaded.meta.get("inner_steps", 0))
        self.guard.clear()
        self._at_boundary = True
        self.net.round_boundary(self.snapshot)
        val_loss = evaluate(self.model, self.val_batches, autocast_for(self.device))
        log.warning("recover: %s; back to the checkpoint of round %d (was at round %d) val_loss=%.4f", err,
                    loaded.round, from_round, val_loss)
        self.sink.emit("recovered", peer_id=self.peer_id, from_round=from_round, round=self.round,
                       reason=str(err), checkpoint=str(loaded.path), val_loss=val_loss)
        return True

    def _plain_round(self) -> None:
        """Inner steps, then the exchange (the training thread waits for it), the outer step, evaluation."""
        t_start = time.monotonic()
        self._set_state("training")
        start = self._round_start()
        phase = self._train(t_start)
        if phase is None or self._dropped_if_cut(phase, start) or self._maybe_resync():
            return
        eval_due = self._eval_due()
        # y in the parameters' own storage (one copy less at the peak): nothing reads theta again before apply
        # writes the new one; a round that fails before apply writes no checkpoint (_shutdown: not at a boundary)
        sent = self.outer.outgoing(self.params, in_place=True)
        ex, consensus, outer_s = self._exchange_and_apply(sent)
        if self.outer.solo_steps or ex.ok:
            self._finish_round()
        else:  # DiLoCo without its group's mean: no step, the round does not count (peer/swarm/diloco.py)
            self._at_boundary = True
            if ex.outcome == "behind":  # the swarm stepped without us, or holds another model: take its state
                self._catch_up, self._donors_first = "behind", ex.holders  # (a fork: from the group's model)
        val_loss = evaluate(self.model, self.val_batches, autocast_for(self.device)) if eval_due else None
        self._report(t_start, phase, ex, consensus, outer_s, val_loss)
        self._catch_up_if_due()

    def _overlap_round(self) -> None:
        """outer.overlap: the previous round's exchange runs during these inner steps and its mix is added right
        after the step during which it landed; this round's outer step is applied at once as if solo, and its own
        exchange starts in the background."""
        t_start = time.monotonic()
        if self._pending is None:  # else the previous round's partner search goes on, in state "exchanging"
            self._set_state("training")
        start = self._round_start()
        phase = self._train(t_start, after_step=self._mix_if_landed)
        if phase is None or self._dropped_if_cut(phase, start):
            return
        landed, self._landed = self._landed, None
        # the previous round's exchange (and evaluation), waited for now if it has not landed yet
        ex, consensus, val_loss = landed or self._settle_pending()
        if self._maybe_resync():
            return
        eval_due = self._eval_due()
        sent = self.outer.outgoing(self.params)
        t_outer = time.monotonic()
        self.outer.apply(self.params, sent)  # as if solo: the mix arrives during the next inner phase
        outer_s = time.monotonic() - t_outer
        if not self.stopping.is_set():
            background = self.averaging.begin(self.fault.wire(sent), self.round, window_s=phase.compute_s)
            self._pending = Pending(sent, background, eval_due)
        self._finish_round()
        self._report(t_start, phase, ex, consensus, outer_s, val_loss)
        self._catch_up_if_due()

    # ------------------------------------------------------------------ the steps rounds are made of
    def _round_start(self) -> RoundStart:
        self._peak.reset()  # peak_mem_mb is per round
        return RoundStart(self.data.state_dict(), self.inner_steps_total)

    def _dropped_if_cut(self, phase: InnerPhase, start: RoundStart) -> bool:
        """A stop signal cut this round's inner phase short: drop the round (its few steps and a solo outer step
        with momentum raised the validation loss by ~5% in the model left behind) and go back to the last round
        boundary: parameters from the outer anchor, the data position and step count from the round's start. The
        inner AdamW moments keep the cut steps' gradients (statistics only; not worth a copy every round)."""
        if not self.stopping.is_set() or phase.steps >= self.cfg.inner.inner_steps:
            return False
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.outer.anchor)
        self.data.load_state_dict(start.data_state)
        self.inner_steps_total = start.inner_steps_total
        self._at_boundary = True
        if self._landed is not None:  # overlap: the previous round's mix landed in this phase and is kept (it moved
            self._saved_round = min(self._saved_round, self.round - 1)  # the anchor too): the state is unsaved
        log.info("stop cut round %d short after %d of %d inner steps: dropped it, the state is round %d's end",
                 self.round + 1, phase.steps, self.cfg.inner.inner_steps, self.round)
        return True

    def _after_step(self, then) -> None:
        """Between inner steps: the fault injector (tests only; a no-op otherwise), then the caller's hook
        (overlap's late mix)."""
        self.fault.after_step(self.round + 1)
        then()

    def _train(self, t_start: float, after_step=lambda: None) -> InnerPhase | None:
        """This round's inner steps; None when a stop came before the first one (nothing to exchange or apply:
        momentum alone is no round)."""
        cfg = self.cfg
        self._at_boundary = False
        # the lr decay follows the swarm's position (rounds, which a joiner takes over), the warm-up our own steps
        position = self.round * cfg.inner.inner_steps
        steps, loss = run_inner_phase(self.model, self.opt, self.data.next_batch, self.inner_steps_total, cfg.inner,
                                      self.device, autocast_for(self.device), should_stop=self.stopping.is_set,
                                      after_step=lambda: self._after_step(after_step), start_position=position)
        if steps == 0:
            self._at_boundary = True
            return None
        self.inner_steps_total += steps
        compute_s = time.monotonic() - t_start
        self.throughput_tps = steps * cfg.data.batch_size * cfg.model.seq_len / max(compute_s, 1e-9)
        return InnerPhase(steps, loss, compute_s, self.opt.param_groups[0]["lr"])  # what the last step used

    def _eval_due(self) -> bool:
        return (self.round + 1) % self.cfg.run.eval_every_rounds == 0 or self.round == 0

    def _finish_round(self) -> None:
        """The round boundary: the count moves on, and a joiner waiting for our state gets a snapshot of it (taken
        only then: peer/swarm/network.py)."""
        self.round += 1
        self._at_boundary = True
        self.net.round_boundary(self.snapshot)

    def _report(self, t_start: float, phase: InnerPhase, ex: RoundExchange, consensus: float | None,
                outer_s: float, val_loss: float | None) -> None:
        """The round's metrics line and log line, and a checkpoint when one is due."""
        round_s = time.monotonic() - t_start
        self._round_s.append(round_s)
        outcome = ex.outcome if ex.ok or ex.attempts or not self.outer.solo_steps else "solo"
        self._last_loss = float(phase.loss)
        if val_loss is not None:
            self._last_val_loss = float(val_loss)
        if ex.ok and ex.kind == "pair" and ex.partner:
            self._partners.append(ex.partner)
        self.sink.emit(
            "round", peer_id=self.peer_id, round=self.round, inner_steps=phase.steps,
            total_inner_steps=self.inner_steps_total, lr=phase.lr, loss=phase.loss, val_loss=val_loss,
            outcome=outcome, partner=ex.partner, group_size=ex.group_size,
            bytes_sent=ex.bytes_sent, bytes_received=ex.bytes_received, exchange_s=ex.exchange_s,
            consensus=consensus, compute_s=phase.compute_s, wait_s=ex.wait_s, transfer_s=ex.transfer_s,
            outer_s=outer_s, round_s=round_s, tokens_per_s=self.throughput_tps,
            peak_mem_mb=self._peak.mb(), attempts=ex.attempts, passed_over=ex.passed_over,
            live_peers=self.live_count(), detail=ex.detail or None, code=ex.code, **_guard_fields(ex.guard),
            rejected_partner=ex.rejected_partner, anchor_spread=ex.anchor_spread,
            path=ex.path if ex.ok else None, **self.net.nat_metrics(), **self.net.membership_metrics())
        log.info("round=%d loss=%.4f%s partner=%s outcome=%s MB=%.2f s=%.2f exchange_s=%.2f", self.round, phase.loss,
                 f" val_loss={val_loss:.4f}" if val_loss is not None else "", _short(ex.partner), outcome,
                 (ex.bytes_sent + ex.bytes_received) / 1e6, round_s, ex.exchange_s)
        if self.cfg.checkpoint is not None and self.round % self.cfg.checkpoint.every_rounds == 0:
            self._save_checkpoint()

    def _exchange_and_apply(self, sent: list[torch.Tensor]) -> tuple[RoundExchange, float | None, float]:
        """A plain round's communication and outer step: (the exchange, consensus, seconds of the outer step)."""
        # a CPU peer receives into the outer anchor, which nothing reads until apply writes it (outer.idle_buffers)
        into = self.outer.idle_buffers() if self.device.type == "cpu" else None
        lend = {} if into is None else {"receive_into": into}
        if self.stopping.is_set():
            # gasloc: a solo outer step; DiLoCo: none (the round does not count), reported as such
            ex = RoundExchange(outcome="solo" if self.outer.solo_steps else "stopping", detail="stopping")
        else:
            ex = self.averaging.average(self.fault.wire(sent), self.round, self.live_count, **lend)
        self._note_bandwidth(ex)
        t_outer = time.monotonic()
        mixed, consensus = self._mixed(sent, ex) if ex.ok else (None, None)
        if (mixed is None and ex.guard is not None and ex.outcome == "rejected" and self.cfg.guard.retry_after_reject
                and self._catch_up is None and not self.stopping.is_set()):
            # the guard rejected this round's partner: search again (it is now distrusted: not called, answered
            # BUSY), rather than lose the round to a solo step
            first = ex
            first.own_wire = None  # read no more: the retry encodes its own (else two copies of it at once)
            ex = self.averaging.average(self.fault.wire(sent), self.round, self.live_count, **lend)
            self._note_bandwidth(ex)
            ex.rejected_partner, ex.attempts = first.partner, ex.attempts + first.attempts
            ex.bytes_sent, ex.bytes_received = ex.bytes_sent + first.bytes_sent, ex.bytes_received + first.bytes_received
            if not ex.ok:  # the round's record keeps the rejection's verdict
                ex.outcome, ex.partner, ex.guard, ex.detail, ex.code = ("rejected", first.partner, first.guard,
                                                                         first.detail, first.code)
            mixed, consensus = self._mixed(sent, ex) if ex.ok else (None, consensus)
            t_outer = time.monotonic()
        if mixed is not None or self.outer.solo_steps:
            # a solo round (also when the guard rejected the partner): mix is the identity, the outer momentum applies
            with round_mix_momentum_applied(self.outer, self._kappa(ex)):  # a stranger's correction: applied once
                self.outer.apply(self.params, sent if mixed is None else mixed)
        else:  # DiLoCo: never a solo step; the round is dropped (params back to the anchor)
            self.outer.drop(self.params)
        self.averaging.recycle(ex)  # mixed in: the next exchange receives into these buffers
        return ex, consensus, time.monotonic() - t_outer

    def _mixed(self, sent: list[torch.Tensor], ex: RoundExchange) -> tuple[list[torch.Tensor] | None, float]:
        """Our tensors mixed with what an ok exchange received (a partner's, or DiLoCo's group mean, used as is),
        and the consensus metric: their distance relative to ours. A partner's tensors pass the guard first
        (protocol/guard.py): clipped toward ours, or rejected (None; `ex` then reads as rejected).

        A pair mixes the wire forms of both sides (protocol/averaging.py mix_pair_: z = y + w (Q(y_j) - Q(y_i)), the
        pair's mean exact whatever the codec), and the guard judges the two decoded forms, which is what each side
        can compare. The mix is written into the received tensors (the exchange's buffers: no model-sized copy)."""
        received = [t.to(self.device) for t in ex.received]
        own_wire = None if ex.own_wire is None else [t.to(self.device) for t in ex.own_wire]
        ours = sent if own_wire is None else own_wire   # Q(y_i)
        consensus = relative_distance(ours, received)
        if ex.kind != "pair":
            return received, consensus
        scales = [1.0] * len(received)
        if self.cfg.guard.enabled:
            v = self._judge(ours, received, ex)
            if v.rejected:
                ex.outcome, ex.received = "rejected", None
                ex.detail = f"guard code={v.code.name if v.code else '-'} {v.reason}"
                log.warning("round=%d partner=%s guard rejected code=%s %s", self.round + 1, _short(ex.partner),
                            v.code.name if v.code else "-", v.reason)
                return None, consensus
            scales = list(v.scales)   # clipped: the partner pulls by this share of its difference, per tensor
        # the codecs that travelled decide (both sides alike): a modulo peer's fallback mixes at the pair's mean
        weight = pair_weight(self.cfg.outer.mix_weight, ex.mix_weight)
        for s in set(scales):  # one in-place mix per distinct clip scale (most tensors: 1)
            ks = [k for k, x in enumerate(scales) if x == s]
            mix_pair_([received[k] for k in ks], [sent[k] for k in ks],
                      None if own_wire is None else [own_wire[k] for k in ks], weight * s)
        return received, consensus

    def _kappa(self, ex: RoundExchange) -> float:
        """The round's kappa (form C's share of the mix correction its momentum carries on): 0 for a partner we
        barely know, else outer.mix_momentum, else what the exchange's codecs warrant (both sides alike), else 1."""
        return round_mix_momentum(self.cfg.outer.mix_momentum, ex.mix_momentum, _momentum(ex))

    def _judge(self, sent: list[torch.Tensor], received: list[torch.Tensor], ex: RoundExchange) -> Decision:
        """The mix decision on one partner's tensors (protocol/decision.py), applied: every offer is checked on one
        batch only this peer knows (data.private_batches: the validation batches are every peer's, so a state could
        be tuned to them), the trust change goes to the one trust book the partner search reads, a catch-up is
        noted for the round boundary, and the decision is attached to the round's report."""
        model = len(received) == len(self.params) and all(r.shape == p.shape for r, p in zip(received, self.params))
        # tensors that are no model (NoLoCo sends two per parameter): no batch check
        checks = PrivateChecks(self._evaluate_at, lambda n: private_batches(self.data, n),
                               self.cfg.guard.recheck_batches) if model else None
        own_round = self.round if ex.offer_round is None else ex.offer_round
        v = self.guard.decide(sent, received, partner=ex.partner or "", own_round=own_round,
                              partner_round=ex.partner_round, loss=checks.loss if checks else None,
                              recheck=checks.recheck if checks else None,
                              listed_rounds=self._listed_rounds(),
                              own_id=self.peer_id, behind_rounds=self.cfg.swarm.resync_behind_rounds)
        trust = self.averaging.policy.judged(ex.partner, v.verdict, time.monotonic())
        if v.catch_up is not None:
            self._catch_up = v.catch_up
        ex.guard = {"guard": v.verdict.action, "guard_tau": v.tau, "clipped_by": 1.0 - v.scale if v.clipped else 0.0,
                    "rejected": v.rejected, "partner_trust": trust, "momentum": v.momentum}
        return v

    def _note_bandwidth(self, ex: RoundExchange) -> None:
        if ex.ok and ex.bytes_received and ex.exchange_s > 0:
            # our link's estimate: the best per-direction rate of recent exchanges (an exchange runs at the slower
            # partner's pace, so an average would call a fast peer slow after a few slow partners)
            self.bandwidth_bps = max(ex.bytes_received / ex.exchange_s, LINK_DECAY * self.bandwidth_bps)

    def _settle_pending(self, evaluate_due: bool = True) -> tuple[RoundExchange, float | None, float | None]:
        """Overlap: end the previous round's background exchange (waiting, within its deadline, for one still
        running) and add its mix late (outer.late_mix); (its report, consensus, val loss). No exchange pending: a
        solo round.

        The val loss, when that round was due an evaluation, is of its model with the mix in: the outer anchor, the
        point a plain round evaluates. (Evaluated at round end, the model would lack the mix still in flight.)"""
        if self._pending is None:
            return RoundExchange(outcome="solo"), None, None
        pending, self._pending = self._pending, None
        sent, eval_due = pending.sent, pending.eval_due
        t = time.monotonic()
        ex = self.averaging.settle(pending.background)
        ex.wait_s, ex.overlapped = time.monotonic() - t, True
        self._note_bandwidth(ex)
        consensus = None
        if ex.ok:
            mixed, consensus = self._mixed(sent, ex)
            if mixed is not None:
                with round_mix_momentum_applied(self.outer, self._kappa(ex)):  # a stranger's: applied once
                    self.outer.late_mix(self.params, sent, mixed)
            self.averaging.recycle(ex)
        return ex, consensus, self._evaluate_at(self.outer.anchor) if eval_due and evaluate_due else None

    def _mix_if_landed(self) -> None:
        """After each inner step of an overlapped round: add the previous round's mix as soon as it has landed."""
        if self._landed is None and self._pending is not None and self._pending.background.done():
            self._landed = self._settle_pending()

    def _settle_last(self) -> None:
        ex, _, _ = self._settle_pending(evaluate_due=False)
        log.info("overlap: settled the last exchange outcome=%s partner=%s", ex.outcome, _short(ex.partner))

    @torch.no_grad()
    def _evaluate_at(self, point: list[torch.Tensor], batches: list[torch.Tensor] | None = None) -> float:
        """Validation loss of the model with `point` as its parameters, on `batches` (default: all validation
        batches). Our parameters are neither cloned nor written: the model runs with `point` in their place
        (peer/train/memory.py evaluate_with), so a partner's batch check costs activations, not a model copy."""
        return evaluate_with(self.model, point, self.val_batches if batches is None else batches,
                             autocast_for(self.device))

    # ------------------------------------------------------------------ state shared with the network side
    def live_count(self) -> int:
        """Other compatible peers that are past joining (they train and communicate)."""
        return sum(r.state != "joining" for r in self.net.live.values()) if self.net is not None else 0

    def _set_state(self, state: str, announce: bool = True, wait: bool = False) -> None:
        if state != self.state:
            self.state = state
            if announce:
                self.net.announce(wait=wait)

    def _status(self) -> PeerStatus:
        view = {"loss": self._last_loss, "val_loss": self._last_val_loss, "partners": list(self._partners),
                "round_s": sum(self._round_s) / len(self._round_s) if self._round_s else None}
        return PeerStatus(self.state, self.round, self.throughput_tps, self.bandwidth_bps, view)

    def snapshot(self) -> tuple[dict, list[torch.Tensor]]:
        """A copy of what a joiner downloads, taken at a round boundary (params == the outer anchor), on the CPU:
        metadata and the parameters. No outer state: a joiner never adopts a donor's momentum (_adopt_swarm_state),
        and leaving it out halves the snapshot."""
        if not self.outer.solo_steps:  # DiLoCo serves its momentum too (_adopt_outer); params == anchor here
            return self._anchor_snapshot()
        params = [p.detach().to("cpu", copy=True) for p in self.params]
        return {"round": self.round, "num_outer": 0, "peer_id": self.peer_id}, params

    def _anchor_snapshot(self) -> tuple[dict, list[torch.Tensor]]:
        """DiLoCo waiting for its group: the state of its last outer step (the anchor, not the params its inner
        steps moved), which a peer behind it downloads meanwhile (peer/swarm/diloco.py)."""
        params = [a.detach().to("cpu", copy=True) for a in self.outer.anchor]
        outer_state = [v.detach().to("cpu", copy=True) for v in self.outer.state_dict().values()]
        return {"round": self.round, "num_outer": len(outer_state), "peer_id": self.peer_id}, params + outer_state

    def _shutdown(self) -> None:
        # Leave the listing first, so nobody picks us as a partner while we stop; then the exchange (an exchange
        # in flight ends within its deadline), then the network and the DHT child.
        if self.net is not None:
            shutdown_step("withdraw", self.net.withdraw)
        shutdown_step("checkpoint writes", self._checkpoints.flush)  # one in flight decides what is unsaved
        unsaved = self.round > self._saved_round
        if self._pending is not None:  # overlap: the last round's mix belongs in the checkpoint
            self.stopping.set()  # (also after --max-rounds) no new attempts: we left the listing; one in flight ends
            shutdown_step("settle the last exchange", self._settle_last)
            unsaved = True  # even if this round was saved: the mix just added is not in it
        # a round ends with outer.apply, and a round cut by a stop signal is rolled back, so after a clean stop the
        # state is at a round boundary; after an exception mid-round it is not, and nothing is written (the last
        # periodic checkpoint stays the newest). (self.averaging is set once the model, optimizer and outer exist.)
        if self.averaging is not None and self.cfg.checkpoint is not None and unsaved:
            if self._at_boundary:
                shutdown_step("checkpoint", lambda: self._save_checkpoint(wait=True))
            else:
                log.warning("no checkpoint at shutdown: stopped mid-round by an error (round %d is the newest saved)",
                            self._saved_round)
        shutdown_step("checkpoint writes", self._checkpoints.close)  # a periodic one still in flight lands
        if self.averaging is not None:
            shutdown_step("averaging.close", self.averaging.close)
        if self.net is not None:
            shutdown_step("network.close", self.net.close)
        remove_own_shm()
        self.sink.emit("stop", peer_id=self.peer_id, round=self.round, reason=self.stop_reason)
        self.sink.close()
        if self._lock_file is not None:
            self._lock_file.close()
        log.info("stopped peer_id=%s round=%d reason=%s", self.peer_id, self.round, self.stop_reason)


def _short(peer_id: str | None) -> str:
    return "-" if not peer_id else (peer_id if len(peer_id) <= 12 else f"{peer_id[:6]}…{peer_id[-4:]}")


def _momentum(ex: RoundExchange) -> bool:
    """Whether the round's mix correction may get outer momentum: not from a partner we barely know (the mix
    decision's `momentum`, protocol/decision.py); a round without a judged partner has no correction to carry."""
    return bool((ex.guard or {}).get("momentum", True))


def _guard_fields(guard: dict | None) -> dict:
    """The round record's guard fields (null when no partner's tensors were judged this round)."""
    keys = ("guard", "guard_tau", "clipped_by", "rejected", "partner_trust")
    return {k: (guard or {}).get(k) for k in keys}
