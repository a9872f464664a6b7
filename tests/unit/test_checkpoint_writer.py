"""Checkpoints written off the training thread (issue 31 item 3): what is written is the state at `stage` time even
when training changes the live tensors meanwhile, a non-finite state is refused on the writer thread and reported,
and `flush` waits for the write in flight."""
from __future__ import annotations

import threading

import pytest
import torch

from gasloc.peer.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointWriter,
    load_latest,
    read_checkpoint,
    stage,
)
from gasloc.peer.train.inner import InnerConfig, make_inner_optimizer
from gasloc.peer.train.model import ModelConfig, build_model
from gasloc.peer.train.outer import OuterConfig, make_outer


def state():
    model = build_model(ModelConfig(preset="micro", seq_len=16), 256)
    opt = make_inner_optimizer(model, InnerConfig())
    return model, opt, make_outer(OuterConfig(), list(model.parameters()))


def test_the_staged_copy_is_written_while_training_changes_the_model(tmp_path):
    model, opt, outer = state()
    before = [p.detach().clone() for p in model.parameters()]
    staged = stage(model=model, inner_opt=opt, outer=outer, data_state={}, round=4, meta={}, fingerprint="fp")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next round's training, before the writer has run
    got: list = []
    writer = CheckpointWriter()
    writer.submit(CheckpointConfig(dir=tmp_path), staged, lambda path, err: got.append((path, err,
                                                                                      threading.current_thread())))
    writer.close()
    (path, err, thread), = got
    assert err is None and thread is not threading.current_thread()
    _, tensors = read_checkpoint(path, "fp")
    names = [n for n, _ in model.named_parameters()]
    assert all(torch.equal(tensors[f"model.{n}"], b) for n, b in zip(names, before))
    fresh, fresh_opt, fresh_outer = state()
    loaded = load_latest(CheckpointConfig(dir=tmp_path), model=fresh, inner_opt=fresh_opt, outer=fresh_outer,
                         fingerprint="fp")
    assert loaded is not None and loaded.round == 4


def test_a_non_finite_state_is_refused_on_the_writer_thread_and_nothing_is_written(tmp_path):
    model, opt, outer = state()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    staged = stage(model=model, inner_opt=opt, outer=outer, data_state={}, round=1, meta={}, fingerprint="fp")
    got: list = []
    writer = CheckpointWriter()
    writer.submit(CheckpointConfig(dir=tmp_path), staged, lambda path, err: got.append((path, err)))
    writer.flush()
    assert got[0][0] is None and isinstance(got[0][1], CheckpointError)
    assert not list(tmp_path.glob("ckpt-*"))
    writer.close()


def test_stage_needs_a_fingerprint():
    model, opt, outer = state()
    with pytest.raises(ValueError, match="fingerprint"):
        stage(model=model, inner_opt=opt, outer=outer, data_state={}, round=1, meta={})
