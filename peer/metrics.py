"""Metrics: one sink interface (JSON lines in <run_dir>/metrics.jsonl, or nothing), so the training loop never
branches on whether metrics are on.

Events (one JSON object per line, each with "event" and "time" = Unix seconds):
  start  peer_id, fingerprint, algorithm, initial_loss, joined_from (donor peer id | "checkpoint" | null), round
  round  round, inner_steps, loss, val_loss (every run.eval_every_rounds rounds, else null), outcome
         (ok | solo | busy | timeout | rejected | failed), partner, group_size, bytes_sent, bytes_received,
         exchange_s, consensus (||own - partner|| / ||own||, null when nothing was received), compute_s, wait_s,
         transfer_s, outer_s, round_s, tokens_per_s, peak_mem_mb, attempts, live_peers
  stop   peer_id, round, reason
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch

OUTCOMES: tuple[str, ...] = ("ok", "solo", "busy", "timeout", "rejected", "failed")


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

    def emit(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "time": time.time(), **{k: _jsonable(v) for k, v in fields.items()}}
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


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All events of a metrics.jsonl (tests, plots); a torn last line (peer killed mid-write) is skipped."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
