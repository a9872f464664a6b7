"""TEST FAULT INJECTOR: makes a real `gasloc peer` a hostile volunteer on purpose, so the e2e tests and
bench/adversary.py can show what the guard (protocol/guard.py) and crash recovery do against one
(tests/e2e/test_untrusted.py), and a model that forks from its DiLoCo group (tests/e2e/test_swarm_diloco.py).
Driven by the `[fault]` config section (peer/config.py FaultConfig), which no real
peer sets. Kept out of the daemon so the training loop reads the same with or without it: the daemon calls
`after_step` and `wire` either way (a null object when off).

The hostile modes assume the attacker has read the guard: the bias modes (`bias = "fixed" | "uphill"`) train and mix
honestly, but offer y + b instead of y, with ||b|| sized from what the attacker's OWN guard sees (its tau and its
partners' distances are what its victims see), so every offer stays under the victims' tau and is accepted as it
is. Modes that need their own protocol side (echo, lying donors, lying records, Sybils) live in
bench/adversary.py.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)


class NoFault:
    """An honest peer: nothing injected."""

    def after_step(self, round_in_progress: int) -> None:
        pass

    def wire(self, sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # as they are: the exchange's staging step (peer/transport/staging.py) copies them to the host as it encodes
        return list(sent)


class FaultInjector(NoFault):
    def __init__(self, cfg, params: Sequence[torch.Tensor],
                 seen: Callable[[], tuple[float, float | None]] | None = None,
                 anchor: Callable[[], Sequence[torch.Tensor]] = lambda: ()):
        self.cfg, self.params, self.anchor = cfg, list(params), anchor
        self.nan_fired = False  # nan_at_round fires once per process, so the recovered peer trains on
        self.fork_fired = False
        # what our own guard sees: (its tau, the median of our recent partner distances); the bias modes size from it
        self.seen = seen or (lambda: (0.0, None))
        self._uphill: list[torch.Tensor] | None = None  # the round's summed inner gradients (bias = "uphill")
        self._last_uphill: list[torch.Tensor] | None = None
        self._fixed: list[torch.Tensor] | None = None   # the fixed direction (bias = "fixed")
        self.offers = 0
        log.warning("fault injector on (a TEST setting: this peer is hostile on purpose): %s", cfg.model_dump())

    @torch.no_grad()
    def after_step(self, round_in_progress: int) -> None:
        """After each inner step: noise on every parameter; NaN parameters once, in round nan_at_round; the uphill
        bias sums the step's gradient (what the attacker's own data says is downhill, reversed when offered)."""
        if self.cfg.bias == "uphill":
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
            if self._uphill is None:
                self._uphill = [g.detach().clone() for g in grads]
            else:
                torch._foreach_add_(self._uphill, grads)
        if self.cfg.noise_std > 0:
            for p in self.params:
                p.add_(torch.randn_like(p), alpha=self.cfg.noise_std)
        if self.cfg.oom_at_round == round_in_progress:
            # what torch raises when an allocation fails on the device (CUDA) mid-round
            raise torch.OutOfMemoryError(f"fault: simulated out of memory in round {round_in_progress}")
        # at or after: a round skipped by a state download (a resync from round 2 to 5) still gets its fork
        if self.cfg.fork_at_round is not None and round_in_progress >= self.cfg.fork_at_round and not self.fork_fired:
            self.fork_fired = True
            log.warning("fault: the model and its anchor moved by %g x RMS in round %d (a fork)", self.cfg.fork_scale,
                        round_in_progress)
            gen = torch.Generator().manual_seed(round_in_progress)
            for p, a in zip(self.params, self.anchor() or [None] * len(self.params)):
                shift = (torch.randn(p.shape, generator=gen) * self.cfg.fork_scale).to(p.device, p.dtype)
                shift.mul_(p.float().pow(2).mean().sqrt().to(p.dtype))
                p.add_(shift)
                if a is not None:
                    a.add_(shift.to(a.device, a.dtype))
        if self.cfg.nan_at_round == round_in_progress and not self.nan_fired:
            self.nan_fired = True
            log.warning("fault: parameters set to NaN in round %d", round_in_progress)
            for p in self.params:
                p.fill_(float("nan"))

    def wire(self, sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the partner gets: our tensors scaled by send_scale, plus the bias (we mix with the true ones)."""
        return [t.detach().to("cpu") * self.cfg.send_scale for t in self.offered(sent)]

    @torch.no_grad()
    def offered(self, sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`sent` plus this round's bias b (new tensors; `sent` is what we mix with). Sized from what our own guard
        sees (tau, and m, the median of our recent partner distances): a victim measures about sqrt(m^2 + ||b||^2)
        to our offer, so ||b|| = sqrt((bias_share x tau)^2 - m^2) x ||y|| keeps it at bias_share x tau, under the
        victims' tau (theirs is ours, give or take). With bias_tensor set, all of ||b|| goes into that one tensor
        (one norm over all tensors cannot tell)."""
        if self.cfg.bias == "none":
            return list(sent)
        direction = self._direction()
        if direction is None or len(sent) != len(self.params):
            # NoLoCo sends two tensors per parameter; the first round has no gradient yet: an honest offer
            return list(sent)
        if self.cfg.bias_tensor is not None:
            k = self.cfg.bias_tensor
            direction = [d if i == k else torch.zeros_like(d) for i, d in enumerate(direction)]
        d_norm = math.sqrt(sum(float(torch.sum(d.float() ** 2)) for d in direction))
        y_norm = math.sqrt(sum(float(torch.sum(t.float() ** 2)) for t in sent))
        tau, median = self.seen()
        room = (self.cfg.bias_share * tau) ** 2 - (median or 0.0) ** 2
        if d_norm == 0 or not math.isfinite(d_norm) or not math.isfinite(room) or room <= 0:
            return list(sent)
        size = math.sqrt(room) * y_norm
        self.offers += 1
        log.info("fault: offer %d biased (%s%s) by %.4g x ||y|| (tau %.4g, median distance %s)", self.offers,
                 self.cfg.bias, "" if self.cfg.bias_tensor is None else f", tensor {self.cfg.bias_tensor} only",
                 size / y_norm, tau, "-" if median is None else f"{median:.4g}")
        return [t + (size / d_norm) * d.to(t.device, t.dtype) for t, d in zip(sent, direction)]

    def _direction(self) -> list[torch.Tensor] | None:
        if self.cfg.bias == "uphill":
            # one round's gradients per offer; a second offer in the same round (a search after a rejection) reuses them
            if self._uphill is not None:
                self._last_uphill, self._uphill = self._uphill, None
            return self._last_uphill
        if self._fixed is None:
            # from bias_seed alone: Sybils that share it push the same way
            gen = torch.Generator().manual_seed(self.cfg.bias_seed)
            self._fixed = [torch.randn(p.shape, generator=gen, dtype=torch.float32) for p in self.params]
        return self._fixed


def guard_seen(guard) -> tuple[float, float | None]:
    """(tau, median of the recent partner distances) of a peer's guard: a DistanceHistory (protocol/guard.py) or
    anything holding its distances in `votes` with tau() and median() (protocol/decision.py's MixJudge)."""
    book = getattr(guard, "votes", guard)
    median = getattr(book, "median", None)
    if callable(median):
        m = median()
    else:
        values = list(getattr(book, "values", ()))
        m = statistics.median(values) if values else None
    return float(book.tau()), m


def make_fault(cfg, params: Sequence[torch.Tensor],
               seen: Callable[[], tuple[float, float | None]] | None = None,
               anchor: Callable[[], Sequence[torch.Tensor]] = lambda: ()) -> NoFault:
    return NoFault() if cfg is None else FaultInjector(cfg, params, seen, anchor)
