"""bench/nat.py without the lab: payload sizes of the presets, reading the answering relay off where a relayed
stream was cut, a row's summary and the markdown table (the lab runs are in docs/nat.md)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "bench" / "nat.py"
_spec = importlib.util.spec_from_file_location("nat_bench", _path)
nb = importlib.util.module_from_spec(_spec)
sys.modules["nat_bench"] = nb
_spec.loader.exec_module(nb)


def test_tiny_payload_is_the_tiny_presets_parameters_in_float32():
    specs = nb.param_specs("tiny")
    assert nb.payload_bytes(specs) == 3_543_552      # 885,888 parameters (`gasloc presets`, byte vocabulary)
    assert nb.payload_bytes([[2, 3], [5]]) == 44


def test_the_answering_relay_is_read_off_where_the_stream_was_cut():
    assert nb.which_relay(None, None) == "none answered"
    # go-libp2p's default relay: 128 KiB per direction per circuit, minus framing, is what reaches the sink
    assert nb.which_relay(120_000, None).startswith("go-libp2p default relay")
    assert nb.which_relay(1_040_000, 1 << 20).startswith("p2pd's configured relay (-relayDataLimit=1048576)")
    assert nb.which_relay(3_543_552, None) == "p2pd's configured relay (limit above the payload)"


def test_a_row_with_a_failed_run_says_how_far_it_got():
    ok = {"ok": True, "seconds": 2.0, "path": "direct", "bytes_received": 10}
    row = nb.summarize({"path": "direct", "preset": "tiny", "payload_bytes": 4_000_000,
                        "runs": [ok, {**ok, "seconds": 1.0}, {**ok, "seconds": 4.0}]})
    assert row["outcome"] == "ok" and row["median_s"] == 2.0 and row["min_s"] == 1.0 and row["mb_per_s"] == 2.0
    bad = nb.summarize({"path": "relayed", "preset": "tiny", "payload_bytes": 4_000_000,
                        "runs": [{"ok": False, "seconds": 0.1, "path": "direct", "bytes_received": 120_000,
                                  "detail": "outcome=failed"}]})
    assert bad["outcome"] == "failed: received 120000 of 4000000 bytes" and "median_s" not in bad


def test_markdown_has_a_line_per_row_and_per_relay_trial():
    result = {"rows": [{"path": "direct", "preset": "tiny", "payload_bytes": 3_543_552, "median_s": 0.5,
                        "min_s": 0.4, "mb_per_s": 7.1, "outcome": "ok"},
                       {"path": "holepunch", "preset": "-", "payload_bytes": 0, "outcome": "no direct connection"}],
              "relay_limits": {"payload_bytes": 3_543_552, "trials": [
                  {"variant": "defaults", "reservation_s": 3.2, "outcome": "reset after 130000 bytes",
                   "answered_by": "go-libp2p default relay", "time_limit": {"outcome": "cut after 120 s"}}]}}
    md = nb.markdown(result).splitlines()
    assert md[2] == "| direct | tiny | 3.5 | 0.50 (0.40) | 7.1 | ok |"
    assert md[3] == "| holepunch | - | - | - | - | no direct connection |"
    assert "| defaults | 3.2 | reset after 130000 bytes | go-libp2p default relay |" in md
    assert any("cut after 120 s" in line for line in md)


def test_the_relays_own_count_of_a_circuit_is_read_off_its_log():
    line = '{"level":"debug","logger":"relay","msg":"relayed %d bytes from %s to %s"}'
    lines = [line % (131072, "NA", "NB"), line % (1406, "NB", "NA"), "not json: relayed 9 bytes from NA to NB",
             line % (4096, "NA", "NB")]
    assert nb.relayed_bytes(lines, "NA", "NB") == 131072       # the largest, in the asked direction only
    assert nb.relayed_bytes(lines, "NB", "NA") == 1406
    assert nb.relayed_bytes(lines[:1], "NA", "XX") is None


def test_a_circuit_address_is_encoded_as_p2pd_parses_it():
    """hivemind's bundled multiaddr writes /p2p/<id> as a CID, which p2pd rejects; nat_worker writes the multihash."""
    spec = importlib.util.spec_from_file_location("nat_worker", _path.with_name("nat_worker.py"))
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    from hivemind.p2p import PeerID
    pid = "12D3KooWJ8rH55LcMTojULioFNh2gyRvYnZqnh1nKEBSp9Nf4xgb"
    mh = PeerID.from_base58(pid).to_bytes()
    tcp = bytes([0x04, 10, 77, 0, 1, 0x06, 0x0F, 0xA1])             # /ip4/10.77.0.1/tcp/4001
    got = worker.GoMaddr(f"/ip4/10.77.0.1/tcp/4001/p2p/{pid}/p2p-circuit").to_bytes()
    assert got == tcp + b"\xa5\x03" + bytes([len(mh)]) + mh + b"\xa2\x02"   # 421 = p2p, 290 = p2p-circuit
    assert worker.GoMaddr("/ip4/10.77.0.1/tcp/4001").to_bytes() == tcp


def test_a_transfer_that_went_through_is_not_read_at_another_circuits_count():
    through = {"bytes_received": 1000, "push": {"written": 1000, "error": ""}, "relay_counted": 1406}
    cut = {"bytes_received": 98304, "push": {"written": 491520, "error": "reset"}, "relay_counted": 131072}
    assert nb.answered_at(through) == 1000 and nb.answered_at(cut) == 131072
    assert nb.answered_at({**cut, "relay_counted": None}) == 98304
