"""The inner loop: AdamW steps on local data, no communication. Shared by `gasloc peer` and `gasloc sim`."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

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


def make_inner_optimizer(model: torch.nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             weight_decay=cfg.weight_decay, foreach=True)


def lr_at(step: int, cfg: InnerConfig) -> float:
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def inner_step(model: LlamaLM, opt: torch.optim.Optimizer, batch: torch.Tensor, step: int, cfg: InnerConfig,
               autocast: contextlib.AbstractContextManager | None = None) -> float:
    """One AdamW step on one batch; returns the training loss. `step` is the worker's total inner-step count."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    with autocast or contextlib.nullcontext():
        loss = model.loss(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(f"training loss became {value} at inner step {step}: lower inner.lr")
    return value


def steps_this_round(cfg: InnerConfig, seconds_per_step: float) -> int:
    """H_i: fixed H, or as many steps as fit the time budget at this worker's speed (never fewer than H)."""
    if cfg.time_budget_s is None:
        return cfg.inner_steps
    return max(cfg.inner_steps, int(cfg.time_budget_s / max(seconds_per_step, 1e-9)))


def run_inner_phase(model: LlamaLM, opt: torch.optim.Optimizer, next_batch: Callable[[], torch.Tensor],
                    start_step: int, cfg: InnerConfig, device: torch.device | str = "cpu",
                    autocast: contextlib.AbstractContextManager | None = None,
                    should_stop: Callable[[], bool] = lambda: False,
                    after_step: Callable[[], None] = lambda: None) -> tuple[int, float]:
    """One round's local phase in real time (the live peer): H steps, or until the time budget is spent.

    Returns (steps done, mean training loss). `should_stop` lets a shutdown request end the phase early;
    `after_step` runs between steps (overlap: adds a mix that has just arrived).
    """
    t0, losses = time.monotonic(), []
    while not should_stop():
        done = len(losses)
        if done >= cfg.inner_steps and (cfg.time_budget_s is None or time.monotonic() - t0 >= cfg.time_budget_s):
            break
        batch = next_batch().to(device, non_blocking=True)
        losses.append(inner_step(model, opt, batch, start_step + done, cfg, autocast))
        after_step()
    return len(losses), (sum(losses) / len(losses) if losses else float("nan"))
