"""Averaging rules: how a worker mixes its tensors with its partners'. Pure tensor math, no I/O.

    z_i = x_i - sum_j w (x_i - x_j)        over this round's partners j

With one partner and w = 1/2 this is the exact pairwise mean; with two partners and w = 1/3 the uniform mean of
three; with all K-1 others and w = 1/K the exact mean of everyone (the `complete` topology, i.e. DiLoCo's
all-reduce). Because w_ij = w_ji, every matching preserves the mean over workers.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def group_mean_weight(num_partners: int) -> float:
    """The weight that makes `mix` the uniform mean of a worker and its `num_partners` partners."""
    return 1.0 / (num_partners + 1)


@torch.no_grad()
def mix(own: Sequence[torch.Tensor], partners: Sequence[Sequence[torch.Tensor]], weight: float | None = None
        ) -> list[torch.Tensor]:
    """Return z = own - sum_j weight * (own - partner_j) as new tensors (inputs are not modified).

    `weight=None` means the uniform mean of the group. No partners: z is a copy of `own` (a solo round).
    """
    if weight is None:
        weight = group_mean_weight(len(partners))
    if len(partners) and not 0.0 < weight * len(partners) <= 1.0:
        raise ValueError(f"mixing weight {weight} with {len(partners)} partner(s) leaves no convex combination")
    out = [t.detach().clone() for t in own]
    for theirs in partners:
        if len(theirs) != len(own):
            raise ValueError(f"partner sent {len(theirs)} tensors, expected {len(own)}")
        # z += w * (x_j - x_i), accumulated against the unmodified own tensors
        torch._foreach_add_(out, torch._foreach_sub(list(theirs), list(own)), alpha=weight)
    return out


@torch.no_grad()
def exact_mean(groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The element-wise mean of several workers' tensor lists (DiLoCo's all-reduce result)."""
    n = len(groups)
    out = [t.detach().clone() for t in groups[0]]
    for other in groups[1:]:
        torch._foreach_add_(out, list(other))
    torch._foreach_div_(out, float(n))
    return out
