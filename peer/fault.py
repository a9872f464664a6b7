"""TEST FAULT INJECTOR: makes a real `gasloc peer` a hostile volunteer on purpose, so the e2e tests can show what the
guard (protocol/guard.py) and crash recovery do against one (tests/e2e/test_untrusted.py). Driven by the `[fault]`
config section (peer/config.py FaultConfig), which no real peer sets. Kept out of the daemon so the training loop
reads the same with or without it: the daemon calls `after_step` and `wire` either way (a null object when off).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

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
    def __init__(self, cfg, params: Sequence[torch.Tensor]):
        self.cfg, self.params = cfg, list(params)
        self.nan_fired = False  # nan_at_round fires once per process, so the recovered peer trains on
        log.warning("fault injector on (a TEST setting: this peer is hostile on purpose): %s", cfg.model_dump())

    @torch.no_grad()
    def after_step(self, round_in_progress: int) -> None:
        """After each inner step: noise on every parameter; NaN parameters once, in round nan_at_round."""
        if self.cfg.noise_std > 0:
            for p in self.params:
                p.add_(torch.randn_like(p), alpha=self.cfg.noise_std)
        if self.cfg.oom_at_round == round_in_progress:
            # what torch raises when an allocation fails on the device (CUDA) mid-round
            raise torch.OutOfMemoryError(f"fault: simulated out of memory in round {round_in_progress}")
        if self.cfg.nan_at_round == round_in_progress and not self.nan_fired:
            self.nan_fired = True
            log.warning("fault: parameters set to NaN in round %d", round_in_progress)
            for p in self.params:
                p.fill_(float("nan"))

    def wire(self, sent: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the partner gets: our tensors scaled by send_scale (we mix with the true ones)."""
        return [t.detach().to("cpu") * self.cfg.send_scale for t in sent]


def make_fault(cfg, params: Sequence[torch.Tensor]) -> NoFault:
    return NoFault() if cfg is None else FaultInjector(cfg, params)


