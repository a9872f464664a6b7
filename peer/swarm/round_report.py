"""What a round's communication produced, in one shape for both swarm algorithms (GASLoC's pairwise exchange and
DiLoCo's all-reduce), so the training loop applies and records them the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gasloc.protocol.guard import relative_distance  # noqa: F401 - the metrics' consensus, re-exported


@dataclass
class RoundExchange:
    """outcome: ok | solo | busy | timeout | rejected | failed (the last attempt's when none succeeded).

    received: on ok, the partner's tensors (kind "pair": mix them with ours) or the group's exact mean (kind
    "mean": use as is). Never set unless the whole exchange completed and passed its checks, so a half-received
    state cannot be mixed in.
    """
    outcome: str = "solo"
    kind: Literal["pair", "mean"] = "pair"
    partner: str | None = None
    received: list[torch.Tensor] | None = None
    own_wire: list[torch.Tensor] | None = None  # pair: our tensors as the partner decoded them (None: lossless)
    mix_weight: float | None = None   # pair: the weight the exchange's codecs warrant (None: the pair's mean)
    mix_momentum: float | None = None   # pair: the kappa the exchange's codecs warrant (None: 1)
    group_size: int = 1
    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_s: float = 0.0      # the reported attempt (the successful one, else the last failed one)
    wait_s: float = 0.0          # looking for a partner: from ready until the reported attempt started
    attempts: int = 0
    passed_over: int = 0         # ready peers on much slower links not asked or answered busy (slower_link_ratio)
    detail: str = ""
    code: str | None = None      # the status code name of a rejected exchange
    overlapped: bool = False     # outer.overlap: it ran during the next round's inner steps (no transfer time)
    guard: dict | None = None    # the guard's verdict on the partner (peer/daemon.py _judge), for the metrics line
    path: str | None = None      # ok pair exchanges: "direct" or "forwarded:<forwarder>" (behind NAT)
    offer_round: int | None = None    # pair exchanges: our round and the partner's, as both offers said (exact,
    partner_round: int | None = None  # unlike the listing: the guard's catch-up rule compares them)
    rejected_partner: str | None = None  # guard.retry_after_reject: the partner rejected earlier in this round
    anchor_spread: float | None = None  # DiLoCo: the largest relative difference between our anchor and a
    # groupmate's at the all-reduce (a sample of the parameters; protocol/epochs.py): ~0 while the swarm is one model
    holders: tuple[str, ...] = ()  # DiLoCo, code FORKED: the groupmates that hold the group's model (donors first)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok" and self.received is not None

    @property
    def transfer_s(self) -> float:
        return self.exchange_s if self.ok and not self.overlapped else 0.0
