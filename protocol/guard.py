"""Robust mixing: how far a partner may pull us, decided before `mix`. Pure: no I/O, no clock (times are passed in).

One partner's tensors y_j arrive next to our own y. The guard measures the relative distance
    d = ||y_j - y|| / ||y||
and compares it with tau = clip_factor x median(our own recent accepted partner distances). The statistic is our
own history, never the current partner: with one partner per round the current distance alone tells nothing, and a
hostile partner cannot talk its own way in. Then:
    d <= tau                      accept: y_j is mixed in as it is (honest mixing is unchanged)
    tau < d <= reject_factor*tau  suspicious: the caller checks y_j on one local batch (`after_check`); if y_j is
                                  no worse than y there, it is clipped: y_j' = y + (tau/d)(y_j - y), else rejected
    d > reject_factor*tau          rejected (Code.DISTRUSTED): a solo round
So one bad partner moves us at most w*tau per round (self-centered clipping, He, Karimireddy & Jaggi 2022).

First rounds and fresh joiners: until `min_history` distances are known, tau is the fixed `first_rounds_tau`
(honest pairs of the tiny swarm measure ~0.07; a noisy volunteer 0.9-4, a peer sending 3y measures 2). Checking a
far partner on a local batch there instead of rejecting it let the noisy volunteer in (clipped) in round 3: on the
early loss plateau noise barely changes the loss. A resync clears the history (the peer's model changed under it).

Trust: every clip or rejection lowers the partner's trust score (multiplicatively); the lost part recovers with a
half-life. Partner choice weights candidates by trust, and a peer whose trust is below `busy_below` is neither
called nor accepted (answered BUSY) until it recovers: a repeat offender loses its mixing weight in the swarm.

Telling a returning honest peer from a hostile one (`catch_up_due`): tau follows our own partners' distances, which
shrink as honest peers converge, so a peer that comes back from an old checkpoint, or a pair that drifted apart in
a 2-peer swarm, is far from everyone and would be rejected for good (a rejection is a solo round, and solo rounds
drift further apart). The far peer is the one that must move: it downloads the swarm's state (a checked state, like
a joiner) when its partner is far and the listed peers are well ahead of it in rounds, or when its last rejections
name several different peers (it is the odd one out), or, with one other peer only, when that peer is ahead of us
in (round, peer id). A hostile peer that claims to be ahead costs us one checked download: the state is refused if
it is worse than our own model on a local batch.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gasloc.protocol.codes import Code

Action = Literal["accept", "check", "clip", "reject"]


class GuardConfig(BaseModel):
    """Robust mixing (protocol/guard.py): clip or reject a partner whose model is far from ours, and lower its
    trust."""
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="guard every mix (false: mix whatever passes the wire checks); a peer "
                          "far from its partners that fell behind catches up by downloading the swarm's state "
                          "(catch_up_after_rejections, swarm.resync_behind_rounds)")
    clip_factor: float = Field(2.0, gt=1, description="k: clip a partner's difference at tau = k x the median of "
                               "our recent partner distances ||y_j - y|| / ||y||")
    reject_factor: float = Field(4.0, gt=1, description="reject a partner farther than this many times tau")
    history: int = Field(16, ge=1, description="how many of our recent accepted partner distances tau is taken "
                         "from")
    min_history: int = Field(3, ge=1, description="until this many distances are known (first rounds, fresh "
                             "joiner, after a resync), tau is first_rounds_tau")
    first_rounds_tau: float = Field(0.2, gt=0, description="tau (a relative distance) before min_history "
                                    "distances are known")
    min_tau: float = Field(1e-3, gt=0, description="tau is never below this (peers that just started from the "
                           "same model are almost equal)")
    val_check: bool = Field(True, description="check a suspicious partner's model (farther than tau) on one local "
                            "validation batch before mixing; reject it if worse than ours by val_margin")
    val_margin: float = Field(0.1, ge=0, description="a suspicious partner's loss may exceed ours by this fraction")
    recheck_batches: int = Field(3, ge=0, description="before an offer is rejected on its loss, the check is "
                                 "repeated on this many further private batches and the mean over all of them "
                                 "decides (one batch of 4 x 64 tokens is noisy: it rejected an honest partner "
                                 "in a clean swarm at round 11); 0: one batch decides")
    clip_penalty: float = Field(0.3, ge=0, le=1, description="a clipped partner's trust is multiplied by 1 - this")
    reject_penalty: float = Field(0.6, ge=0, le=1, description="a rejected partner's trust is multiplied by 1 - "
                                  "this")
    trust_half_life_s: float = Field(120.0, gt=0, description="lost trust recovers with this half-life")
    busy_below: float = Field(0.5, ge=0, le=1, description="a peer whose trust is below this is not called and is "
                              "answered BUSY")
    retry_after_reject: bool = Field(True, description="after rejecting a partner, search again for another one "
                                     "within the same round (plain rounds) instead of a solo round")
    catch_up_after_rejections: int = Field(2, ge=0, description="after this many rounds in a row whose partner was "
                                           "rejected as far (DISTRUSTED), naming at least two different peers (or "
                                           "the only other peer, when it is ahead of us in round, then peer id), "
                                           "download the swarm's state: we are the odd one out; 0: never")
    # protocol/decision.py (issue 29: partners that know the guard)
    per_tensor: bool = Field(True, description="also bound each tensor's distance by its own tau_k (k x the median "
                             "of that tensor's votes), so one tensor cannot take the whole tau ||y|| budget")
    echo_below: float = Field(0.1, ge=0, lt=1, description="a partner closer than this times the median vote is "
                              "our own model sent back (echo): rejected, and no vote")
    sketch_size: int = Field(256, ge=16, le=65536, description="buckets of the seeded random sketch in which each "
                             "partner's accepted corrections are summed")
    drift_budget: float = Field(4.0, gt=0, description="a partner's accepted corrections may add up, along any "
                                "one direction, to this many times tau ||y|| (decayed by drift_half_life_rounds); "
                                "beyond it a correction is shortened or rejected")
    drift_half_life_rounds: float = Field(10.0, gt=0, description="the drift sum halves every this many of our "
                                          "own rounds")
    drift_min_keep: float = Field(0.1, ge=0, lt=1, description="a correction that the drift budget would shorten "
                                  "to this share or less is rejected instead")
    known_after: int = Field(3, ge=0, description="a partner's corrections get outer momentum only after this "
                             "many of them were mixed in (a stranger's is applied once)")
    round_gap_cap: int = Field(3, ge=0, description="a partner's offer this many rounds from ours, at most, "
                               "widens tau by that many rounds of our own movement and the batch check's margin "
                               "by val_margin a round (a slow link, an overlapped pair); a larger claimed gap "
                               "counts as this many")

    @model_validator(mode="after")
    def _order(self) -> GuardConfig:
        if self.min_history > self.history:
            raise ValueError(f"min_history {self.min_history} exceeds history {self.history}")
        return self


@dataclass(frozen=True)
class Verdict:
    """What to do with one partner's tensors. `scale`: the share of the difference kept (1: all; 0: rejected);
    `distance` and `tau` are relative to ||y||; `code` is set on a rejection."""
    action: Action
    distance: float
    tau: float
    scale: float = 1.0
    code: Code | None = None
    reason: str = ""
    by_check: bool = False    # rejected only by the batch check: near (within reject_factor x tau) and worse there

    @property
    def clipped(self) -> bool:
        return self.action == "clip"

    @property
    def rejected(self) -> bool:
        return self.action == "reject"


@dataclass
class DistanceHistory:
    """Our own recent partner distances (accepted ones, each capped at the tau it was judged by)."""
    cfg: GuardConfig
    values: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.values = deque(maxlen=self.cfg.history)

    def tau(self) -> float:
        c = self.cfg
        if len(self.values) < c.min_history:
            return c.first_rounds_tau
        return max(c.min_tau, c.clip_factor * statistics.median(self.values))

    def judge(self, distance: float) -> Verdict:
        """The verdict on a partner at `distance`, from the history only (the partner does not move tau)."""
        c, tau = self.cfg, self.tau()
        if not math.isfinite(distance):
            return Verdict("reject", distance, tau, 0.0, Code.NOT_FINITE, "distance is not finite")
        if distance <= tau:
            return Verdict("accept", distance, tau)
        if distance > c.reject_factor * tau:
            return Verdict("reject", distance, tau, 0.0, Code.DISTRUSTED,
                           f"distance {distance:.3g} > {c.reject_factor:g} x tau {tau:.3g}")
        if c.val_check:
            return Verdict("check", distance, tau, tau / distance)
        return Verdict("clip", distance, tau, tau / distance)

    def after_check(self, v: Verdict, own_loss: float, partner_loss: float) -> Verdict:
        """A "check" verdict settled by both models' loss on the same local batch."""
        if v.action != "check":
            return v
        bound = own_loss * (1 + self.cfg.val_margin)
        if not math.isfinite(partner_loss) or partner_loss > bound:
            return Verdict("reject", v.distance, v.tau, 0.0, Code.DISTRUSTED,
                           f"partner's loss {partner_loss:.4g} on a local batch > {bound:.4g}",
                           by_check=math.isfinite(partner_loss))
        return Verdict("clip", v.distance, v.tau, v.scale, reason="checked on a local batch")

    def record(self, v: Verdict) -> None:
        """Remember an accepted or clipped partner's distance, capped at its tau (so one far partner raises the
        statistic by at most the clip factor); a rejected one is not remembered."""
        if v.action in ("accept", "clip"):
            self.values.append(min(v.distance, v.tau))

    def clear(self) -> None:
        self.values.clear()


def swarm_ahead(own_round: int, rounds: Iterable[int], by: float) -> bool:
    """Whether the listed peers' median announced round is more than `by` rounds past ours (a resumed or returning
    peer that fell behind). The median, so one peer claiming round 1e9 does not make everyone download; by <= 0 or
    nobody listed: False."""
    rs = list(rounds)
    return by > 0 and bool(rs) and statistics.median(rs) > own_round + by


@dataclass
class FarStreak:
    """Our last rounds' far rejections in a row (partner id, its round at the exchange); any other verdict ends the
    streak. Only DISTRUSTED rejections count: a partner with NaN values is broken, not a sign that we drifted."""
    need: int
    partners: list[tuple[str, int]] = field(default_factory=list)

    def note(self, v: Verdict, partner: str | None, partner_round: int | None) -> None:
        if v.rejected and v.code is Code.DISTRUSTED and partner:
            self.partners.append((partner, -1 if partner_round is None else partner_round))
        else:
            self.partners.clear()

    def clear(self) -> None:
        self.partners.clear()


def catch_up_due(v: Verdict, *, own_round: int, own_id: str, partner_round: int | None,
                 listed_rounds: Iterable[int], streak: FarStreak, behind_rounds: float,
                 partner_better: bool = False) -> str | None:
    """After the guard's verdict on a partner (and `streak.note` of it): why we should download the swarm's state
    instead of mixing on ("behind", "odd one out"), or None.

    "behind": the partner is far (rejected, or checked and better than us on our batch by val_margin) and the listed
    peers' median round is more than `behind_rounds` past ours: we came back from an old state.
    A far partner that is merely clipped says nothing: a peer on a slow link is legitimately many rounds behind the
    fast ones and must keep mixing, not download. "odd one out": the streak's last `need` far rejections name two
    different peers; with one other peer listed, the one of the two behind in (round, peer id) moves."""
    far = v.rejected and v.code is Code.DISTRUSTED
    if not far and not (v.action == "clip" and partner_better):
        return None
    listed = list(listed_rounds)
    # the listed peers' median, not the far partner's own round: one peer claiming a high round must not make every
    # peer that rejects it download a state
    if swarm_ahead(own_round, listed, behind_rounds):
        return "behind"
    if not far or streak.need <= 0 or len(streak.partners) < streak.need:
        return None
    recent = streak.partners[-streak.need:]
    if len({p for p, _ in recent}) >= 2:
        return "odd one out"
    if len(listed) <= 1:
        p, r = recent[-1]
        if (r, p) > (own_round, own_id):
            return "odd one out"
    return None


@torch.no_grad()
def relative_distance(own: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> float:
    """||own - other|| / ||own|| over all tensors (the metrics' "consensus"); 0/0 reads as 0."""
    num = sum(float(torch.sum((a.float() - b.to(a.device).float()) ** 2)) for a, b in zip(own, other))
    den = sum(float(torch.sum(a.float() ** 2)) for a in own)
    return (num ** 0.5) / (den ** 0.5) if den > 0 else 0.0


@torch.no_grad()
def clip_toward(own: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """y + scale (y_j - y), as new tensors: the partner's tensors with their difference from ours shortened."""
    if scale >= 1.0:
        return [t for t in theirs]
    return [a + scale * (b - a) for a, b in zip(own, theirs)]


RECOVERED = 1 - 1e-3   # a trust score above this is full again: forgotten, and no longer asked last for a state


@dataclass
class TrustBook:
    """A decaying per-peer trust score in (0, 1]: 1 - trust halves every half_life_s; offenses multiply trust."""
    cfg: GuardConfig
    _lost: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (distrust at time t, t)

    def score(self, peer: str, now: float) -> float:
        got = self._lost.get(peer)
        if got is None:
            return 1.0
        lost, t = got
        return 1.0 - lost * 2.0 ** (-max(0.0, now - t) / self.cfg.trust_half_life_s)

    def penalize(self, peer: str, v: Verdict, now: float) -> float:
        """Lower a clipped or rejected partner's trust; returns its new score. Clips alone never take a peer below
        busy_below: a clipped partner passed the check on our batch (often an honest one a little far, early on), so
        it is picked less often but not shut out; only a rejection makes a peer BUSY. A rejection by the batch check
        alone (near, finite, worse on one batch) costs what a clip costs, without the floor: it makes a peer BUSY
        only when repeated faster than trust recovers (with the defaults two within 8 s, or three each at most ~70 s
        after the last: a partner that fails every time we meet it), never the first. Honest peers fail that check
        early in training, when one round moves the loss by more than val_margin and an overlapped search pairs
        offers a round apart (bench/utilization.py: 4 honest rejections in rounds 4-6 of 6 swarms); made BUSY at
        once, the rejected peer of a 3-peer swarm was turned away by one of the other two for about 30 s, and both
        waited out half of their rounds."""
        if v.action == "reject" and v.by_check:
            penalty = self.cfg.clip_penalty
        else:
            penalty = {"clip": self.cfg.clip_penalty, "reject": self.cfg.reject_penalty}.get(v.action, 0.0)
        trust = self.score(peer, now)
        if penalty:
            lowered = trust * (1.0 - penalty)
            trust = max(lowered, min(trust, self.cfg.busy_below)) if v.action == "clip" else lowered
            self._lost[peer] = (1.0 - trust, now)
        return trust

    def distrusted(self, peer: str, now: float) -> bool:
        return self.score(peer, now) < self.cfg.busy_below

    def lowered(self, now: float) -> dict[str, float]:
        """peer -> trust score of every peer whose trust a clip or rejection lowered and has not recovered (the donors
        a resync asks last: protocol/donors.py pick_donors)."""
        scores = {p: self.score(p, now) for p in self._lost}
        return {p: s for p, s in scores.items() if s <= RECOVERED}

    def weights(self, peers: Iterable[str], now: float) -> dict[str, float]:
        return {p: self.score(p, now) for p in peers}

    def forget_recovered(self, now: float) -> None:
        """Drop peers whose trust is back within 1e-3 of full, so the table does not grow with churn."""
        for p in list(self._lost):
            if self.score(p, now) > RECOVERED:
                self._lost.pop(p, None)
