"""Seeing the swarm (issue 14): a peer's Prometheus endpoint moves between rounds, `gasloc status` lists a 4-peer
swarm (table and JSON) and says in one line when nobody is there, and `gasloc status --serve` serves the live page
and its JSON, rendered in headless Chromium."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness import free_port
from e2e.swarm_helpers import RUN_ID, rounds, start_event, start_peers, write_config
from gasloc.cli.statusview import short
from gasloc.protocol.codec import DEFAULT_CODEC

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def scrape(url: str) -> dict[str, float]:
    """sample name + sorted labels -> value, of a Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.timeout(420)
def test_metrics_status_and_live_page_of_a_four_peer_swarm(harness, bootstrap, tmp_path):
    h = harness
    # 1. nobody there yet: one line, exit 0
    res = h.run("status", "--initial-peers", bootstrap[0], "--run-id", RUN_ID, timeout_s=90)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().count("\n") == 0 and "no peers in sight" in res.stdout, res.stdout

    cfg = write_config(h, inner_steps=10)
    names = ["p0", "p1", "p2", "p3"]
    p2pd_port = free_port()
    # p0 serves Prometheus metrics (any free port: the start event says where) and its p2pd's own; it starts together
    # with the other three
    h.spawn("p0", "peer", "--config", cfg, "--initial-peers", bootstrap[0], "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--run-dir", h.dir("p0"), "--metrics-port", "0", env={"GASLOC_METRICS__P2PD_PORT": str(p2pd_port)})
    ids = start_peers(h, names[1:], bootstrap, cfg)
    ids["p0"] = h.wait_ready(h.child("p0"), 150)["peer_id"]

    # 2. /metrics of a running peer: counters move between two rounds
    url = start_event(h, "p0")["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), url
    h.wait_until(lambda: len(rounds(h, "p0")) >= 1, 120, "p0's first round", alive=tuple(names))
    before, n_before = scrape(url), len(rounds(h, "p0"))
    h.wait_until(lambda: len(rounds(h, "p0")) >= n_before + 2
                 and any(r["outcome"] == "ok" for r in rounds(h, "p0")), 120, "two more rounds and an ok exchange",
                 alive=tuple(names))
    after = scrape(url)
    assert after["gasloc_rounds_total"] >= before["gasloc_rounds_total"] + 2, (before, after)
    assert after["gasloc_inner_steps_total"] >= before["gasloc_inner_steps_total"] + 20
    assert after["gasloc_round"] > before["gasloc_round"]
    assert after["gasloc_round_seconds_count"] >= before["gasloc_round_seconds_count"] + 2
    assert total(after, "gasloc_exchange_outcomes_total") >= total(before, "gasloc_exchange_outcomes_total") + 2
    assert after["gasloc_bytes_sent_total"] > 0 and after["gasloc_bytes_received_total"] > 0
    assert after.get("gasloc_exchange_outcomes_total{code=,outcome=ok}", 0) >= 1, after
    assert after["gasloc_exchange_seconds_count"] >= 1 and after["gasloc_train_loss"] > 0
    assert after["process_resident_memory_bytes"] > 10e6 and after["process_open_fds"] > 3
    assert after[f"gasloc_peer_info{{algorithm=gasloc,codec={DEFAULT_CODEC},device=cpu,peer_id={ids['p0']}}}"] == 1
    # p2pd's own libp2p metrics, behind metrics.p2pd_port
    with urllib.request.urlopen(f"http://127.0.0.1:{p2pd_port}/metrics", timeout=10) as r:
        assert b"libp2p_" in r.read()

    # 3. gasloc status lists all four with their rounds, as a table and as JSON
    h.wait_until(lambda: all(len(rounds(h, n)) >= 2 for n in names), 150, "two rounds each", alive=tuple(names))
    # the two readings of the swarm and the live page (section 4) start at once: each is a process of its own that
    # joins the DHT, and none waits for another
    h.spawn("page", "status", "--initial-peers", bootstrap[0], "--run-id", RUN_ID, "--serve", "0", "--interval", "1")
    with ThreadPoolExecutor(2) as pool:
        as_json = pool.submit(h.run, "status", "--initial-peers", bootstrap[0], "--run-id", RUN_ID, "--json",
                              timeout_s=90)
        as_table = pool.submit(h.run, "status", "--initial-peers", bootstrap[0], "--run-id", RUN_ID, timeout_s=90)
        res, table = as_json.result(), as_table.result()
    assert res.returncode == 0, res.stderr
    snap = json.loads(res.stdout)
    listed = {p["peer_id"]: p for p in snap["peers"]}
    assert set(listed) == set(ids.values()), (listed.keys(), ids)
    for n in names:
        p = listed[ids[n]]
        # a record is at most one announcement (ttl/3) behind the peer's own count
        assert 1 <= p["round"] <= rounds(h, n)[-1]["round"] + 1, (n, p, rounds(h, n)[-1])
        assert p["state"] in ("training", "exchanging") and p["loss"] is not None and p["version"], p
    assert snap["totals"]["peers"] == 4 and snap["totals"]["tokens_per_s"] > 0, snap["totals"]
    # four peers fit one bucket (protocol/buckets.py): status reads the whole swarm and says so
    assert snap["sampled"] is False and snap["sampling"]["buckets_read"] == snap["sampling"]["buckets"], snap["sampling"]
    assert table.returncode == 0, table.stderr
    for n in names:
        assert short(ids[n]) in table.stdout, table.stdout
    assert "4 peers" in table.stdout and "own claim" in table.stdout and "read all" in table.stdout, table.stdout

    # 4. the live page and its JSON
    base = h.wait_ready(h.child("page"))["url"]
    h.wait_until(lambda: len(json.loads(get(base + "api/swarm")[1])["history"]["edges"]) >= 2, 90,
                 "two exchange edges on the page", alive=tuple(names) + ("page",))
    code, body = get(base + "api/swarm")
    data = json.loads(body)
    assert code == 200 and data["error"] is None, data
    assert {p["peer_id"] for p in data["snapshot"]["peers"]} == set(ids.values())
    assert set(data["history"]["curves"]) == set(ids.values())
    for e in data["history"]["edges"]:
        assert {e["a"], e["b"]} <= set(ids.values()) and e["a"] != e["b"], e
    code, body = get(base)
    assert code == 200 and b"<table id=\"peers\">" in body
    assert get(base + "nope")[0] == 404

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's package)")
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                          "--virtual-time-budget=5000", "--dump-dom", base],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for n in names:  # the table rendered by the page's script shows every peer
        assert f'data-peer="{ids[n]}"' in dom.stdout, (n, dom.stdout[-3000:])
    assert "4 peers" in dom.stdout
    shot = os.environ.get("GASLOC_TEST_SCREENSHOT")  # how docs/img/status-page.png is made
    if shot:
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", "--hide-scrollbars",
                        "--window-size=1000,720", "--virtual-time-budget=5000", f"--screenshot={shot}", base],
                       capture_output=True, timeout=120, check=True)
