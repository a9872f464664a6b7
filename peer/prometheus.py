"""Prometheus metrics of one peer, fed by the same events as metrics.jsonl (peer/metrics.py): the round never
branches on whether Prometheus is on, it emits its events once and every sink takes what it needs.

Adding a metric is one line in METRICS: its kind, its name, its help, the event it listens to, and which of that
event's fields gives the value (none: count the event) and the labels. docs/metrics.md lists them all (a test keeps
the list and the document in step).

RSS and open file descriptors come from prometheus_client's own ProcessCollector (process_resident_memory_bytes,
process_open_fds, ...), registered in the same registry: the names every Prometheus dashboard already knows.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import prometheus_client as prom
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram", "age", "info"]
SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class Metric:
    """kind: counter (adds `value`, or 1 per event), gauge (set to `value`), histogram (observes `value`), age
    (seconds since the last such event, read at scrape time), info (a constant 1 labelled with the event's fields).
    A field that is missing or None in an event leaves the metric untouched; `when` names a field that must be
    truthy for the event to count."""
    kind: Kind
    name: str
    help: str
    event: str
    value: str | None = None
    labels: tuple[str, ...] = ()
    when: str | None = None
    buckets: tuple[float, ...] = SECONDS


# One line per metric. Units in names (Prometheus style): _seconds, _bytes; counters get _total from the client.
METRICS: tuple[Metric, ...] = (
    Metric("info", "gasloc_peer", "this peer: id, algorithm, device and wire codec (value 1)", "start",
           labels=("peer_id", "algorithm", "device", "codec")),
    Metric("gauge", "gasloc_round", "outer rounds this peer has completed (its round count, resumed or joined)",
           "round", "round"),
    Metric("counter", "gasloc_rounds", "outer rounds completed by this process", "round"),
    Metric("counter", "gasloc_inner_steps", "inner (AdamW) steps taken by this process", "round", "inner_steps"),
    Metric("gauge", "gasloc_train_loss", "mean training loss of the last inner phase", "round", "loss"),
    Metric("gauge", "gasloc_inner_lr", "inner (AdamW) learning rate of the last inner step (warm-up and decay)",
           "round", "lr"),
    Metric("gauge", "gasloc_val_loss", "last validation loss (every run.eval_every_rounds rounds)", "round",
           "val_loss"),
    Metric("counter", "gasloc_exchange_outcomes", "rounds by the outcome of their exchange (ok, solo, busy, "
           "timeout, rejected, failed) and, for rejected, the status code", "round", labels=("outcome", "code")),
    Metric("counter", "gasloc_exchange_attempts", "exchange attempts (several per round when partners are busy)",
           "round", "attempts"),
    Metric("counter", "gasloc_bytes_sent", "bytes sent in exchanges", "round", "bytes_sent"),
    Metric("counter", "gasloc_bytes_received", "bytes received in exchanges", "round", "bytes_received"),
    Metric("histogram", "gasloc_exchange_seconds", "duration of the round's reported exchange attempt", "round",
           "exchange_s", when="attempts"),
    Metric("histogram", "gasloc_partner_search_seconds", "time spent looking for a partner per round (failed "
           "attempts included)", "round", "wait_s"),
    Metric("histogram", "gasloc_round_seconds", "wall time of a round", "round", "round_s"),
    Metric("gauge", "gasloc_consensus_distance", "||own - partner's|| / ||own|| at the last ok exchange", "round",
           "consensus"),
    Metric("gauge", "gasloc_tokens_per_second", "training tokens per second over the last inner phase", "round",
           "tokens_per_s"),
    Metric("gauge", "gasloc_live_peers", "other compatible peers in sight, past joining", "round", "live_peers"),
    Metric("gauge", "gasloc_swarm_estimate", "the swarm's size as this peer's bucket reads estimate it (membership)",
           "round", "swarm_estimate"),
    Metric("gauge", "gasloc_membership_buckets", "bucket keys the run's records are spread over, at this peer's "
           "level (protocol/buckets.py)", "round", "buckets"),
    Metric("counter", "gasloc_dht_read_bytes", "bytes of the membership records in the DHT's answers (listings, "
           "lookups), each answer counted once; the network carries one copy per DHT node a get asks (3 in an open "
           "swarm, 1 in a private one)", "round", "dht_bytes_read"),
    Metric("counter", "gasloc_signed_hints_refused", "signed records handed to us with hints that failed their "
           "check (forged, foreign, expired, misplaced) and were not used", "round", "signed_hints_refused"),
    Metric("counter", "gasloc_passed_over", "ready peers on much slower links passed over (swarm.slower_link_ratio)",
           "round", "passed_over"),
    Metric("counter", "gasloc_guard_verdicts", "partners' tensors judged by the robust-mixing guard, by verdict "
           "(accept, clip, reject; protocol/guard.py)", "round", labels=("guard",), when="guard"),
    Metric("histogram", "gasloc_guard_clipped_by", "share of a clipped partner's difference the guard cut off",
           "round", "clipped_by", when="clipped_by", buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.99)),
    Metric("gauge", "gasloc_guard_tau", "the guard's current clipping radius (relative distance)", "round",
           "guard_tau"),
    Metric("gauge", "gasloc_partner_trust", "trust of the last judged partner (1: clean record)", "round",
           "partner_trust"),
    Metric("counter", "gasloc_recoveries", "returns to the newest finite checkpoint after a non-finite loss",
           "recovered"),
    Metric("counter", "gasloc_joins_served", "state downloads served to joining peers, by the joiner's verdict",
           "state_served", labels=("outcome",)),
    Metric("counter", "gasloc_resyncs", "downloads of the swarm's state instead of mixing our own model on, by "
           "reason (absent: a long stop; behind: resumed or returned far behind the swarm; odd one out: far from "
           "several partners in a row)", "resync", labels=("reason",)),
    Metric("counter", "gasloc_checkpoints", "checkpoints written", "checkpoint"),
    Metric("age", "gasloc_checkpoint_age_seconds", "seconds since the last checkpoint was written (NaN: none yet)",
           "checkpoint"),
)


class MetricsConfig(BaseModel):
    """Prometheus endpoints of the peer (off by default)."""
    model_config = ConfigDict(extra="forbid")

    port: int | None = Field(None, ge=0, le=65535, description="serve the peer's Prometheus metrics on "
                             "http://<host>:<port>/metrics (0: any free port, logged as metrics_listening); unset: "
                             "no endpoint")
    host: str = Field("127.0.0.1", description="address the metrics endpoint binds to (0.0.0.0: every interface, "
                      "for a scraper on another machine)")
    p2pd_port: int | None = Field(None, ge=1, le=65535, description="also have the peer's p2pd serve its own "
                                  "libp2p metrics (connections, streams, resource manager, AutoNAT) on "
                                  "http://<host>:<p2pd_port>/metrics; an explicit port (p2pd does not report a "
                                  "chosen one); unset: off")


class _Age:
    """A gauge that reads the seconds since the last event when scraped."""

    def __init__(self, name: str, help: str, registry: prom.CollectorRegistry):
        self._at: float | None = None
        prom.Gauge(name, help, registry=registry).set_function(
            lambda: math.nan if self._at is None else time.time() - self._at)

    def mark(self, at: float) -> None:
        self._at = at


class PrometheusSink:
    """A MetricsSink that updates METRICS and serves them over HTTP (prometheus_client's server thread)."""

    def __init__(self, cfg: MetricsConfig, metrics: tuple[Metric, ...] = METRICS):
        self.registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, process_open_fds, ...
        self._by_event: dict[str, list[tuple[Metric, Any]]] = {}
        for m in metrics:
            self._by_event.setdefault(m.event, []).append((m, self._make(m)))
        self.server, self._thread = prom.start_http_server(cfg.port or 0, addr=cfg.host, registry=self.registry)
        self.port = self.server.server_port
        self.url = f"http://{cfg.host}:{self.port}/metrics"
        log.info("metrics_listening url=%s", self.url)

    def _make(self, m: Metric):
        r = self.registry
        if m.kind == "counter":
            return prom.Counter(m.name, m.help, m.labels, registry=r)
        if m.kind == "gauge":
            return prom.Gauge(m.name, m.help, m.labels, registry=r)
        if m.kind == "histogram":
            return prom.Histogram(m.name, m.help, m.labels, buckets=m.buckets, registry=r)
        if m.kind == "info":
            return prom.Gauge(f"{m.name}_info", m.help, m.labels, registry=r)
        return _Age(m.name, m.help, r)

    def emit(self, event: str, **fields: Any) -> None:
        for m, metric in self._by_event.get(event, ()):
            if m.when is not None and not fields.get(m.when):
                continue
            value = 1.0 if m.value is None else fields.get(m.value)
            if value is None:
                continue
            if m.kind == "age":
                metric.mark(time.time())
                continue
            target = metric.labels(*("" if fields.get(k) is None else str(fields[k]) for k in m.labels)) \
                if m.labels else metric
            value = float(value)
            if m.kind == "counter":
                target.inc(max(value, 0.0))  # a counter never decreases; inc(0) still creates a labelled series
            elif m.kind == "histogram":
                target.observe(value)
            elif m.kind == "info":
                target.set(1)
            else:
                target.set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TeeSink:
    """Every event to each of several sinks (metrics.jsonl and Prometheus)."""

    def __init__(self, *sinks):
        self.sinks = sinks

    def emit(self, event: str, **fields: Any) -> None:
        for s in self.sinks:
            s.emit(event, **fields)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
