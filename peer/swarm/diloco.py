"""The DiLoCo baseline on the live swarm, as its users know it (hivemind.Optimizer, OpenDiLoCo): one model, stepped
by the mean pseudo-gradient of a group of peers of the same epoch, through hivemind's DecentralizedAverager
(matchmaking + butterfly all-reduce).

Epoch: the number of outer steps the model has taken; the peer's round (a round that does not step does not count,
peer/daemon.py). The matchmaking key carries it (`<run>_diloco_<fingerprint>_e<epoch>`), so a peer averages only
with peers of its own epoch, and every member gathers {"round": epoch, "anchor": a sample of its anchor}: the group
is checked before its mean is used (protocol/epochs.py `judge_group`).

Failure semantics, per round (`average` returns only when one holds):
- ok: a group of >= 2 of our epoch finished the all-reduce, every member claimed our epoch, every member's anchor
  is the group's model (the anchor most members agree with, within diloco.anchor_tolerance; the lowest peer
  id's among equals), the mean is finite. The
  caller steps with it (every member alike: one model); the round record's anchor_spread is the largest relative
  difference to a groupmate's anchor sample (fp32: float32 rounding, ~1e-8; a lossy codec: its rounding, which
  walks on from step to step, since hivemind hands each member the rounded difference to its own part).
- an attempt that fails (no group within diloco.matchmaking_time_s, a groupmate dropped, the deadline, a member of
  another epoch, a non-finite mean, a partial all-reduce: part of our vector came back from no reducer, or a part
  we averaged had no sender but us - hivemind reports those as a success, with each member's own values standing
  in, so the members' "means" differ; `allreduce_shortfall`) is tried again for the same epoch, with the same
  pseudo-gradient: never a solo outer step, not even on part of the model. So is a group with a member of another
  model (code=OTHER_MODEL: that member downloads ours meanwhile). A groupmate that got the whole mean
  steps while we refuse ours: we are then behind (below). The averager's buffers are scratch space: ours are copied
  in before each attempt and the mean copied out only on success, so a partial reduction is never applied.
- behind: the other training peers' median announced round is past our epoch (they stepped without us: we were
  stopped, or dropped from the group; looked at before each attempt, and every BEHIND_CHECK_S while we look for a
  group), or the group's model is another than ours (a fork; code=FORKED, the report's `holders` name the members
  that hold it). The caller drops the round and downloads a peer's state - from those members first - with
  parameters and the DiLoCo momentum, the round taken from the adopted donor (checked on batches of its own,
  peer/daemon.py `_resync`) - as hivemind.Optimizer's load_state_from_peers; the next group compares anchors again.
  A failed download: the next round tries again.
- stopping: a stop signal came while waiting; the caller drops the round (the state stays at the last step).
Start barrier: at epoch 0 a group needs diloco.initial_group_size members (the attempt is repeated until they come).
A lone peer waits (DiLoCo has no step without a group). While it waits it serves the state of its last step to peers
that download it (the anchor, its outer state and epoch), so a peer behind can catch up with peers that wait for it.
Group size: the target is the larger of the listing's count and our last group's size (a listing that is still
filling must not close a group of one epoch early and split it); a group closes at the target, or after
diloco.matchmaking_time_s with whoever came.

Claims: a groupmate's gathered round and anchor are claims (a wrong type or size counts as disagreeing); the
listing's rounds are claims whose median alone can make us download, and the download is checked. hivemind's
all-reduce itself is not Byzantine-robust: a hostile groupmate can send any pseudo-gradient (the mean is checked for
NaN/Inf only) or stall a group by claiming another epoch or another model. DiLoCo runs where peers are trusted;
gasloc's guard is the answer for open swarms.

Wire: hivemind.compression, the closest to the exchange's wire codec (diloco.compression). Byte counts are derived
from the all-reduce's pattern (each member sends and receives (n-1)/n of the vector twice, at the codec's width),
not measured on the wire: hivemind does not expose them.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization

from gasloc.peer.swarm.round_report import RoundExchange
from gasloc.protocol.epochs import anchor_sample, behind, judge_group, sample_size, sample_stride
from gasloc.runtime.safeproc import DiesWithParent, remove_own_shm

log = logging.getLogger(__name__)

POLL_S = 0.05
BEHIND_CHECK_S = 1.0  # how often a peer still looking for a group compares its epoch with the listing's
# bits a value on the wire, per compression (for the derived byte counts)
_BITS = {"none": 32, "float16": 16, "uint8": 8}
# diloco.anchor_tolerance unset, per compression: above what the wire's rounding leaves between members' anchors.
# hivemind sends each member Q(mean - its own part), so a lossy wire leaves members apart by Q's error every step,
# and that walks on (nothing pulls anchors together): measured on loopback, uint8 put two members 1.4e-3 apart
# after the first all-reduce of the tiny preset. Lossless: a few float32 roundings (~1e-7).
TOLERANCE = {"none": 1e-4, "float16": 1e-2, "uint8": 5e-2}


def compression_name(cfg) -> str:
    """diloco.compression resolved: "auto" follows the exchange's wire codec to the closest hivemind.compression
    (hivemind has no bfloat16 and no blockwise codec below 8 bits without bitsandbytes)."""
    chosen = cfg.diloco.compression
    if chosen != "auto":
        return chosen
    wire = str(getattr(cfg.exchange, "codec", None) or getattr(cfg.exchange, "wire_dtype", "float32"))
    if wire == "float32":
        return "none"
    # a blockwise or modulo codec (int8, mod4-sd - the exchange's default - and narrower) maps to float16, not to
    # hivemind's uint8: each member receives Q(mean - its own part), so a lossy all-reduce leaves members apart by
    # Q's error and that walks on; uint8 walked ~1.5e-3 a step on tiny (one model no more after tens of steps),
    # float16 ~1.1e-5. uint8 stays one setting away (diloco.compression = "uint8")
    return "float16"


def make_compression(name: str) -> CompressionBase:
    return {"none": NoCompression, "float16": Float16Compression, "uint8": Uniform8BitQuantization}[name]()


def allreduce_shortfall(container, reducer) -> str | None:
    """Why the all-reduce that just ran must not be used, or None. `container` and `reducer` are the run's hivemind
    TensorPartContainer (the parts of our vector as they came back) and TensorPartReducer (the parts we averaged for
    the group).

    hivemind 1.1.12 finishes a step without an error when a groupmate fails mid-way: a reducer that does not answer
    within reducer_timeout leaves its share of our vector at our own values (register_failed_reducer), and a sender
    that does not send within sender_timeout is left out of the parts we average (on_sender_failed). Measured live
    (tests/e2e/test_swarm_diloco.py, a frozen and a slow peer on 2 shared cores): three members of one epoch came out
    2.5-2.7 % apart after an all-reduce whose anchors agreed to 1e-8. Refused here:
    - a share that came back from no reducer: our own values stand in for the group's, so our "mean" is not the
      one the others hold;
    - a part we averaged from our own values alone (every other sender left out): the others received it as the
      group's, and stepping with it is a solo step on that part.
    A sender left out of a part that others did send is not refused: every member that got every part holds the same
    mean (each part is averaged once and sent alike to all), and the member left out refuses by the first rule."""
    why = []
    if container.failed_size:
        why.append(f"{container.failed_size} of {container.total_size} values came back from no reducer (left at "
                   f"our own)")
    alone = sum(sum(after > part for after in reducer.sender_failed_after) < 2 for part in range(reducer.num_parts))
    if alone:
        why.append(f"{alone} of {reducer.num_parts} parts we averaged had no sender but us")
    return "; ".join(why) or None


class SafeAverager(DiesWithParent, DecentralizedAverager):
    """A DecentralizedAverager whose process dies with the peer (runtime/safeproc.py), whose group key follows the
    epoch, whose group sizes follow the swarm, and whose step fails when the all-reduce was partial in a way that
    parts our mean from the group's or steps part of the model alone (allreduce_shortfall: hivemind reports both as a
    success)."""

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        # Runs in the averager process, inside the group's registration: the run's AllReduceRunner is still there.
        # The exception fails the step (DilocoAveraging then tries the epoch again; the buffers are scratch space).
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        running = self._running_groups.get(group_info.group_id)
        runner = running.result() if running is not None and running.done() else None
        why = ("no all-reduce ran" if runner is None
               else allreduce_shortfall(runner.tensor_part_container, runner.tensor_part_reducer))
        if why:
            raise AllreduceException(f"partial all-reduce, not used: {why}")
        return gathered

    async def _shutdown(self, timeout: float | None) -> None:
        try:
            await super()._shutdown(timeout)
        finally:
            # our p2p is a replica on the DHT's daemon: hivemind never closes it, which leaves its unix socket file
            # (/tmp/hivemind-p2pclient-*.sock) behind after every clean exit
            await self._p2p.shutdown()
            # this process's hivemind futures live in /dev/shm/torch_<pid>_* files, which torch_shm_manager removes
            # only after every client of it is gone (an in-process averager's manager serves its creator too)
            remove_own_shm()

    def set_group(self, key_prefix: str, target: int, minimum: int) -> None:
        """Before a step: the matchmaking key and group sizes (sent down the same pipe as the step, so they apply
        first)."""
        self._outer_pipe.send(("_set_group", [key_prefix, target, minimum], {}))

    async def _set_group(self, key_prefix: str, target: int, minimum: int) -> None:
        # Runs in the averager process. hivemind 1.1.12 (pinned) keeps the target in three places and has no
        # setters; a group assembles as soon as it reaches the target, so a stale value means waiting in vain. A
        # join request with another key is refused (matchmaking.py compares request.group_key with current_key):
        # the epoch in the key keeps epochs apart.
        mm = self._matchmaking
        mm.group_key_manager.prefix = key_prefix
        mm.target_group_size = mm.potential_leaders.target_group_size = target
        # The key manager's copy only picks the next group bits (we keep none: the key is the epoch), but it draws
        # group_size of range(its target): a follower whose target is below the group its leader assembled (views
        # of the listing differ: a peer just resumed or joined) raised ValueError there, after the group formed,
        # and failed the all-reduce for every member. None: hivemind draws from the group's own size instead.
        mm.group_key_manager.target_group_size = None
        mm.min_group_size = minimum


class DilocoAveraging:
    def __init__(self, cfg, net, params: list[torch.Tensor], *, stopping: threading.Event,
                 set_state: Callable[[str], None], anchor: Callable[[], Sequence[torch.Tensor]],
                 serve: Callable[[], None] = lambda: None):
        self.cfg, self.net, self.stopping, self.set_state, self.anchor = cfg, net, stopping, set_state, anchor
        # while we wait for a group, a peer behind us may ask for our state: `serve` hands it the state of our last
        # step (a round boundary's snapshot of the anchor); without it, two peers could wait for each other for good
        self.serve = serve
        d = cfg.diloco
        # scratch buffers in shared memory; CPU fp32 whatever the training device
        self.buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        self.compression = compression_name(cfg)
        self.vector_bytes = sum(b.numel() for b in self.buffers) * _BITS[self.compression] // 8
        numels = [p.numel() for p in params]
        self.stride = sample_stride(numels)
        self.sample_values = sample_size(numels, self.stride)
        self.key_base = f"{cfg.swarm.run_id}_diloco_{net.fingerprint}"
        self.tolerance = d.anchor_tolerance if d.anchor_tolerance is not None else TOLERANCE[self.compression]
        self.last_group = 0  # the size of our last group: a listing that is still filling must not shrink the target
        self.averager = SafeAverager(
            self.buffers, net.dht, start=True, prefix=self.key_base,
            target_group_size=d.max_group_size or 2, min_group_size=2, min_matchmaking_time=d.matchmaking_time_s,
            request_timeout=d.request_timeout_s, allreduce_timeout=d.averaging_timeout_s,
            next_chunk_timeout=d.next_chunk_timeout_s, allow_state_sharing=False, shutdown_timeout=5,
            compression=make_compression(self.compression))

    def start(self, specs, fingerprint: str) -> None:
        pass  # the averager process started in the constructor (it must be forked from the main thread)

    def _claimed_rounds(self) -> list[int]:
        """The other training peers' announced rounds, as far as we believe them (protocol/claims.py)."""
        return list(self.net.believed_rounds().values())

    def average(self, sent: list[torch.Tensor], round: int, live_count: Callable[[], int]) -> RoundExchange:
        """The group mean of epoch `round`'s pseudo-gradients, or why there is none (module docstring)."""
        d = self.cfg.diloco
        epoch = round
        own = anchor_sample(self.anchor(), self.stride)
        claim = {"round": epoch, "anchor": own.numpy().tobytes()}
        self.set_state("exchanging")
        t0, attempts, last = time.monotonic(), 0, ""
        while True:
            if self.stopping.is_set():
                return self._report("stopping", t0, None, attempts, "stopping: no outer step this round")
            if behind(epoch, self._claimed_rounds()):
                return self._report("behind", t0, None, attempts, f"the swarm's median round is past our epoch "
                                    f"{epoch}: downloading its state" + (f" (last attempt: {last})" if last else ""))
            attempts += 1
            n_live = live_count() + 1
            minimum = d.initial_group_size if epoch == 0 else 2
            # a group closes at once when it reaches the target, else after matchmaking_time_s with whoever came:
            # a target below the swarm (a listing still filling) would split peers of one epoch
            target = max(n_live, self.last_group, minimum)
            if d.max_group_size is not None:
                target = min(d.max_group_size, target)
            self.averager.set_group(f"{self.key_base}_e{epoch}", target, minimum)
            ex = self._attempt(sent, epoch, own, claim, target, t0, attempts)
            if ex.ok or ex.outcome == "behind":
                return ex
            last = f"{ex.outcome}: {ex.detail}"
            log.info("diloco_step epoch=%d attempt=%d outcome=%s target_group_size=%d detail=%s; trying again",
                     epoch, attempts, ex.outcome, target, ex.detail)

    def _attempt(self, sent, epoch: int, own: torch.Tensor, claim: dict, target: int, t0: float,
                 attempts: int) -> RoundExchange:
        d = self.cfg.diloco
        with self.averager.get_tensors() as bufs:
            for b, s in zip(bufs, sent):
                b.copy_(s)
        t1 = time.monotonic()
        control = self.averager.step(gather=claim, weight=1.0, timeout=d.averaging_timeout_s,
                                     allow_retries=False, wait=False)
        deadline = t1 + d.averaging_timeout_s + d.request_timeout_s
        t_allreduce, next_look = None, t1 + BEHIND_CHECK_S
        while True:
            self.serve()
            if t_allreduce is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                t_allreduce = time.monotonic()
            try:
                gathered = control.result(timeout=POLL_S)
                break
            except concurrent.futures.TimeoutError:
                now = time.monotonic()
                if self.stopping.is_set() or now > deadline:
                    control.cancel()
                    why = "stopping" if self.stopping.is_set() else "averaging deadline passed"
                    return self._report("timeout", t0, t_allreduce, attempts, why)
                # still looking for a group while the swarm steps past our epoch (we were stopped mid-attempt, or a
                # join's state was a round old): nobody of our epoch is left to come, so download now rather than
                # at the attempt's deadline (hivemind.Optimizer checks the swarm's epoch as it waits, too)
                if t_allreduce is None and now >= next_look:
                    next_look = now + BEHIND_CHECK_S
                    if behind(epoch, self._claimed_rounds()):
                        control.cancel()
                        return self._report("behind", t0, None, attempts, f"the swarm's median round passed our "
                                            f"epoch {epoch} while we looked for a group: downloading its state")
            except Exception as e:  # noqa: BLE001 - hivemind raises many types; any of them means a failed attempt
                outcome = "solo" if "could not find a group" in str(e) else "failed"
                return self._report(outcome, t0, t_allreduce, attempts, f"{type(e).__name__}: {e}")
        t_end = time.monotonic()
        group = {str(p): c for p, c in (gathered or {}).items()}
        if len(group) < 2:
            return self._report("solo", t0, t_allreduce, attempts, "group of one")
        v = judge_group(self.net.peer_id, epoch, own, group, self.tolerance)
        n = len(group)
        self.last_group = n
        others = ",".join(p for p in group if p != self.net.peer_id)
        if not v.apply:
            outcome = "behind" if v.code == "FORKED" else "rejected"
            ex = self._report(outcome, t0, t_allreduce, attempts, f"code={v.code} {v.detail}")
            ex.code, ex.partner, ex.group_size, ex.anchor_spread = v.code, others, n, v.spread
            ex.holders = tuple(p for p in v.holders if p != self.net.peer_id)
            return ex
        with self.averager.get_tensors() as bufs:
            mean = [b.clone() for b in bufs]
        if not all(bool(torch.isfinite(t).all()) for t in mean):
            # a groupmate sent NaN or Inf (hivemind does not check): applying it would break every member's model
            return self._report("rejected", t0, t_allreduce, attempts, "code=NOT_FINITE the group mean has NaN "
                                "or Inf values; not applied")
        start = t_allreduce if t_allreduce is not None else t1
        moved = int(2 * (n - 1) / n * self.vector_bytes)
        return RoundExchange(outcome="ok", kind="mean", partner=others, received=mean, group_size=n,
                             bytes_sent=moved, bytes_received=moved, exchange_s=t_end - start,
                             wait_s=start - t0, attempts=attempts, anchor_spread=v.spread,
                             detail=f"epoch={epoch} target_group_size={target} compression={self.compression}")

    @staticmethod
    def _report(outcome: str, t0: float, t_allreduce: float | None, attempts: int, detail: str) -> RoundExchange:
        now = time.monotonic()
        start = t_allreduce if t_allreduce is not None else now
        return RoundExchange(outcome=outcome, kind="mean", exchange_s=now - start, wait_s=start - t0,
                             attempts=attempts, detail=detail)

    def recycle(self, ex) -> None:
        """The all-reduce's result is the averager's own fresh tensor, not a buffer we could hand back: nothing to
        do (the daemon calls this for either algorithm)."""

    def close(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()
