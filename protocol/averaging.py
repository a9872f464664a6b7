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


def pair_weight(configured: float | None, codec_weight: float | None = None, partners: int = 1) -> float:
    """The weight of one edge of a mix: the configured one (outer.mix_weight), else the wire codec's (a noisy wire
    pulls by less, protocol/codec.py Codec.mix_weight), else the mean of a group of `partners` + 1 (for an edge, the
    larger of its two ends' partner counts: the Metropolis weight, 1/2 for a plain pair). The live peer and the
    simulator both ask this."""
    if configured is not None:
        return configured
    return codec_weight if codec_weight is not None else group_mean_weight(partners)


def round_mix_momentum(configured: float | None, codec_kappa: float | None = None, carry: bool = True) -> float:
    """kappa of one round's mix (GASLoC form C, docs/algorithms.md): 0 where the mix decision gives the correction
    no outer momentum (`carry` False: a partner we barely know, protocol/decision.py), else the configured one
    (outer.mix_momentum), else the exchange's codec's (protocol/codec.py exchange_mix_momentum), else 1, the form as
    published. The live peer and the simulator both ask this."""
    if not carry:
        return 0.0
    if configured is not None:
        return configured
    return codec_kappa if codec_kappa is not None else 1.0


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
def mix_pair_(theirs: list[torch.Tensor], own: Sequence[torch.Tensor], own_wire: Sequence[torch.Tensor] | None,
              weight: float) -> list[torch.Tensor]:
    """Symmetric mixing of one pair's wire forms, in place in `theirs` (returned):

        z_i = y_i + w (Q(y_j) - Q(y_i))      theirs = Q(y_j), own = y_i, own_wire = Q(y_i) (None: Q(y_i) = y_i)

    Both sides apply it with the same w, so z_i + z_j = y_i + y_j exactly (to float rounding) whatever the codecs
    do: mixing our exact y_i with the partner's rounded Q(y_j) instead would move the pair's mean by w (Q(y_j) - y_j)
    every exchange, a random step that form C's momentum carries on. `weight` is the mix weight times the guard's
    clip scale (a clipped partner pulls by less). No temporaries the size of a tensor list: `theirs` becomes z.
    """
    if len(theirs) != len(own):
        raise ValueError(f"partner sent {len(theirs)} tensors, expected {len(own)}")
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"mixing weight {weight} leaves no convex combination")
    if own_wire is None:   # lossless: z = y + w (x_j - y) = lerp(x_j, y, 1 - w)
        torch._foreach_lerp_(theirs, list(own), 1.0 - weight)
    else:
        torch._foreach_sub_(theirs, list(own_wire))
        torch._foreach_mul_(theirs, weight)
        torch._foreach_add_(theirs, list(own))
    return theirs


@torch.no_grad()
def exact_mean(groups: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The element-wise mean of several workers' tensor lists (DiLoCo's all-reduce result)."""
    n = len(groups)
    out = [t.detach().clone() for t in groups[0]]
    for other in groups[1:]:
        torch._foreach_add_(out, list(other))
    torch._foreach_div_(out, float(n))
    return out
