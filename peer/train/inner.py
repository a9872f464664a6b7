"""The inner loop: AdamW steps on local data, no communication. Shared by `gasloc peer` and `gasloc sim`."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gasloc.peer.train.model import LlamaLM


class InnerConfig(BaseModel):
    """The inner optimizer (AdamW) and how long a round's local phase lasts."""
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    warmup_steps: int = Field(50, ge=0, description="linear warm-up of the inner lr, in inner steps")
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; unset: no clipping")
    inner_steps: int = Field(20, ge=1, description="H: inner steps per round (the minimum when time-budgeted)")
    time_budget_s: float | None = Field(None, gt=0, description="if set, a round's local phase runs until this "
                                        "many seconds have passed (at least inner_steps steps): fast workers do "
                                        "more steps, nobody waits")
    # the lr decay, as torchtitan's and nanoGPT's schedules: off unless the run's length is given
    total_steps: int | None = Field(None, ge=1, description="the run's length in inner steps, for the lr decay (a "
                                    "live peer counts the swarm's position, round x inner_steps, which a joiner "
                                    "takes over with the round); unset: no decay, the lr stays at its peak after "
                                    "warm-up")
    decay_ratio: float = Field(1.0, gt=0, le=1, description="the lr decays over the last decay_ratio of "
                               "total_steps: 1 from the end of warm-up on (a cosine schedule), 0.2 holds the peak "
                               "and decays over the last 20% (warm-up, stable, decay)")
    decay_type: Literal["cosine", "linear"] = Field("cosine", description="the decay's shape")
    min_lr_factor: float = Field(0.1, ge=0, le=1, description="the lr at the end of the decay, as a share of lr; "
                                 "it stays there past total_steps")

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> InnerConfig:
        if self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise ValueError(f"inner.total_steps ({self.total_steps}) must be larger than inner.warmup_steps "
                             f"({self.warmup_steps}): the decay starts after the warm-up")
        return self


def make_inner_optimizer(model: torch.nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    """AdamW for the model's device. CUDA: the fused kernel (no temporaries, one launch). CPU: the per-tensor loop,
    whose values equal the foreach version's bit for bit on the CPU, while foreach allocates model-sized
    temporaries (its sqrt of the second moment: one parameter copy more at the inner step's peak)."""
    cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay, **({"fused": True} if cuda else {"foreach": False}))


def lr_at(step: int, cfg: InnerConfig, position: int | None = None) -> float:
    """The inner lr of a worker's `step` (its own count of inner steps: the warm-up follows it, since a fresh
    AdamW state needs one) at `position` in the run (what the decay follows; default `step`). A live peer's
    position is the swarm's, round x inner_steps: a joiner starts its own count at 0 and warms up, but decays with
    the peers whose round it took over."""
    lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
    return lr * decay_factor(step if position is None else position, cfg)


def decay_factor(position: int, cfg: InnerConfig) -> float:
    """The share of the peak lr that the decay leaves at `position`: 1 until the decay starts (the end of the
    warm-up, or total_steps x (1 - decay_ratio) when later), then down to min_lr_factor at total_steps, and there
    after it."""
    if cfg.total_steps is None:
        return 1.0
    start = max(cfg.warmup_steps, cfg.total_steps * (1 - cfg.decay_ratio))
    if position <= start:
        return 1.0
    p = min(1.0, (position - start) / (cfg.total_steps - start))
    shape = 0.5 * (1 + math.cos(math.pi * p)) if cfg.decay_type == "cosine" else 1 - p
    return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * shape


def inner_step(model: LlamaLM, opt: torch.optim.Optimizer, batch: torch.Tensor, step: int, cfg: InnerConfig,
               autocast: contextlib.AbstractContextManager | None = None, position: int | None = None) -> float:
    """One AdamW step on one batch; returns the training loss. `step` is the worker's total inner-step count,
    `position` where the run is (lr_at). Reads the loss back to the host: the simulator's step; the live peer's
    phase uses `inner_step_on_device` and reads every few steps."""
    value = float(inner_step_on_device(model, opt, batch, step, cfg, autocast, position))
    if not math.isfinite(value):
        raise FloatingPointError(f"training loss became {value} at inner step {step}: lower inner.lr")
    return value


def inner_step_on_device(model: LlamaLM, opt: torch.optim.Optimizer, batch: torch.Tensor, step: int,
                         cfg: InnerConfig, autocast: contextlib.AbstractContextManager | None = None,
                         position: int | None = None) -> torch.Tensor:
    """One AdamW step; the loss as a detached 0-d tensor on the model's device (no host sync).

    The previous step's gradients are freed before the forward pass, not after it: activations and a stale
    gradient copy never coexist. They stay set after the step (a fault injector's after_step may read them);
    `run_inner_phase` frees them when the phase ends, so they do not outlive it into the outer step."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg, position)
    opt.zero_grad(set_to_none=True)
    with autocast or contextlib.nullcontext():
        loss = model.loss(batch)
    loss.backward()
    if cfg.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss.detach()


def steps_this_round(cfg: InnerConfig, seconds_per_step: float) -> int:
    """H_i: fixed H, or as many steps as fit the time budget at this worker's speed (never fewer than H)."""
    if cfg.time_budget_s is None:
        return cfg.inner_steps
    return max(cfg.inner_steps, int(cfg.time_budget_s / max(seconds_per_step, 1e-9)))


# The live peer reads the summed loss back to the host every this many inner steps (and at the phase's end): one
# device sync per LOSS_READ_EVERY steps instead of one per step. A non-finite loss is then seen up to that many
# steps late; the round is discarded either way (the peer goes back to its last checkpoint: daemon._recover).
LOSS_READ_EVERY = 8


def run_inner_phase(model: LlamaLM, opt: torch.optim.Optimizer, next_batch: Callable[[], torch.Tensor],
                    start_step: int, cfg: InnerConfig, device: torch.device | str = "cpu",
                    autocast: contextlib.AbstractContextManager | None = None,
                    should_stop: Callable[[], bool] = lambda: False,
                    after_step: Callable[[], None] = lambda: None,
                    start_position: int | None = None) -> tuple[int, float]:
    """One round's local phase in real time (the live peer): H steps, or until the time budget is spent.

    Returns (steps done, mean training loss). `should_stop` lets a shutdown request end the phase early;
    `after_step` runs between steps (overlap: adds a mix that has just arrived). `start_position`: where the run
    is at the phase's first step, for the lr decay (lr_at; default start_step). The losses are summed on the
    device and read every LOSS_READ_EVERY steps; the gradients are freed when the phase ends (the outer step
    does not need them: one parameter-sized copy less at the round's peak).
    """
    t0, done, read = time.monotonic(), 0, 0
    total: torch.Tensor | None = None
    try:
        while not should_stop():
            if done >= cfg.inner_steps and (cfg.time_budget_s is None or time.monotonic() - t0 >= cfg.time_budget_s):
                break
            batch = next_batch().to(device, non_blocking=True)
            pos = None if start_position is None else start_position + done
            loss = inner_step_on_device(model, opt, batch, start_step + done, cfg, autocast, pos)
            total = loss.float() if total is None else total + loss
            done += 1
            if done - read >= LOSS_READ_EVERY:
                _check_finite(total, start_step + read, start_step + done - 1)
                read = done
            after_step()
    finally:
        opt.zero_grad(set_to_none=True)
    if total is None:
        return 0, float("nan")
    mean = float(total) / done
    if read < done:
        _check_finite(total, start_step + read, start_step + done - 1)
    return done, mean


def _check_finite(total: torch.Tensor, first: int, last: int) -> None:
    value = float(total)
    if not math.isfinite(value):
        where = f"inner step {last}" if first == last else f"inner steps {first}-{last}"
        raise FloatingPointError(f"training loss became {value} in {where}: lower inner.lr")
