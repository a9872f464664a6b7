"""bench/adversary.py's per-mode summary (--repeats): the median of a mode's swarms against the clean median, and the
issue's target (within the mode's bound, no honest crash, no hostile state adopted in any swarm)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from adversary import format_summary, summarize  # noqa: E402


def _row(mode: str, val: float, crashes: int = 0, adopted: int = 0) -> dict:
    return {"mode": mode, "val": val, "crashes": crashes, "adopted": adopted}


def test_a_mode_is_judged_by_the_median_of_its_swarms():
    rows = [_row("clean", 2.0), _row("clean", 2.2), _row("clean", 2.1),
            _row("uphill", 2.5), _row("uphill", 2.15), _row("uphill", 2.0),        # one bad swarm: median 2.15
            _row("echo", 2.3), _row("echo", 2.25), _row("echo", 2.0),              # median 2.25: +7 %
            _row("sybil", 2.25), _row("sybil", 2.3), _row("sybil", 1.9),           # +7 %, bound 10 %
            _row("donor-id", 2.0), _row("donor-id", 2.0, adopted=1), _row("donor-id", 2.0),
            _row("noisy", 2.0), _row("noisy", math.nan, crashes=1)]
    by = {m["mode"]: m for m in summarize(rows, 2.1)}
    assert by["clean"]["met"] is None and by["clean"]["median"] == 2.1
    assert by["uphill"]["met"] and math.isclose(by["uphill"]["ratio"], 2.15 / 2.1)
    assert by["uphill"]["low"] == 2.0 and by["uphill"]["high"] == 2.5 and by["uphill"]["swarms"] == 3
    assert by["echo"]["met"] is False
    assert by["sybil"]["met"] is True and by["sybil"]["bound"] == 1.10
    assert by["donor-id"]["met"] is False            # one adoption in any swarm fails the mode
    assert by["noisy"]["met"] is False and by["noisy"]["median"] == 2.0   # a crash fails it; NaN is no value
    table = format_summary(summarize(rows, 2.1))
    assert "uphill" in table and "MISSED" in table and "+2.4%" in table
