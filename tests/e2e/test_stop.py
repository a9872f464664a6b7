"""A stop signal is not held by a donor: a peer whose state download stalls (its donor's Python froze while its
p2pd and DHT child go on, so the stream opens and no reply comes: a hung or hostile donor) and that gets SIGTERM
gives the download up and exits at once, where it waited out the donor's reply deadline before (the join's whole
budget at worst, each donor in turn). peer/daemon.py `_adopt_swarm_state`, runtime/aio.py `Stopped`."""
from __future__ import annotations

import signal
import time

import pytest

from e2e.harness import LOOPBACK
from e2e.swarm_helpers import rounds, write_config

ACCEPT_S = 60.0  # the joiner's wait for a donor's reply: what it would sit out without the stop


@pytest.mark.light  # one peer trains alone; the verdict (seconds against a 60 s deadline) does not depend on pace
@pytest.mark.timeout(180)
def test_sigterm_gives_a_stalled_state_download_up(harness, bootstrap):
    h = harness
    cfg = write_config(h, ttl_s=60.0)   # the frozen donor stays listed while the joiner starts
    h.start("donor", "peer", "--config", cfg, "--initial-peers", bootstrap[0], "--host-maddrs", LOOPBACK,
            "--run-dir", h.dir("donor"))
    h.wait_until(lambda: len(rounds(h, "donor")) >= 2, 60, "the donor trains two rounds", alive=("donor",))
    slow = h.run_dir / "joiner.toml"
    slow.write_text(cfg.read_text() + f"[state_transfer]\naccept_timeout_s = {ACCEPT_S}\n")
    h.child("donor").signal(signal.SIGSTOP)    # the main process alone
    try:
        h.spawn("joiner", "peer", "--config", slow, "--initial-peers", bootstrap[0], "--host-maddrs", LOOPBACK,
                "--run-dir", h.dir("joiner"))
        h.wait_until(lambda: "join: downloading state" in h.log("joiner"), 90, "the joiner asks the frozen donor",
                     alive=("joiner",))
        time.sleep(1.0)   # into the download: the request is out, no reply comes
        t0 = time.monotonic()
        h.terminate("joiner")
        rc = h.wait_exit("joiner", ACCEPT_S / 2)
        took = time.monotonic() - t0
    finally:
        h.child("donor").signal(signal.SIGCONT)
    log = h.log("joiner")
    assert rc == 0 and took < ACCEPT_S / 4, (rc, took, log)
    assert "join: stopping; the state download is given up" in log, log
    assert "adopted the state" not in log and "checkpoint_saved" not in log, log   # nothing half-joined is saved
