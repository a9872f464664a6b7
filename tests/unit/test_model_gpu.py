"""GPU helpers of peer/train/model.py, checked on CPU: bf16 autocast only on CUDA, torch.compile only when asked and on
CUDA, and compiling keeps parameter names (checkpoints and export rely on them)."""
from __future__ import annotations

import contextlib
import warnings

import torch

from gasloc.peer.train.model import ModelConfig, autocast_for, build_model, maybe_compile


def test_autocast_is_bf16_on_cuda_and_off_on_cpu():
    assert isinstance(autocast_for("cpu"), contextlib.nullcontext)
    assert isinstance(autocast_for(torch.device("cpu")), contextlib.nullcontext)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": constructing is enough to check the settings
        ctx = autocast_for("cuda:0")
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
    assert autocast_for("cpu") is not autocast_for("cpu")  # fresh per call


def test_cpu_training_stays_fp32_under_autocast_for():
    model = build_model(ModelConfig(seq_len=16), 256)
    batch = torch.randint(0, 256, (2, 17))
    with autocast_for("cpu"):
        logits = model(batch[:, :-1])
    assert logits.dtype == torch.float32


def test_maybe_compile_is_a_no_op_unless_asked_and_on_cuda():
    model = build_model(ModelConfig(seq_len=16, compile=True), 256)
    names = list(model.state_dict())
    assert maybe_compile(model, model.cfg, "cpu") is model and model._compiled_call_impl is None
    plain = build_model(ModelConfig(seq_len=16), 256)
    assert maybe_compile(plain, plain.cfg, "cuda") is plain and plain._compiled_call_impl is None
    # on CUDA it compiles in place (lazily: nothing runs until the first forward), keeping every name
    assert maybe_compile(model, model.cfg, "cuda") is model and model._compiled_call_impl is not None
    assert list(model.state_dict()) == names
