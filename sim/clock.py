"""The virtual clock's numbers: each worker's compute speed and access link, and what an exchange costs.

Pure functions, no torch. Times in seconds, bandwidth in bits per second, sizes in bytes.

    pair exchange i<->j:  M / min(B_i, B_j) + l_i + l_j          (both send M at once, full duplex)
    all-reduce over n:    2 (n-1)/n * M / min_i B_i + 2 (n-1) * max_ij (l_i + l_j)    (ring all-reduce: the slowest
                          link gates every one of its 2 (n-1) hops)

A profile is one `Link` per worker: a named one (`uniform`, `half-slow-10x`, ...) built from the clock's base
numbers, or a TOML/JSON file listing the workers (see `load_profile_file`).
"""
from __future__ import annotations

import json
import random
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gasloc.runtime.config import ConfigError, format_validation_error


@dataclass(frozen=True)
class Link:
    """One worker's compute speed and access link."""
    seconds_per_step: float
    bandwidth_bps: float
    latency_s: float

    def as_dict(self) -> dict:
        return {"seconds_per_step": self.seconds_per_step, "bandwidth_mbps": self.bandwidth_bps / 1e6,
                "latency_ms": self.latency_s * 1e3}


def pair_seconds(nbytes: float, a: Link, b: Link) -> float:
    """One pairwise exchange: each side sends `nbytes` at once over the slower of the two links."""
    return nbytes * 8 / min(a.bandwidth_bps, b.bandwidth_bps) + a.latency_s + b.latency_s


def allreduce_seconds(nbytes: float, links: Sequence[Link]) -> float:
    """A ring all-reduce of `nbytes` per worker: every worker moves 2 (n-1)/n * M, gated by the slowest link."""
    n = len(links)
    if n <= 1:
        return 0.0
    bw = min(x.bandwidth_bps for x in links)
    lat = sorted(x.latency_s for x in links)
    return 2 * (n - 1) / n * nbytes * 8 / bw + 2 * (n - 1) * (lat[-1] + lat[-2])


# ---- profiles -------------------------------------------------------------------------------------------------

def _uniform(k: int, base: Link) -> list[Link]:
    return [base] * k


def _half_slow(factor: float) -> Callable[[int, Link], list[Link]]:
    def build(k: int, base: Link) -> list[Link]:
        # the second half (workers k//2 .. k-1) is slow: contiguous, so a ring has fast and slow stretches
        slow = Link(base.seconds_per_step, base.bandwidth_bps / factor, base.latency_s)
        return [base if i < k // 2 else slow for i in range(k)]
    return build


def _half_slow_compute(factor: float) -> Callable[[int, Link], list[Link]]:
    def build(k: int, base: Link) -> list[Link]:
        slow = Link(base.seconds_per_step * factor, base.bandwidth_bps, base.latency_s)
        return [base if i < k // 2 else slow for i in range(k)]
    return build


def _hetero_bench(k: int, base: Link) -> list[Link]:
    # bench/hetero.py: even-numbered peers on 30 Mbit, odd-numbered on 3 Mbit (tbf on both veth ends, no added
    # delay); the base's step time and latency apply to all
    return [Link(base.seconds_per_step, (30e6 if i % 2 == 0 else 3e6), base.latency_s) for i in range(k)]


def _log_uniform(lo_mbps: float, hi_mbps: float) -> Callable[[int, Link], list[Link]]:
    def build(k: int, base: Link) -> list[Link]:
        # a fixed draw per K (its own RNG, not the run's seed), so every algorithm of a comparison gets the same links
        rng = random.Random(k)
        return [Link(base.seconds_per_step, lo_mbps * 1e6 * (hi_mbps / lo_mbps) ** rng.random(), base.latency_s)
                for _ in range(k)]
    return build


PROFILES: dict[str, tuple[Callable[[int, Link], list[Link]], str]] = {
    "uniform": (_uniform, "every worker at the base speed and bandwidth"),
    "half-slow-10x": (_half_slow(10.0), "workers K/2..K-1 on links 10x slower than the rest"),
    "half-slow-compute-2x": (_half_slow_compute(2.0), "workers K/2..K-1 take 2x longer per inner step"),
    "log-uniform-3-300": (_log_uniform(3.0, 300.0), "each worker's link drawn log-uniformly from 3-300 Mbit "
                          "(a fixed draw per K)"),
    "hetero-bench": (_hetero_bench, "bench/hetero.py's links: even workers on 30 Mbit, odd ones on 3 Mbit"),
}


class _WorkerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds_per_step: float | None = Field(None, gt=0, description="default: the clock's seconds_per_step")
    bandwidth_mbps: float | None = Field(None, gt=0, description="default: the clock's bandwidth_mbps")
    latency_ms: float | None = Field(None, ge=0, description="default: the clock's latency_ms")


class _ProfileFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workers: list[_WorkerSpec] = Field(min_length=1, description="one entry per simulated worker, in order")


def load_profile_file(path: str | Path, k: int, base: Link) -> list[Link]:
    """Per-worker links from a TOML or JSON file:

        [[workers]]                     # TOML; JSON: {"workers": [{"bandwidth_mbps": 100}, ...]}
        bandwidth_mbps = 100            # each field optional: unset ones take the clock's base value
        latency_ms = 25
        seconds_per_step = 0.3

    It must list exactly `k` workers. Every problem is a one-line ConfigError.
    """
    p = Path(path)
    what = f"bandwidth profile {p}"
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} does not exist (give a file or one of: {', '.join(PROFILES)})") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {e.strerror}") from None
    try:
        data = json.loads(raw) if p.suffix.lower() == ".json" else tomllib.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if p.suffix.lower() == ".json" else "TOML"
        raise ConfigError(f"{what} is not valid {kind}: {str(e).splitlines()[0]}") from None
    try:
        spec = _ProfileFile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{what}: {format_validation_error(e)} (expected a list 'workers' of "
                          "{seconds_per_step, bandwidth_mbps, latency_ms})") from None
    if len(spec.workers) != k:
        raise ConfigError(f"{what} lists {len(spec.workers)} worker(s) but the simulation has {k}: list exactly "
                          f"one entry per worker")
    return [Link(w.seconds_per_step if w.seconds_per_step is not None else base.seconds_per_step,
                 w.bandwidth_mbps * 1e6 if w.bandwidth_mbps is not None else base.bandwidth_bps,
                 w.latency_ms / 1e3 if w.latency_ms is not None else base.latency_s)
            for w in spec.workers]


def build_links(profile: str, k: int, base: Link) -> list[Link]:
    """The per-worker links of a named profile or a profile file."""
    if profile in PROFILES:
        return PROFILES[profile][0](k, base)
    return load_profile_file(profile, k, base)
