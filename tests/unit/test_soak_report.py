"""bench/soak.py's figures from recorded events (bench/soak_report.py), on hand-made data."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from soak_report import Incarnation, analyse, format_table  # noqa: E402


def test_figures():
    t0 = 1000.0
    steady = Incarnation("p0", "p0", t0, "initial")
    steady.mem = [(t0 + s, 100e6 + (2e6 if s >= 500 else 0), 50) for s in range(0, 600, 5)]  # +2 % at the end
    steady.rounds = [{"time": t0 + s, "loss": 3.0, "val_loss": 4.0 - s / 300, "exchange_s": 0.5, "attempts": 1,
                      "outcome": "ok", "consensus": 0.1} for s in range(10, 600, 20)]
    steady.rounds[3] |= {"exchange_s": 4.0}  # past a 2.5 s deadline + 0.5 s grace
    steady.rounds[4] |= {"loss": None}       # a NaN training loss (metrics.jsonl writes null)
    steady.rounds[5] |= {"outcome": "rejected", "code": "NOT_FINITE"}
    leaky = Incarnation("p1", "p1", t0, "initial")
    leaky.mem = [(t0 + s, 100e6, 50 + (s >= 500)) for s in range(0, 600, 5)]  # one more fd at the end
    back = Incarnation("p2", "p2#2", t0 + 300, "restart-after-kill9", starts=[{"joined_from": "checkpoint"}])
    back.mem = [(t0 + s, 90e6, 40) for s in range(300, 600, 5)]  # not alive in the reference window: not judged
    joiner = Incarnation("j1", "j1", t0 + 200, "joiner", starts=[{"joined_from": "12D3KooWX"}])
    res = analyse([steady, leaky, back, joiner], t0=t0, t1=t0 + 600, exchange_timeout_s=2.5, grace_s=0.5,
                  leftovers={"processes": [], "sockets": [], "sockets_of_kill9": ["/tmp/x.sock"]}, faults=[])
    assert res["past_deadline"] == 1 and res["past_deadline_worst_s"] == 4.0
    assert res["nonfinite_own_loss"] == 1 and res["nonfinite_refused"] == 1 and res["nonfinite_mixed"] == 0
    assert res["val_loss_end"] < res["val_loss_early"]
    assert abs(res["max_rss_growth"] - 0.02) < 1e-9 and res["max_fd_growth"] == 1
    assert res["per_process"]["p2#2"]["rss_growth"] is None
    assert {(r["name"], r["became"]) for r in res["restarts"]} == {("p2#2", "resumed"), ("j1", "re-joined")}
    table = format_table(res)
    assert "| exchanges past their deadline | 1" in table and "+2.0 %" in table


def test_an_exchange_in_flight_while_its_own_process_was_stopped_is_not_past_its_deadline():
    """The soak's SIGSTOP freezes a peer's whole tree for stop_s; an exchange it had begun ends stop_s later by its
    own clock. That is the fault, reported apart; a late exchange of a peer that was not stopped still counts."""
    t0 = 1000.0
    stopped = Incarnation("p4", "p4", t0, "initial")
    stopped.rounds = [{"time": t0 + 120.1, "exchange_s": 20.1, "attempts": 1, "outcome": "timeout", "loss": 3.0}]
    other = Incarnation("p5", "p5", t0, "initial")
    other.rounds = [{"time": t0 + 121.0, "exchange_s": 5.0, "attempts": 1, "outcome": "timeout", "loss": 3.0}]
    faults = [{"time": t0 + 100.0, "kind": "sigstop", "peer": "p4"}]
    res = analyse([stopped, other], t0=t0, t1=t0 + 600, exchange_timeout_s=2.5, grace_s=0.5, leftovers={},
                  faults=faults, stop_s=20.0)
    assert res["past_deadline"] == 1 and res["past_deadline_worst_s"] == 5.0
    assert res["past_deadline_while_stopped"] == 1 and res["past_deadline_while_stopped_worst_s"] == 20.1
    # the same late exchange long after the stop ended counts
    stopped.rounds[0]["time"] = t0 + 300.0
    res = analyse([stopped], t0=t0, t1=t0 + 600, exchange_timeout_s=2.5, grace_s=0.5, leftovers={},
                  faults=faults, stop_s=20.0)
    assert res["past_deadline"] == 1 and res["past_deadline_while_stopped"] == 0
