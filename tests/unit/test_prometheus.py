"""The Prometheus sink: every metric of the table follows its event, the endpoint serves them, and the table and
docs/metrics.md list the same metrics."""
from __future__ import annotations

import math
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gasloc.peer.prometheus import METRICS, Metric, MetricsConfig, PrometheusSink, TeeSink

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _round(**over):
    base = dict(round=4, inner_steps=10, loss=2.5, val_loss=None, outcome="ok", code=None, attempts=1,
                bytes_sent=1000, bytes_received=900, exchange_s=0.3, wait_s=0.1, round_s=1.2, consensus=0.05,
                tokens_per_s=800.0, live_peers=3, passed_over=0)
    return {**base, **over}


@pytest.fixture
def sink():
    s = PrometheusSink(MetricsConfig(port=0))
    yield s
    s.close()


def scrape(sink) -> dict[str, float]:
    with urllib.request.urlopen(sink.url, timeout=10) as r:
        text = r.read().decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_round_events_move_counters_gauges_and_histograms(sink):
    sink.emit("start", peer_id="12D3KooWA", algorithm="gasloc", device="cpu", codec="int4", round=0)
    sink.emit("round", **_round())
    sink.emit("round", **_round(round=5, val_loss=2.4, outcome="rejected", code="NOT_FINITE", bytes_sent=0,
                                bytes_received=0, consensus=None))
    sink.emit("round", **_round(round=6, outcome="solo", attempts=0, exchange_s=0.0))
    m = scrape(sink)
    assert m["gasloc_rounds_total[]"] == 3 and m["gasloc_inner_steps_total[]"] == 30 and m["gasloc_round[]"] == 6
    assert m["gasloc_bytes_sent_total[]"] == 2000 and m["gasloc_val_loss[]"] == 2.4
    assert m["gasloc_exchange_outcomes_total[('code', ''), ('outcome', 'ok')]"] == 1
    assert m["gasloc_exchange_outcomes_total[('code', 'NOT_FINITE'), ('outcome', 'rejected')]"] == 1
    assert m["gasloc_exchange_outcomes_total[('code', ''), ('outcome', 'solo')]"] == 1
    assert m["gasloc_exchange_seconds_count[]"] == 2  # the solo round had no attempt: no exchange to time
    assert m["gasloc_partner_search_seconds_count[]"] == 3
    assert m["gasloc_consensus_distance[]"] == 0.05  # a null consensus left the last value
    assert m["gasloc_peer_info[('algorithm', 'gasloc'), ('codec', 'int4'), ('device', 'cpu'), ('peer_id', '12D3KooWA')]"] == 1
    assert m["process_resident_memory_bytes[]"] > 0 and m["process_open_fds[]"] > 0


def test_checkpoint_age_and_joins_served(sink):
    assert math.isnan(scrape(sink)["gasloc_checkpoint_age_seconds[]"])  # none written yet
    sink.emit("checkpoint", round=5, path="x")
    sink.emit("state_served", joiner="12D3KooWB", outcome="OK", bytes=10, seconds=0.1)
    m = scrape(sink)
    assert 0 <= m["gasloc_checkpoint_age_seconds[]"] < 5 and m["gasloc_checkpoints_total[]"] == 1
    assert m["gasloc_joins_served_total[('outcome', 'OK')]"] == 1


def test_guard_verdicts_and_recoveries(sink):
    """The robust-mixing guard's fields of a round record (peer/daemon.py _guard_fields) and the recovery event."""
    sink.emit("round", **_round(guard="clip", guard_tau=0.3, clipped_by=0.4, rejected=False, partner_trust=0.8))
    sink.emit("round", **_round(guard="reject", guard_tau=0.3, clipped_by=0.0, rejected=True, partner_trust=0.5))
    sink.emit("round", **_round(outcome="solo", guard=None, guard_tau=None, clipped_by=None, partner_trust=None))
    sink.emit("recovered", from_round=7, round=5)
    m = scrape(sink)
    assert m["gasloc_guard_verdicts_total[('guard', 'clip')]"] == 1
    assert m["gasloc_guard_verdicts_total[('guard', 'reject')]"] == 1
    assert m["gasloc_guard_clipped_by_count[]"] == 1 and m["gasloc_guard_clipped_by_sum[]"] == 0.4
    assert m["gasloc_partner_trust[]"] == 0.5 and m["gasloc_guard_tau[]"] == 0.3
    assert m["gasloc_recoveries_total[]"] == 1


def test_a_new_metric_is_one_line():
    extra = Metric("counter", "gasloc_mixes_clipped", "mixes whose update was clipped", "round", "clipped")
    s = PrometheusSink(MetricsConfig(port=0), metrics=(*METRICS, extra))
    try:
        TeeSink(s).emit("round", **_round(clipped=2))
        assert scrape(s)["gasloc_mixes_clipped_total[]"] == 2
    finally:
        s.close()


def test_a_taken_port_is_an_oserror_the_peer_reports(sink):
    with pytest.raises(OSError):
        PrometheusSink(MetricsConfig(port=sink.port))


def test_docs_list_every_metric():
    text = DOCS.read_text()
    for m in METRICS:
        exposed = m.name + {"counter": "_total", "info": "_info"}.get(m.kind, "")
        assert f"`{exposed}" in text, f"{exposed} is missing from docs/metrics.md"
