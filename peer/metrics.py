"""Metrics: one sink interface (JSON lines in <run_dir>/metrics.jsonl, or nothing), so the training loop never
branches on whether metrics are on.

Events (one JSON object per line, each with "event" and "time" = Unix seconds):
  start  peer_id, fingerprint, algorithm, initial_loss, joined_from (donor peer id | "checkpoint" | null), round
         memory_need_mb (a round's peak above the runtime, measured by the start-up dry run), memory_headroom_mb
  round  round, inner_steps, loss (mean training loss of the inner phase), val_loss (held-out batches, every
         run.eval_every_rounds rounds and at round 1, else null), outcome (ok | solo | busy | timeout | rejected |
         failed: ok, or the last failed attempt's outcome, or solo when nothing was attempted), partner (DiLoCo:
         the other group members, comma-separated), group_size, bytes_sent, bytes_received (DiLoCo: derived from
         the all-reduce pattern, not measured), exchange_s (the reported attempt), consensus (||own - theirs|| /
         ||own|| with theirs = the partner's tensors, or for DiLoCo the group mean; null without an ok exchange),
         the round's time split compute_s (inner steps) / wait_s (looking for a partner, failed attempts
         included) / transfer_s (the successful exchange) / outer_s (mix + outer update), round_s, tokens_per_s,
         peak_mem_mb (this round's peak, reset at its start: CUDA max allocated, CPU the peak resident set
         VmHWM; where it cannot be reset the start event's peak_mem_per_round is false and this is the process's
         lifetime peak), attempts, passed_over (ready peers on much slower
         links the search did not ask or answered busy, swarm.slower_link_ratio), live_peers, detail. With
         outer.overlap the exchange fields describe the previous round's exchange (it ran during this round's
         inner steps): wait_s is how long this round then waited for it, transfer_s is 0; val_loss is the previous
         round's model with that exchange's mix added (the point a plain round evaluates). The guard's verdict on
         the partner's tensors (protocol/guard.py; all null when none were judged): guard (accept | clip | reject),
         guard_tau (the clipping bound, relative to ||y||), clipped_by (the share of the partner's difference cut
         off, 0 unless clipped), rejected (then outcome is "rejected" and detail names the code), partner_trust
         (the partner's trust score after this verdict). DiLoCo: outcome ok means the outer step was taken with
         the group's mean; any other outcome (behind, stopping) took no step and the round number did not move on
         (the round is the model's epoch); anchor_spread is the largest relative difference between our anchor
         and a groupmate's at the all-reduce (a parameter sample; ~0 while the swarm is one model), null otherwise
  recovered peer_id, from_round, round (the checkpoint's), reason, checkpoint, val_loss: the loss turned NaN or Inf
         and the peer went back to its newest finite checkpoint
  resync peer_id, absent_s (how long the process was stopped), joined_from (donor), from_round, round (the
         donor's), val_loss (after the download): a peer back from a long stop took over the swarm's state
  checkpoint  round, path: a checkpoint was written
  state_served  joiner, outcome (the joiner's verdict: OK or a status code name), bytes, seconds: this peer
         served its state to a joining peer
  stop   peer_id, round, reason (finished | SIGINT | SIGTERM | startup_failed | out_of_memory)
The round event also carries code: the status code name of a rejected exchange (null otherwise).
Prometheus (peer/prometheus.py) reads the same events.
"""
from __future__ import annotations

import json
import math
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch


class MetricsSink(Protocol):
    def emit(self, event: str, **fields: Any) -> None: ...

    def close(self) -> None: ...


class NullSink:
    def emit(self, event: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; a missing value reads better than an invalid file
    return v


class JsonlSink:
    """Appends one line per event and flushes it, so a killed peer loses at most the line being written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()  # events come from the training thread and the event loop (joins served)

    def emit(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "time": time.time(), **{k: _jsonable(v) for k, v in fields.items()}}
        with self._lock:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory on CUDA, else the process's peak resident set size (MB = 10^6 B)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e6
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e6
