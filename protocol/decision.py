"""The mix decision: what to do with one partner's tensors, read in one place. Pure: no I/O, no clock, no threads;
rounds are the caller's counts, the loss is a callable the caller hands in (the live peer and the simulator drive
the same object).

    judge = MixJudge(cfg.guard, seed)                        # one per peer; its state is ours alone
    d = judge.decide(own, theirs, partner=..., own_round=..., partner_round=..., loss=...)
    mixed_in = d.apply(own, theirs)                          # y + scale_k (y_j - y)_k per tensor; d.rejected: skip
    trust.penalize(partner, d.verdict, now)                  # the trust change (protocol/guard.py TrustBook)
    outer.apply(..., carry=d.momentum)                       # no outer momentum on a stranger's correction
    if d.catch_up: download the swarm's state (reason d.catch_up)

What it answers (docs/robust-mixing.md has the threat model; each rule names the attack it is for):

1. Distances per tensor, not one norm. In `tiny` 81% of ||y||^2 is RMSNorm gains (all ones), so one budget
   tau ||y|| over all tensors is about the norm of the whole embedding matrix and all of it can go into one tensor.
   Each tensor k has its own tau_k = clip_factor x median of its own votes; the ratio that decides is the largest
   of d / tau and every d_k / tau_k, and each tensor's difference is clipped to its own tau_k.
2. A distance statistic one partner cannot capture (echo, eclipse, ratchet). tau comes from `VoteBook`: one vote
   per peer (its latest distance), the median over the last `history` distinct peers. A near-zero distance (an echo
   of our own payload) is no vote and is rejected (code DISTRUSTED, "echo"); a rejected far partner votes tau
   (capped), so after an eclipse that shrank tau the honest partners it rejects vote it back up; every vote is
   capped at the tau it was judged by, and a partner that always offers 0.99 tau holds one vote, not the history.
3. Accepted is not unchecked. With a loss callable (a batch only this peer knows: data.private_batches), every
   offer's clipped point is evaluated next to ours, not only the suspicious ones.
4. A budget per partner across rounds. Each partner's accepted corrections are summed in a seeded random sketch
   (a CountSketch of `sketch_size` buckets: linear, so the sketch of the sum is the sum of the sketches, and
   ||S c|| estimates ||c||). Corrections that point the same way add up linearly; honest ones, whose directions
   vary from round to round, add up like a random walk. When the sum (decayed with a half-life in our own rounds)
   would pass drift_budget x tau ||y||, the correction is shortened to what is left of the budget, or rejected.
5. No outer momentum on a correction from a partner we barely know (fewer than `known_after` accepted mixes):
   form C carries a correction about 1 / (1 - gamma) times its size; `momentum` False tells the caller to apply it
   once.
6. Honest peers that are a few rounds apart (a slow link, an overlapped search pairing offers a round apart): our
   own per-round movement (measured from the sketches of our own offers) times the round gap (capped at
   `round_gap_cap`) widens tau, and the batch check's margin widens by val_margin per round of gap. A partner
   that claims a gap to widen its budget gets at most `round_gap_cap` rounds of our own movement, and its
   corrections still count against its drift budget.
"""
from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from gasloc.protocol.codes import Code
from gasloc.protocol.guard import FarStreak, GuardConfig, Verdict, catch_up_due

Loss = Callable[[Sequence[torch.Tensor]], float]
Action = Literal["mix", "clip", "reject"]

_ABS_ECHO = 1e-6  # a relative distance below this is our own payload back, whatever the history says
_MAX_PROGRESS = 0.5  # the batch check's allowance for our own progress per round is at most this (relative loss)


@dataclass(frozen=True)
class Decision:
    """What to do with one partner's tensors, and what follows from it.

    `scales`: per tensor, the share of the partner's difference kept (1: all; all 0 on a rejection). `distance`
    and `tau` are relative to ||y|| (tau widened by the round gap); `ratio` is the largest of d / tau and
    d_k / tau_k. `far`: rejected by distance (counts toward "odd one out" and "behind"). `momentum`: whether the
    outer update may carry this correction on (a partner we barely know: no). `catch_up`: why we should download
    the swarm's state instead ("behind", "odd one out"), or None."""
    action: Action
    scales: tuple[float, ...]
    distance: float
    tau: float
    ratio: float = 0.0
    code: Code | None = None
    reason: str = ""
    far: bool = False
    momentum: bool = True
    catch_up: str | None = None
    own_loss: float | None = None
    partner_loss: float | None = None
    partner_better: bool = False

    @property
    def rejected(self) -> bool:
        return self.action == "reject"

    @property
    def clipped(self) -> bool:
        return self.action == "clip"

    @property
    def scale(self) -> float:
        """The smallest share kept of any tensor (the metrics' clipped_by is 1 - this)."""
        return min(self.scales) if self.scales else (0.0 if self.rejected else 1.0)

    @property
    def verdict(self) -> Verdict:
        """The trust change, as protocol/guard.py TrustBook.penalize reads it: a clip costs clip_penalty (never
        below busy_below); a far or broken partner's rejection costs reject_penalty (BUSY at once); a rejection by
        the batch check, the drift budget or as an echo costs clip_penalty without the floor (BUSY only when
        repeated faster than trust recovers: honest peers fail a batch check now and then)."""
        action = {"mix": "accept", "clip": "clip", "reject": "reject"}[self.action]
        return Verdict(action, self.distance, self.tau, self.scale, self.code, self.reason,
                       by_check=self.rejected and not self.far and self.code is not Code.NOT_FINITE)

    @torch.no_grad()
    def apply(self, own: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The partner's tensors with each difference from ours shortened by its scale (theirs as they are where
        the scale is 1). Not for a rejection."""
        if self.rejected:
            raise ValueError("a rejected partner's tensors are not mixed")
        return [b if s >= 1.0 else a + s * (b.to(a.device) - a) for a, b, s in zip(own, theirs, self.scales)]


class CountSketch:
    """A seeded sparse random projection of a list of tensors to `size` numbers (CountSketch): coordinate i of
    tensor k goes to bucket h(k, i) with sign s(k, i). Linear, and E||S x||^2 = ||x||^2; its relative error on one
    norm is about sqrt(2 / size). The hashes are drawn again at each call from (seed, k), so it costs no memory
    per parameter; the seed is the peer's own, so a partner cannot aim a correction at the sketch's blind spots."""

    CHUNK = 1 << 22

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    @torch.no_grad()
    def __call__(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """The sketch of the list (one vector of `size`): the sum of the per-tensor sketches."""
        return self.per_tensor(tensors).sum(0)

    @torch.no_grad()
    def per_tensor(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """One sketch per tensor, [len(tensors), size] (float64, on the CPU)."""
        rows = []
        for k, t in enumerate(tensors):
            flat = t.detach().reshape(-1)
            gen = torch.Generator(device=flat.device).manual_seed((self.seed * 1_000_003 + k) % (2 ** 63))
            acc = torch.zeros(self.size, dtype=torch.float32, device=flat.device)
            for lo in range(0, flat.numel(), self.CHUNK):
                x = flat[lo:lo + self.CHUNK].float()
                r = torch.randint(0, 2 * self.size, (x.numel(),), generator=gen, device=flat.device)
                acc.index_add_(0, r >> 1, x * (1 - 2 * (r & 1)).float())
            rows.append(acc.double().cpu())
        return torch.stack(rows) if rows else torch.zeros(0, self.size, dtype=torch.float64)


@dataclass
class VoteBook:
    """Our partners' distances, one vote per peer: its latest (global, per-tensor) distance, capped at the tau it
    was judged by; the last `history` distinct peers vote. tau is clip_factor x the median of the votes once
    `min_history` peers voted, else first_rounds_tau (and no per-tensor bound yet)."""
    cfg: GuardConfig
    votes: OrderedDict[str, tuple[float, tuple[float, ...]]] = field(default_factory=OrderedDict)

    def vote(self, peer: str, distance: float, per_tensor: Sequence[float]) -> None:
        self.votes.pop(peer, None)
        self.votes[peer] = (distance, tuple(per_tensor))
        while len(self.votes) > self.cfg.history:
            self.votes.popitem(last=False)

    def ready(self) -> bool:
        return len(self.votes) >= self.cfg.min_history

    def median(self) -> float | None:
        return statistics.median(d for d, _ in self.votes.values()) if self.ready() else None

    def tau(self, own_round: int | None = None) -> float:
        """k x the median vote. Before min_history peers voted: first_rounds_tau in our first 2 x min_history rounds
        (honest distances grow 3-4x a round early on: a tau from older votes clipped honest partners in rounds 2-4
        of the simulator's clean runs), then k x the largest vote so far, at most first_rounds_tau (a peer that
        met few partners is not left with the loose first-rounds guess; a low vote cannot shrink it below the
        others' distances, a high one cannot raise it past the guess)."""
        c, m = self.cfg, self.median()
        if m is not None:
            return max(c.min_tau, c.clip_factor * m)
        if not self.votes or own_round is None or own_round < 2 * c.min_history:
            return c.first_rounds_tau
        return min(c.first_rounds_tau, max(c.min_tau, c.clip_factor * max(d for d, _ in self.votes.values())))

    def taus(self, n: int) -> list[float] | None:
        """Per-tensor tau_k (None before min_history votes, or when the tensor count changed)."""
        vs = [k for _, k in self.votes.values() if len(k) == n]
        if len(vs) < self.cfg.min_history:
            return None
        return [max(self.cfg.min_tau, self.cfg.clip_factor * statistics.median(col)) for col in zip(*vs)]

    def clear(self) -> None:
        self.votes.clear()


@dataclass
class Drift:
    """One partner's accepted corrections, summed in the sketch (relative to ||y||), decayed with a half-life in
    our own rounds; and how many of its corrections we mixed (how well we know it)."""
    sketch: torch.Tensor
    round: int
    accepted: int = 0


class MixJudge:
    """One peer's mix decisions (see the module docstring). State: the vote book, each partner's drift sketch, our
    own last offer's sketch (our per-round movement), the far-rejection streak. `clear()` after our model was
    replaced (a resync): distances measured from the old model say nothing; the drift sketches stay (they are
    about the partners' pull, and a partner must not earn a fresh budget by making us resync)."""

    def __init__(self, cfg: GuardConfig, seed: int):
        self.cfg = cfg
        self.votes = VoteBook(cfg)
        self.sketch = CountSketch(cfg.sketch_size, seed)
        self.drift: dict[str, Drift] = {}
        self.streak = FarStreak(cfg.catch_up_after_rejections)
        self._own: tuple[int, torch.Tensor, float] | None = None  # our last offer: (round, its sketch, ||y||)
        self._moved: torch.Tensor | None = None  # our own movement per round before it (per-tensor sketch)
        self._losses: list[tuple[int, float]] = []  # our own loss on a private batch at our last measured round
        self._drops: list[float] = []               # our recent relative loss drops per round

    # ------------------------------------------------------------------ the decision
    @torch.no_grad()
    def decide(self, own: Sequence[torch.Tensor], theirs: Sequence[torch.Tensor], *, partner: str,
               own_round: int, partner_round: int | None = None, loss: Loss | None = None,
               recheck: Loss | None = None, listed_rounds: Iterable[int] = (), own_id: str = "",
               behind_rounds: float = 0) -> Decision:
        """The decision on `theirs` (the partner's tensors as decoded) against `own` (ours as we sent them).
        `loss(point)`: the loss of a model with these tensors on one batch only we know (the same batch for every
        call within one decision), or None when the tensors are no model (NoLoCo): then no batch check.
        `recheck(point)`: the mean loss on guard.recheck_batches further private batches (the same ones for every
        call), asked only when the first batch would reject: the mean over all of them decides.
        `partner_round`: the round its offer claims (a claim: it only widens tau by at most round_gap_cap rounds
        of our own movement). `listed_rounds`, `own_id`, `behind_rounds`: for the catch-up rule
        (protocol/guard.py catch_up_due)."""
        c = self.cfg
        n = len(own)
        own_sq = [float(torch.sum(a.float() ** 2)) for a in own]
        diff_sq = [float(torch.sum((b.to(a.device).float() - a.float()) ** 2)) for a, b in zip(own, theirs)]
        norm = math.sqrt(sum(own_sq))
        if not all(math.isfinite(x) for x in diff_sq):
            return self._finish(self._reject(Code.NOT_FINITE, "partner's tensors are not finite", math.inf,
                                             self.votes.tau(own_round), far=False), partner, own_round, partner_round,
                                listed_rounds, own_id, behind_rounds, None)
        d = math.sqrt(sum(diff_sq)) / norm if norm > 0 else 0.0
        dk = [math.sqrt(x) / math.sqrt(s) if s > 0 else 0.0 for x, s in zip(diff_sq, own_sq)]
        own_sketch = self._note_own(own, own_round)
        # S(theirs - own) per tensor, from the two sketches (linear): no model-sized difference is ever built
        diff_sketch = self.sketch.per_tensor(theirs) - own_sketch
        moved = self._moved  # our own movement per round up to this offer (raw per-tensor sketch)

        # A partner a few rounds apart (a slow link, an overlapped pair) is displaced along our own path: judge its
        # distance from where we were (or will be) at its round, extrapolated along our own last movement, instead
        # of from where we are. Both in the sketch: ||S(theirs) - S(p)|| estimates the (small) distance to that
        # point directly. tau (and each tau_k) widens by d / d_there, at most 1 + gap x our step / tau: a partner
        # claiming a gap gains at most gap rounds of our own movement.
        gap = min(abs(own_round - partner_round), c.round_gap_cap) if partner_round is not None else 0
        base_tau, base_taus = self.votes.tau(own_round), self.votes.taus(n)
        widen, widen_k = 1.0, [1.0] * n
        if gap and moved is not None and norm > 0 and len(moved) == n:
            sign = 1.0 if partner_round > own_round else -1.0
            there = diff_sketch - sign * gap * moved  # S(theirs - p), per tensor
            rel = [math.sqrt(x) for x in own_sq]
            widen = _widen(d, float(there.sum(0).norm()) / norm, gap * float(moved.sum(0).norm()) / norm, base_tau)
            if base_taus is not None:
                widen_k = [_widen(x, float(there[k].norm()) / r, gap * float(moved[k].norm()) / r, t) if r > 0 else 1.0
                           for k, (x, r, t) in enumerate(zip(dk, rel, base_taus))]
        tau = base_tau * widen
        taus = [t * w for t, w in zip(base_taus, widen_k)] if base_taus is not None and c.per_tensor else None

        median = self.votes.median()
        if d < _ABS_ECHO or (median is not None and d < c.echo_below * median):
            v = self._reject(Code.DISTRUSTED, f"echo: distance {d:.3g} is our own model back (below "
                             f"{c.echo_below:g} x the median {median or 0:.3g})", d, tau, far=False)
            return self._finish(v, partner, own_round, partner_round, listed_rounds, own_id, behind_rounds, None)

        # One tensor's distance is noisier than the whole's: in honest simulator swarms some tensor was above its
        # tau_k in ~18% of decisions (at most 3 x), the whole above tau in ~1%. So a tensor is clipped to its tau_k
        # silently, and counts against the partner (a clip's trust, a far rejection) only beyond clip_factor x
        # that: per-tensor ratios are divided by clip_factor before they join the whole's.
        ratios = [d / tau] + ([x / t / c.clip_factor for x, t in zip(dk, taus)] if taus is not None else [])
        ratio = max(ratios)
        worst = "all tensors" if ratios.index(ratio) == 0 else f"tensor {ratios.index(ratio) - 1}"
        if ratio > c.reject_factor:
            if base_taus is not None:  # a far partner votes tau: after an eclipse shrank it, tau can recover
                self.votes.vote(partner, base_tau, base_taus)
            v = self._reject(Code.DISTRUSTED, f"far: {worst} at {ratio:.3g} x its bound > {c.reject_factor:g} "
                             f"(distance {d:.3g}, tau {tau:.3g})", d, tau, far=True, ratio=ratio)
            return self._finish(v, partner, own_round, partner_round, listed_rounds, own_id, behind_rounds, None)
        # every tensor clipped to its own tau_k, and the whole to tau
        whole = min(1.0, tau / d) if d > 0 else 1.0
        scales = [min(whole, (t / x) if x > t else 1.0) for x, t in zip(dk, taus)] if taus is not None \
            else [whole] * n
        reason = f"{worst} at {ratio:.3g} x its bound" if ratio > 1 else ""

        # accepted is not unchecked: the clipped point on a batch only we know, next to ours
        own_loss = partner_loss = None
        better = False
        if loss is not None:
            point = [a + s * (b.to(a.device) - a) if s < 1 else b for a, b, s in zip(own, theirs, scales)]
            own_loss, partner_loss = float(loss(own)), float(loss(point))
            # a partner may trail us by up to (gap + 1) rounds of our own recent progress (early on one round moves
            # the loss by more than val_margin), and by val_margin a round of gap besides
            margin = c.val_margin * (1 + gap) + (gap + 1) * self._progress(own_round, own_loss)
            bound = own_loss * (1 + margin)
            if math.isfinite(partner_loss) and partner_loss > bound and recheck is not None and c.recheck_batches:
                # a second look before a rejection: a partner whose model is worse is worse on every batch, one
                # batch's noise is not (the clean hetero bench lost an honest pair at round 11 to one batch)
                k = c.recheck_batches
                own_loss = (own_loss + k * float(recheck(own))) / (1 + k)
                partner_loss = (partner_loss + k * float(recheck(point))) / (1 + k)
                bound = own_loss * (1 + margin)
            if not math.isfinite(partner_loss) or partner_loss > bound:
                self.votes.vote(partner, min(d, base_tau), self._capped(dk, base_taus))
                code = Code.DISTRUSTED if math.isfinite(partner_loss) else Code.NOT_FINITE
                v = self._reject(code, f"partner's loss {partner_loss:.4g} on a private batch > {bound:.4g}", d,
                                 tau, far=False, ratio=ratio, own_loss=own_loss, partner_loss=partner_loss)
                return self._finish(v, partner, own_round, partner_round, listed_rounds, own_id, behind_rounds,
                                    None)
            better = ratio > 1 and partner_loss < own_loss * (1 - c.val_margin)

        # the budget across rounds: this partner's accepted corrections, summed in the sketch
        drift = self._drift(partner, own_round)
        step = (torch.tensor(scales, dtype=torch.float64)[:, None] * diff_sketch).sum(0) / max(norm, 1e-30)
        budget = c.drift_budget * base_tau
        keep = _keep_within(drift.sketch, step, budget)
        if keep <= c.drift_min_keep:
            self.votes.vote(partner, min(d, base_tau), self._capped(dk, base_taus))
            v = self._reject(Code.DISTRUSTED, f"drift: this partner's corrections add up along one direction to "
                             f"{float(drift.sketch.norm()):.3g} of ||y|| (budget {budget:.3g})", d, tau,
                             far=False, ratio=ratio, own_loss=own_loss, partner_loss=partner_loss)
            return self._finish(v, partner, own_round, partner_round, listed_rounds, own_id, behind_rounds, None)
        if keep < 1.0:
            scales = [s * keep for s in scales]
            reason = (reason + "; " if reason else "") + (f"drift: kept {keep:.2f} of the correction (budget "
                                                          f"{budget:.3g} of ||y|| along one direction)")
        drift.sketch += keep * step
        # outer momentum carries a correction ~1 / (1 - gamma) times: not for a stranger's, nor for a partner whose
        # pull has been consistent (half its budget used)
        known = drift.accepted >= c.known_after and float(drift.sketch.norm()) <= budget / 2
        drift.accepted += 1
        self.votes.vote(partner, min(d, base_tau), self._capped(dk, base_taus))
        action: Action = "clip" if ratio > 1.0 or keep < 1.0 else "mix"  # a tensor clipped silently: still "mix"
        v = Decision(action, tuple(scales), d, tau, ratio, reason=reason, momentum=known, own_loss=own_loss,
                     partner_loss=partner_loss, partner_better=better)
        return self._finish(v, partner, own_round, partner_round, listed_rounds, own_id, behind_rounds, better)

    # ------------------------------------------------------------------ pieces
    def tau(self) -> float:
        """The tau partners are judged by now (before any round gap widens it)."""
        return self.votes.tau(self._own[0] if self._own is not None else None)

    def step(self) -> float:
        """Our own movement per round, relative to ||y|| (the last measured; 0 before two offers)."""
        if self._moved is None or self._own is None:
            return 0.0
        return float(self._moved.sum(0).norm()) / max(self._own[2], 1e-30)

    def clear(self) -> None:
        self.votes.clear()
        self.streak.clear()
        self._own, self._moved, self._losses, self._drops = None, None, [], []

    def _note_own(self, own: Sequence[torch.Tensor], own_round: int) -> torch.Tensor:
        """Sketch our own offer, per tensor (raw); from the last one, our movement per round. Returns the sketch."""
        raw = self.sketch.per_tensor(own)
        norm = math.sqrt(sum(float(t.float().pow(2).sum()) for t in own))
        if self._own is not None and 0 < own_round - self._own[0] <= 4 and raw.shape == self._own[1].shape:
            self._moved = (raw - self._own[1]) / (own_round - self._own[0])
        if self._own is None or own_round != self._own[0]:
            self._own = (own_round, raw, norm)
        return raw

    def _progress(self, own_round: int, own_loss: float) -> float:
        """Our own recent loss drop per round, relative (the median of the last 3 measured between rounds, each on
        its own private batch), at most max_progress; 0 until two rounds were measured."""
        if math.isfinite(own_loss) and own_loss > 0:
            last = self._losses[-1] if self._losses else None
            if last is None or own_round > last[0]:
                if last is not None and own_round - last[0] <= 4:
                    drop = (last[1] - own_loss) / own_loss / (own_round - last[0])
                    self._drops = (self._drops + [max(0.0, drop)])[-3:]
                self._losses = [(own_round, own_loss)]
        return min(statistics.median(self._drops), _MAX_PROGRESS) if self._drops else 0.0

    def _drift(self, partner: str, own_round: int) -> Drift:
        got = self.drift.get(partner)
        if got is None:
            got = self.drift[partner] = Drift(torch.zeros(self.cfg.sketch_size, dtype=torch.float64), own_round)
        elif own_round > got.round:
            got.sketch *= 2.0 ** (-(own_round - got.round) / self.cfg.drift_half_life_rounds)
            got.round = own_round
        return got

    @staticmethod
    def _capped(dk: Sequence[float], taus: Sequence[float] | None) -> list[float]:
        return list(dk) if taus is None else [min(x, t) for x, t in zip(dk, taus)]

    def _reject(self, code: Code, reason: str, d: float, tau: float, *, far: bool, ratio: float = 0.0,
                own_loss: float | None = None, partner_loss: float | None = None) -> Decision:
        return Decision("reject", (), d, tau, ratio, code, reason, far=far, momentum=False, own_loss=own_loss,
                        partner_loss=partner_loss)

    def _finish(self, v: Decision, partner: str, own_round: int, partner_round: int | None,
                listed_rounds: Iterable[int], own_id: str, behind_rounds: float, better: bool | None) -> Decision:
        """The catch-up rule on this decision (protocol/guard.py catch_up_due), and forgetting old partners."""
        verdict = v.verdict if not v.rejected or v.far else Verdict("reject", v.distance, v.tau, 0.0, None)
        self.streak.note(verdict, partner, partner_round)
        why = catch_up_due(verdict, own_round=own_round, own_id=own_id, partner_round=partner_round,
                           listed_rounds=listed_rounds, streak=self.streak, behind_rounds=behind_rounds,
                           partner_better=bool(better))
        if len(self.drift) > 4 * self.cfg.history:  # churn: forget the partners met longest ago
            for p in sorted(self.drift, key=lambda q: self.drift[q].round)[:len(self.drift) - 4 * self.cfg.history]:
                self.drift.pop(p)
        if why is None:
            return v
        return Decision(v.action, v.scales, v.distance, v.tau, v.ratio, v.code, v.reason, v.far, v.momentum, why,
                        v.own_loss, v.partner_loss, v.partner_better)


class PrivateChecks:
    """The losses one round's mix decisions check on, over batches only this peer knows (the validation batches are
    every peer's, so a state could be tuned to them): `loss` on one batch drawn at once, `recheck` on `n_more`
    further batches drawn the first time a second look is asked for and the same ones after (a streamed dataset
    skips what it draws). `draw(n)` draws n batches, `loss_at(point, batches)` is the mean loss of `point` on them.
    The live peer and the simulator both decide through it."""

    def __init__(self, loss_at: Callable[[Sequence[torch.Tensor], list], float], draw: Callable[[int], list],
                 n_more: int):
        self._loss_at, self._draw, self._n_more = loss_at, draw, n_more
        self._first, self._more = draw(1), None

    def loss(self, point: Sequence[torch.Tensor]) -> float:
        return self._loss_at(point, self._first)

    def recheck(self, point: Sequence[torch.Tensor]) -> float:
        if self._more is None:
            self._more = self._draw(self._n_more)
        return self._loss_at(point, self._more)


def _widen(d: float, there: float, allow: float, tau: float) -> float:
    """How much to widen tau for a partner at distance `d` from us and `there` from our own path's point at its
    round, that point `allow` from us: d / there, within [1, 1 + allow / tau]."""
    if d <= 0 or tau <= 0:
        return 1.0
    return max(1.0, min(d / max(there, 1e-12), 1.0 + allow / tau))


def _keep_within(acc: torch.Tensor, step: torch.Tensor, budget: float) -> float:
    """The largest s in [0, 1] with ||acc + s step|| <= budget (1 when the whole step fits; 0 when even s = 0 is
    over budget and the step does not lead back toward it). A step that shrinks the sum is always kept whole."""
    if float((acc + step).norm()) <= budget:
        return 1.0
    a, b, cc = float(step @ step), 2 * float(acc @ step), float(acc @ acc) - budget ** 2
    if b < 0 and float((acc + step).norm()) <= float(acc.norm()):
        return 1.0  # it pulls the sum back
    if a <= 0:
        return 0.0
    disc = b * b - 4 * a * cc
    if disc < 0:
        return 0.0
    s = (-b + math.sqrt(disc)) / (2 * a)
    return max(0.0, min(1.0, s))
