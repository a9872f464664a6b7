"""gasloc status's view without I/O: rows from records (claims, missing views, other configs), totals, the live
page's history (loss per round, recent exchange edges that expire), and the one-line empty case."""
from __future__ import annotations

from gasloc.cli.statusview import History, no_peers_line, render_table, snapshot
from gasloc.peer.swarm.membership import PeerRecord


def rec(pid: str, round: int, t: float, view: dict | None = None, fingerprint: str = "fp", **over) -> PeerRecord:
    base = dict(peer_id=pid, protocol=1, fingerprint=fingerprint, state="training", round=round,
                throughput_tps=100.0, bandwidth_bps=0.0, time=t)
    if view is not None:
        base["view"] = view
    return PeerRecord.parse_obj({**base, **over})


def test_rows_and_totals():
    records = {"A": rec("A", 5, 99.0, {"loss": 2.0, "round_s": 2.0, "partners": ["B"], "version": "0.1.0"}),
               "B": rec("B", 7, 98.0, {"loss": 2.1, "round_s": 3.0, "reachability": "public"},
                        bandwidth_bps=5e6),
               "C": rec("C", 1, 97.0)}  # an older peer: no view
    snap = snapshot(records, run_id="r", now=100.0)
    assert [p["peer_id"] for p in snap["peers"]] == ["B", "A", "C"]  # most advanced first
    a, b, c = (next(p for p in snap["peers"] if p["peer_id"] == x) for x in "ABC")
    assert a["loss"] == 2.0 and a["partners"] == ["B"] and a["bandwidth_bps"] is None  # 0.0: not measured yet
    assert b["reachability"] == "public" and b["bandwidth_bps"] == 5e6 and b["announced_s_ago"] == 2.0
    assert c["loss"] is None and c["version"] is None
    t = snap["totals"]
    assert t["peers"] == 3 and t["tokens_per_s"] == 300.0 and t["rounds_per_min"] == 30.0 + 20.0
    assert t["configs"] == 1 and "round" in snap["claimed"]


def test_table_marks_other_configs_and_claims():
    from rich.console import Console

    records = {"A": rec("A", 5, 99.0), "B": rec("B", 5, 99.0), "C": rec("C", 2, 99.0, fingerprint="other")}
    console = Console(width=200, record=True)
    console.print(render_table(snapshot(records, run_id="r", now=100.0), ["/ip4/1.2.3.4/tcp/1/p2p/X"]))
    out = console.export_text()
    assert "C (other config)" in out and "A (other config)" not in out and "own claim" in out and "3 peers" in out


def test_nobody_there_is_one_line():
    from rich.text import Text

    snap = snapshot({}, run_id="r", now=1.0)
    shown = render_table(snap, ["/ip4/1.2.3.4/tcp/1/p2p/X"])
    assert isinstance(shown, Text) and "\n" not in shown.plain and "no peers in sight" in shown.plain
    assert "2 initial peers" in no_peers_line("r", ["a", "b"])


def test_history_keeps_one_point_per_round_and_expires_edges():
    h = History(edge_window_s=10.0)
    h.add(snapshot({"A": rec("A", 1, 0.0, {"loss": 3.0, "partners": ["B"]})}, run_id="r", now=1.0))
    h.add(snapshot({"A": rec("A", 1, 0.0, {"loss": 3.0, "partners": ["B"]})}, run_id="r", now=2.0))  # same round
    h.add(snapshot({"A": rec("A", 2, 0.0, {"loss": 2.9, "partners": ["B", "C"]}),
                    "C": rec("C", 2, 0.0, {"loss": 2.8, "partners": ["A"]})}, run_id="r", now=5.0))
    j = h.to_json()
    assert [p["round"] for p in j["curves"]["A"]] == [1, 2]
    assert {(e["a"], e["b"]) for e in j["edges"]} == {("A", "B"), ("A", "C")}
    h.add(snapshot({"A": rec("A", 3, 0.0, {"loss": 2.7, "partners": ["B", "C"]})}, run_id="r", now=12.0))
    assert {(e["a"], e["b"]) for e in h.to_json()["edges"]} == {("A", "C")}  # A-B last seen at t=1: expired


def test_a_sampled_snapshot_says_how_much_of_the_swarm_it_shows():
    from rich.console import Console

    from gasloc.cli.statusview import sampling_line

    records = {"A": rec("A", 5, 99.0), "B": rec("B", 5, 99.0)}
    sampled = snapshot(records, run_id="r", now=100.0, sampling={"buckets_read": 4, "buckets": 16, "estimate": 131.6})
    assert sampled["sampled"] is True and sampled["sampling"]["buckets"] == 16
    assert sampling_line(sampled) == "sampled 4 of 16 buckets, ~132 peers estimated"
    whole = snapshot(records, run_id="r", now=100.0, sampling={"buckets_read": 2, "buckets": 2, "estimate": 2.0})
    assert whole["sampled"] is False and sampling_line(whole) == "read all 2 bucket(s) of the swarm"
    console = Console(width=200, record=True)
    console.print(render_table(sampled, ["/ip4/1.2.3.4/tcp/1/p2p/X"]))
    assert "sampled 4 of 16 buckets, ~132 peers estimated" in console.export_text()


def test_a_view_with_keys_named_like_model_attributes_does_not_break_the_rows():
    """A hostile record's view {"dict": 1.0} passes the DHT's checks (the view is an extra field); pydantic v1 would
    let it shadow StatusView.dict, and every gasloc status would raise on it. Such keys are dropped."""
    records = {"A": rec("A", 5, 99.0, {"loss": 2.0, "dict": 1.0, "_iter": 1, "json": 2, "copy": 3,
                                      "reachability": "public"})}
    (row,) = snapshot(records, run_id="r", now=100.0)["peers"]
    assert row["loss"] == 2.0 and row["reachability"] == "public" and row["extra"] == {}


def test_a_view_with_bytes_and_tuples_shows_as_text_in_json_and_table():
    """msgpack carries bytes and tuples; a peer's view holding them must not break gasloc status --json or its
    table (both raised before)."""
    import json

    from rich.console import Console

    records = {"A": rec("A", 5, 99.0, {"loss": 1.0, "reachability": b"public", "blob": b"x" * 500, "pair": (1, 2),
                                      "nan": float("nan")})}
    snap = snapshot(records, run_id="r", now=100.0)
    (row,) = snap["peers"]
    assert row["reachability"] == "b'public'" and row["extra"]["pair"] == "(1, 2)" and row["extra"]["nan"] is None
    assert len(row["extra"]["blob"]) == 120
    json.dumps(snap, allow_nan=False)
    Console(width=200, record=True).print(render_table(snap, []))


def test_extreme_claims_give_json_without_infinity_and_a_table():
    """Claims a record's schema lets by (any float, any int) must not put Infinity or NaN in the JSON that
    `gasloc status --json` prints and the status page parses (JSON.parse refuses both), nor break the table."""
    import json

    from rich.console import Console

    from gasloc.cli.statusview import History

    odd = [float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 5e-324, 0.0, -0.0]
    records = {}
    for i, x in enumerate(odd):
        pid = f"P{i}"
        records[pid] = rec(pid, 2**62 if i % 2 else -5, x, {"loss": x, "val_loss": x, "round_s": x, "partners": ["Q"]},
                           throughput_tps=x, bandwidth_bps=x)
    snap = snapshot(records, run_id="r", now=100.0)
    history = History()
    history.add(snap)
    json.dumps({"snapshot": snap, "history": history.to_json()}, allow_nan=False)
    Console(width=200, record=True).print(render_table(snap, []))
