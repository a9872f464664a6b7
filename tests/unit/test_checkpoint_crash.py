"""The checkpoint writer under SIGKILL at random moments: afterwards, load_latest returns a complete checkpoint
(whose contents are checked) or None, never a corrupt one."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from gasloc.peer.checkpoint import CheckpointConfig, load_latest
from gasloc.peer.train.inner import InnerConfig, make_inner_optimizer
from gasloc.peer.train.model import ModelConfig, build_model
from gasloc.peer.train.outer import OuterConfig, make_outer

# The writer: resumes from the latest checkpoint, then saves rounds r+1, r+2, ... forever, each with every
# parameter equal to r, and prints "saved r" after each save. It does nothing but save, so a kill lands inside a
# flatten, write, fsync, rename or prune.
WRITER = r"""
import sys, torch
from gasloc.peer.checkpoint import CheckpointConfig, load_latest, save_checkpoint
from gasloc.peer.train.inner import InnerConfig, make_inner_optimizer
from gasloc.peer.train.model import ModelConfig, build_model
from gasloc.peer.train.outer import OuterConfig, make_outer
torch.set_num_threads(1)
cfg = CheckpointConfig(dir=sys.argv[1], keep=2)
model = build_model(ModelConfig(preset="tiny", seq_len=32), 256)
opt = make_inner_optimizer(model, InnerConfig())
outer = make_outer(OuterConfig(), list(model.parameters()))
loaded = load_latest(cfg, model=model, inner_opt=opt, outer=outer, fingerprint="crash")
r = loaded.round if loaded else 0
print("ready", r, flush=True)
while True:
    r += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(r))
        for z in outer.z_prev:
            z.fill_(float(-r))
    save_checkpoint(cfg, model=model, inner_opt=opt, outer=outer, data_state={"batches": r}, round=r,
                    meta={"fingerprint": "crash"})
    print("saved", r, flush=True)
"""


def _check_loaded(tmp_path) -> int:
    model = build_model(ModelConfig(preset="tiny", seq_len=32), 256, seed=9)
    opt = make_inner_optimizer(model, InnerConfig())
    outer = make_outer(OuterConfig(), list(model.parameters()))
    loaded = load_latest(CheckpointConfig(dir=tmp_path), model=model, inner_opt=opt, outer=outer,
                         fingerprint="crash")
    if loaded is None:
        return 0, 0
    r = loaded.round
    assert loaded.data_state == {"batches": r}
    assert all(torch.all(p == r) for p in model.parameters()), "a checkpoint loaded with wrong contents"
    assert all(torch.all(z == -r) for z in outer.z_prev)
    # only interrupted writes may be skipped: a committed checkpoint is never corrupt
    assert all("interrupted save" in why for _, why in loaded.skipped), loaded.skipped
    return r, len(loaded.skipped)


@pytest.mark.timeout(400)
def test_sigkill_mid_save_never_leaves_a_loadable_corrupt_checkpoint(tmp_path):
    rng = random.Random(1234)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    last, torn = 0, 0
    for attempt in range(10):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                env=env)
        try:
            ready = proc.stdout.readline().split()  # readiness: the writer has loaded and is about to save
            assert ready[:1] == ["ready"] and int(ready[1]) == last, ready
            if attempt % 2:  # half the time, let it finish one save first so kills also hit pruning
                assert proc.stdout.readline().startswith("saved")
            time.sleep(rng.uniform(0.0, 0.6))  # the fault: a kill at a random moment of a save
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        r, skipped = _check_loaded(tmp_path)
        torn += skipped
        assert r >= last  # progress is never lost beyond what was being written
        last = r
    assert last > 0
    print(f"kills=10 last_round={last} kills_inside_a_write={torn}")
