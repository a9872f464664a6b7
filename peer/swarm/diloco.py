"""The DiLoCo baseline on the live swarm: each round, the exact mean of the pseudo-gradients of every live DiLoCo
peer of the run, through hivemind's DecentralizedAverager (matchmaking + butterfly all-reduce).

Failure semantics: the mean is used only when the all-reduce step succeeded as a whole; on any failure (no group
within diloco.matchmaking_time_s, a groupmate dropped, the deadline) the round is solo with our own
pseudo-gradient. The averager's buffers are scratch space: ours are copied in before the step and the mean is copied
out only on success, so a partially reduced buffer is never applied.

"Every live peer" is best-effort: the target group size is the number of compatible live peers in the DHT listing
(capped by diloco.max_group_size); a group forms as soon as it is full, or with whoever came when the matchmaking
time is up. A lone peer does not wait at all.

Byte counts for this algorithm are derived from the all-reduce's pattern (each member sends and receives
(n-1)/n of the vector twice), not measured on the wire: hivemind does not expose them.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage

from gasloc.peer.swarm.round_report import RoundExchange
from gasloc.runtime.safeproc import DiesWithParent

log = logging.getLogger(__name__)

POLL_S = 0.05


class SafeAverager(DiesWithParent, DecentralizedAverager):
    """A DecentralizedAverager whose process dies with the peer (runtime/safeproc.py) and whose target group size can
    follow the swarm's size."""

    async def _shutdown(self, timeout: float | None) -> None:
        try:
            await super()._shutdown(timeout)
        finally:
            # our p2p is a replica on the DHT's daemon: hivemind never closes it, which leaves its unix socket file
            # (/tmp/hivemind-p2pclient-*.sock) behind after every clean exit
            await self._p2p.shutdown()

    def set_target_group_size(self, n: int) -> None:
        self._outer_pipe.send(("_set_target_group_size", [n], {}))

    async def _set_target_group_size(self, n: int) -> None:
        # Runs in the averager process. hivemind 1.1.12 (pinned) keeps the target in these three places and has no
        # setter; a group assembles as soon as it reaches the target, so a stale value means waiting in vain.
        mm = self._matchmaking
        mm.target_group_size = mm.potential_leaders.target_group_size = n
        mm.group_key_manager.target_group_size = n


class DilocoAveraging:
    def __init__(self, cfg, net, params: list[torch.Tensor], *, stopping: threading.Event,
                 set_state: Callable[[str], None]):
        self.cfg, self.net, self.stopping, self.set_state = cfg, net, stopping, set_state
        d = cfg.diloco
        # scratch buffers in shared memory; CPU fp32 whatever the training device
        self.buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
        self.vector_bytes = sum(b.numel() * 4 for b in self.buffers)
        self.averager = SafeAverager(
            self.buffers, net.dht, start=True, prefix=f"{cfg.swarm.run_id}_diloco_{net.fingerprint}",
            target_group_size=d.max_group_size or 2, min_group_size=2, min_matchmaking_time=d.matchmaking_time_s,
            request_timeout=d.request_timeout_s, allreduce_timeout=d.averaging_timeout_s,
            next_chunk_timeout=d.next_chunk_timeout_s, allow_state_sharing=False, shutdown_timeout=5)

    def start(self, specs, fingerprint: str) -> None:
        pass  # the averager process started in the constructor (it must be forked from the main thread)

    def average(self, sent: list[torch.Tensor], round: int, live_count: Callable[[], int]) -> RoundExchange:
        d = self.cfg.diloco
        n_live = live_count() + 1
        if n_live < 2:
            return RoundExchange(outcome="solo", detail="no other live DiLoCo peer")
        target = n_live if d.max_group_size is None else min(d.max_group_size, n_live)
        self.averager.set_target_group_size(target)
        self.set_state("exchanging")
        with self.averager.get_tensors() as bufs:
            for b, s in zip(bufs, sent):
                b.copy_(s)
        t0 = time.monotonic()
        control = self.averager.step(gather={"round": round}, weight=1.0, timeout=d.averaging_timeout_s,
                                     allow_retries=False, wait=False)
        deadline = t0 + d.averaging_timeout_s + d.request_timeout_s
        t_allreduce = None
        while True:
            if t_allreduce is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                t_allreduce = time.monotonic()
            try:
                gathered = control.result(timeout=POLL_S)
                break
            except concurrent.futures.TimeoutError:
                if self.stopping.is_set() or time.monotonic() > deadline:
                    control.cancel()
                    why = "stopping" if self.stopping.is_set() else "averaging deadline passed"
                    return self._report("timeout", t0, t_allreduce, target, why)
            except Exception as e:  # noqa: BLE001 - hivemind raises many types; any of them means a solo round
                outcome = "solo" if "could not find a group" in str(e) else "failed"
                return self._report(outcome, t0, t_allreduce, target, f"{type(e).__name__}: {e}")
        t_end = time.monotonic()
        group = [str(p) for p in gathered] if gathered else []
        if len(group) < 2:
            return self._report("solo", t0, t_allreduce, target, "group of one")
        with self.averager.get_tensors() as bufs:
            mean = [b.clone() for b in bufs]
        if not all(bool(torch.isfinite(t).all()) for t in mean):
            # a groupmate sent NaN or Inf (hivemind does not check): applying it would break every member's model
            return self._report("rejected", t0, t_allreduce, target, "code=NOT_FINITE the group mean has NaN or "
                                "Inf values; not applied")
        start = t_allreduce if t_allreduce is not None else t0
        n = len(group)
        moved = int(2 * (n - 1) / n * self.vector_bytes)
        others = [p for p in group if p != self.net.peer_id]
        return RoundExchange(outcome="ok", kind="mean", partner=",".join(others), received=mean, group_size=n,
                             bytes_sent=moved, bytes_received=moved, exchange_s=t_end - start,
                             wait_s=start - t0, attempts=1, detail=f"target_group_size={target}")

    @staticmethod
    def _report(outcome: str, t0: float, t_allreduce: float | None, target: int, detail: str) -> RoundExchange:
        now = time.monotonic()
        start = t_allreduce if t_allreduce is not None else now
        log.info("diloco_step outcome=%s target_group_size=%d detail=%s", outcome, target, detail)
        return RoundExchange(outcome=outcome, kind="mean", exchange_s=now - start, wait_s=start - t0, attempts=1,
                             detail=detail)

    def recycle(self, ex) -> None:
        """The all-reduce's result is the averager's own fresh tensor, not a buffer we could hand back: nothing to
        do (the daemon calls this for either algorithm)."""

    def close(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()
