"""DiLoCo's epoch rules, sans I/O: what a member of an all-reduce group checks before it applies the group's mean, and
when it has fallen behind its swarm. The live peer (peer/swarm/diloco.py) and the simulator (sim/groups.py) both
call these, so the simulator models the DiLoCo that runs.

An epoch is the number of outer steps a model has taken (the peer's round: a DiLoCo round that does not apply its
group's mean does not count). Groups are keyed by epoch, so honest members of one group share it; each member
also gathers a sample of its anchor (the parameters at the round's start) so the group sees whether it is one
model. Everything a groupmate gathered is a claim: a wrong type or size counts as a member that disagrees.

    judge_group(...)  ->  GroupVerdict: apply the mean (every member of our epoch and model), or refuse it (a
                          groupmate of another epoch or model), or we are the fork (our anchor is not the group's
                          model: download the state from a member that holds it)
    behind(...)       ->  whether the other peers' median claimed epoch is past ours (download the state)
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

# Anchor sample: about this many values, every s-th of each tensor (s the same for all). A fork moves every
# coordinate, so a sample's relative difference is the model's; 1024 values are 4 KB in the gathered metadata.
SAMPLE_VALUES = 1024


def sample_stride(numels: Sequence[int], values: int = SAMPLE_VALUES) -> int:
    return max(1, sum(numels) // values)


def sample_size(numels: Sequence[int], stride: int) -> int:
    return sum(math.ceil(n / stride) for n in numels)


@torch.no_grad()
def anchor_sample(tensors: Sequence[torch.Tensor], stride: int) -> torch.Tensor:
    """Every `stride`-th value of each tensor (from its first), concatenated, fp32 on the CPU."""
    return torch.cat([t.detach().reshape(-1)[::stride].to("cpu", torch.float32) for t in tensors])


def relative_difference(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """||theirs - mine|| / ||mine|| (mine all zeros: the plain norm)."""
    return float(torch.linalg.vector_norm(theirs - mine) / torch.linalg.vector_norm(mine).clamp_min(1e-30))


@dataclass(frozen=True)
class GroupVerdict:
    apply: bool          # use the group's mean for our outer step
    code: str | None     # why not: OTHER_EPOCH (a groupmate claims another epoch) | FORKED (we are the odd one out)
    #                      | OTHER_MODEL (a groupmate is)
    spread: float | None  # the largest relative difference between our anchor sample and a valid groupmate's
    agree: int           # members (us included) whose anchors agree with ours within the tolerance
    size: int
    detail: str = ""
    holders: tuple[str, ...] = ()  # the members holding the group's model (a fork's donors)


def parse_claim(claim: object, size: int) -> tuple[int, torch.Tensor] | None:
    """A groupmate's gathered {"round": int, "anchor": bytes of `size` fp32 values}; None when it is anything else
    or not finite."""
    if not isinstance(claim, Mapping):
        return None
    r, raw = claim.get("round"), claim.get("anchor")
    if not isinstance(r, int) or isinstance(r, bool) or not isinstance(raw, bytes) or len(raw) != 4 * size:
        return None
    sample = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    return (r, sample) if bool(torch.isfinite(sample).all()) else None


def judge_group(own_id: str, epoch: int, own_sample: torch.Tensor, gathered: Mapping[str, object],
                tolerance: float) -> GroupVerdict:
    """What we do with a finished all-reduce whose members gathered `gathered` ({peer id: claim}, ours included).

    - Every member must claim our epoch (the group key carries it, so only a liar or a bug differs): else the mean
      mixes pseudo-gradients of other anchors; refused (OTHER_EPOCH) by every honest member alike.
    - The group's model is the anchor of the member that agrees (relative difference <= tolerance) with the most
      members, the lowest peer id among equals. The mean is used only when every member holds it: a member whose
      anchor is another (a fork, or an unreadable claim) gets a mean of pseudo-gradients of two models, and a mean
      applied to two anchors keeps them apart for good. So every member refuses: we are the fork (FORKED: the
      caller downloads the state, from the members holding the group's model, `holders`), or a groupmate is
      (OTHER_MODEL: the fork downloads while we try the epoch again). Ties and groups where no two members agree
      go to the lowest peer id, so one lineage survives. (Until 2026-12-05 a majority stepped with a fork among
      it, and in a tie nobody was the fork, so both halves stepped: CI saw an all-reduce applied across anchors
      4.9 % apart.) A lossy wire leaves anchors apart by its rounding: its tolerance sits above that
      (peer/swarm/diloco.py TOLERANCE).
    An unreadable claim is a member that agrees with nobody. Every member computes the same verdicts from the same
    gathered claims (ours is in them).
    """
    n = len(gathered)
    claims = {pid: parse_claim(c, own_sample.numel()) for pid, c in gathered.items()}
    claims[own_id] = (epoch, own_sample)
    bad_epoch = [pid for pid, c in claims.items() if c is not None and c[0] != epoch]
    samples = {pid: c[1] for pid, c in claims.items() if c is not None}
    spreads = {pid: relative_difference(own_sample, x) for pid, x in samples.items() if pid != own_id}
    spread = max(spreads.values()) if spreads else None
    agree = {pid: {q for q, y in samples.items() if relative_difference(x, y) <= tolerance}
             for pid, x in samples.items()}
    mine = len(agree[own_id])
    if bad_epoch:
        return GroupVerdict(False, "OTHER_EPOCH", spread, mine, n,
                            f"{len(bad_epoch)} of {n} claim another epoch than {epoch}")
    best = min(agree, key=lambda pid: (-len(agree[pid]), pid))
    holders = tuple(sorted(agree[best]))
    if own_id not in agree[best]:
        return GroupVerdict(False, "FORKED", spread, mine, n,
                            f"our anchor agrees with {mine} of {n} members, the group's model with {len(holders)} "
                            f"(largest relative difference {spread if spread is not None else float('nan'):.3g}, "
                            f"tolerance {tolerance:g}; {n - len(samples)} unreadable): the group's model is another",
                            holders)
    if len(holders) < n:
        return GroupVerdict(False, "OTHER_MODEL", spread, mine, n,
                            f"{n - len(holders)} of {n} members hold another model or an unreadable claim (largest "
                            f"relative difference {spread if spread is not None else float('nan'):.3g}, tolerance "
                            f"{tolerance:g}): no step; the fork downloads the group's model", holders)
    return GroupVerdict(True, None, spread, mine, n, holders=holders)


def behind(epoch: int, claimed: Iterable[int]) -> bool:
    """The other training peers' median claimed epoch is past ours: they stepped without us (we missed a group).
    The median, so a minority of liars cannot make us download; nobody listed: False."""
    rs = list(claimed)
    return bool(rs) and statistics.median(rs) > epoch
