"""Outer updates: GASLoC (forms A, B, C) and its baselines, as pure tensor code over a worker's parameter list.

Every algorithm has the same two-step shape, so the simulator and the live peer drive them identically:

    outer = make_outer(cfg, params)        # records the anchor (theta at the start of the round)
    ... H inner AdamW steps on params ...
    sent = outer.outgoing(params)          # what this worker sends to its partner(s) this round
    mixed = mix(sent, [partner_sent...])   # protocol.averaging; a solo round passes `sent` itself
    outer.apply(params, mixed)             # writes the new theta into params and sets the next anchor

With overlap (GASLoC only) a round calls `apply(params, sent)` at once and `late_mix(params, sent, mixed)` when the
mix lands during the next inner phase.

Failure semantics: `apply` is the only call that changes params or state, and it is all-or-nothing on tensors
already in memory. A failed exchange is a solo round (`apply(params, sent)`), never a partial mix.
The inner optimizer (AdamW) and its state are not touched here: they stay local to the worker across rounds.
docs/algorithms.md has the equations and what the unit tests check against.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

Algorithm = Literal["gasloc", "diloco", "noloco", "gossip", "local"]
ALGORITHMS: tuple[str, ...] = ("gasloc", "diloco", "noloco", "gossip", "local")

# Per-algorithm defaults for what the config leaves unset: (outer lr eta, momentum gamma / NoLoCo beta). The
# baselines keep their published values. GASLoC's gamma is 0.7, not DiLoCo's 0.9: with one partner per round,
# form C moves a worker (1 + gamma) times the way to the pair's mean, and at 0.9 two models that drifted apart
# overshoot; 0.7 was the simulator's choice at H = 20 (docs/sim-results.md) and on the hetero bench it removed most
# mixing jumps and reached DiLoCo's loss sooner (docs/hetero-results.md).
_DEFAULTS: dict[str, tuple[float, float]] = {
    "gasloc": (0.7, 0.7), "diloco": (0.7, 0.9), "noloco": (0.7, 0.5), "gossip": (1.0, 0.0), "local": (1.0, 0.0),
}

# GASLoC's outer settings by H, for what the user leaves unset (fit_to_h; the component configs call it): rows of
# (largest H, gamma, eta, source). Few inner steps mean small local progress per round and many mixes: momentum on
# top of AdamW's own then mostly carries mixing corrections, and a small one won. The H <= 4 row comes from
# `gasloc sim compare --suite tune-h1` (2026-12-01, docs/sim-results.md "H = 1 on the live schedule"): of five
# (gamma, eta) settings only 0.1 / 1.0 ended below gossip-AdamW on both ring (-0.029) and random (-0.007); the
# earlier row 0.1 / 0.9 (tuned on the lock-step schedule) was above it on both. Note eta 1 with gamma 0.1 also
# takes ~1.1x gossip's step on the local progress. The boundary between the rows (H = 4 | 5) was not tuned.
H_DEFAULTS: tuple[tuple[int, float, float, str], ...] = (
    (4, 0.1, 1.0, "docs/sim-results.md 'H = 1 on the live schedule' (gasloc sim compare --suite tune-h1): H = 1, "
     "8 workers, ring and random, 75 rounds, lr 4e-3, five (gamma, eta); the one below gossip-AdamW on both"),
    (10**9, 0.7, 0.7, "docs/sim-results.md claim (b): H = 20, 8 workers, random, 30 rounds, lr 2e-3, gamma in "
     "{0.5, 0.7, 0.8, 0.9} x eta in {0.7, 1}; and the hetero bench (docs/hetero-results.md)"),
)


def fit_to_h(cfg: OuterConfig, inner_steps: int) -> OuterConfig:
    """GASLoC with outer.momentum or outer.outer_lr unset: a copy with them picked from H (H_DEFAULTS), the reason
    kept in `picked` (--print-config shows it). Every other algorithm keeps its published defaults."""
    if cfg.algorithm != "gasloc" or (cfg.momentum is not None and cfg.outer_lr is not None):
        return cfg
    top, gamma, eta, source = next(row for row in H_DEFAULTS if inner_steps <= row[0])
    update = {k: v for k, v in (("momentum", gamma), ("outer_lr", eta)) if getattr(cfg, k) is None}
    out = cfg.model_copy(update=update)
    span = f"H <= {top}" if top < 10**9 else f"H > {H_DEFAULTS[-2][0]}"
    out._picked = (f"{' and '.join(f'{k} = {v}' for k, v in update.items())} picked for H = {inner_steps} "
                   f"({span}) from {source}")
    return out


class OuterConfig(BaseModel):
    """The outer update: which algorithm, and its hyperparameters."""
    model_config = ConfigDict(extra="forbid")

    algorithm: Algorithm = Field("gasloc", description="gasloc | diloco | noloco | gossip (gasloc with eta=1, "
                                 "gamma=0) | local (no communication)")
    form: Literal["A", "B", "C"] = Field("C", description="GASLoC form: A (published), B or C (default; B and C "
                                         "equal DiLoCo on the complete graph)")
    outer_lr: float | None = Field(None, gt=0, le=2, description="outer learning rate eta; default: gasloc "
                                   "picks it from H (1.0 for H <= 4, else 0.7; docs/algorithms.md), diloco and "
                                   "noloco 0.7, gossip 1.0")
    momentum: float | None = Field(None, ge=0, lt=1, description="outer momentum gamma (NoLoCo: beta); default: "
                                   "gasloc picks it from H (0.1 for H <= 4, else 0.7; docs/algorithms.md), diloco "
                                   "0.9, noloco 0.5, gossip 0")
    mix_weight: float | None = Field(None, gt=0, le=1, description="weight w per partner in z = x - sum w (x - "
                                     "x_j); default: the wire codec's own weight where it has one (mod4-sd: 0.4, "
                                     "protocol/codec.py), else the uniform mean of the group (1/2 with one partner)")
    mix_momentum: float | None = Field(None, ge=0, le=1, description="kappa (form C): the share of each round's "
                                       "mixing correction z - y that the outer momentum carries into later rounds; 1 "
                                       "= form C (equals DiLoCo on the complete graph), 0 = momentum on the local "
                                       "progress only, the mix applied once; the swarm mean follows DiLoCo's path "
                                       "for every value; default: the exchange's codec's own where it has one "
                                       "(mod4-sd: 0.5; mod3-sd, int8-p10, mod8-p12-sd: 0; protocol/codec.py "
                                       "MIX_MOMENTUM), else 1")
    overlap: bool = Field(False, description="one-round-delayed mixing (gasloc, gossip): each round applies its "
                          "outer step at once as if solo and adds the partner's contribution when the exchange "
                          "lands, so the exchange runs during the next round's inner steps; more tokens/s, some "
                          "loss per token (docs/sim-results.md)")
    _picked: str | None = PrivateAttr(None)  # fit_to_h: what it picked from H, and why

    @model_validator(mode="after")
    def _gossip_is_fixed(self) -> OuterConfig:
        if self.algorithm == "gossip" and (self.outer_lr not in (None, 1.0) or self.momentum not in (None, 0.0)):
            raise ValueError("algorithm 'gossip' is GASLoC with outer_lr=1 and momentum=0; use 'gasloc' to set "
                             "other values")
        if self.mix_momentum not in (None, 1.0) and (self.algorithm != "gasloc" or self.form != "C"):
            raise ValueError(f"outer.mix_momentum is defined for gasloc form C, not {self.algorithm!r}"
                             + (f" form {self.form!r}" if self.algorithm == "gasloc" else "")
                             + "; remove it or use algorithm 'gasloc' with form 'C'")
        if self.overlap and self.algorithm not in ("gasloc", "gossip"):
            raise ValueError(f"overlap (one-round-delayed mixing) is defined for gasloc and gossip, not "
                             f"{self.algorithm!r}; remove outer.overlap or change the algorithm")
        return self

    @property
    def kappa(self) -> float:
        """mix_momentum as set, 1 (the form as published) where unset: a round's own kappa comes from
        protocol/averaging.py round_mix_momentum (`with round_mix_momentum_applied(...)`)."""
        return 1.0 if self.mix_momentum is None else self.mix_momentum

    @property
    def eta(self) -> float:
        return self.outer_lr if self.outer_lr is not None else _DEFAULTS[self.algorithm][0]

    @property
    def gamma(self) -> float:
        return self.momentum if self.momentum is not None else _DEFAULTS[self.algorithm][1]

    @property
    def communicates(self) -> bool:
        return self.algorithm != "local"


def _clone(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in ts]


class OuterUpdate:
    """Base class: holds the anchor (theta at the round's start) and named state tensors for checkpoints."""

    state_names: tuple[str, ...] = ()
    # whether a round without a mix still takes its outer step (apply(params, sent)); DiLoCo never does
    solo_steps: bool = True

    def __init__(self, cfg: OuterConfig, params: Sequence[torch.Tensor]):
        self.cfg = cfg
        self.eta, self.gamma = cfg.eta, cfg.gamma
        self.reset(params)

    @torch.no_grad()
    def reset(self, params: Sequence[torch.Tensor]) -> None:
        """Start afresh from `params` (a new run, or parameters downloaded from a peer): zero momentum."""
        self.anchor = _clone(params)
        self._reset_state(params)

    def _reset_state(self, params: Sequence[torch.Tensor]) -> None:
        pass

    def outgoing(self, params: Sequence[torch.Tensor], in_place: bool = False) -> list[torch.Tensor]:
        """What this worker sends. `in_place`: the caller lets this write into `params` (their value is not
        needed again before `apply`, which overwrites them) to save a parameter-sized copy; an algorithm may
        ignore it. Not with overlap: there `sent` must outlive the next inner phase."""
        raise NotImplementedError

    def apply(self, params: Sequence[torch.Tensor], mixed: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def idle_buffers(self) -> list[torch.Tensor] | None:
        """Parameter-shaped state that nothing reads between this round's `outgoing` and `apply`, which `apply`
        accepts `mixed` in (the exchange may decode the partner's tensors there); None: none."""
        return None

    @torch.no_grad()
    def _finish(self, params: Sequence[torch.Tensor], new_theta: Sequence[torch.Tensor]) -> None:
        torch._foreach_copy_(list(params), list(new_theta))
        self.anchor = _clone(params)

    # ---- checkpointing: flat {name.i: tensor}; the anchor is the checkpoint's params, so it is not stored
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{i}": t for name in self.state_names for i, t in enumerate(getattr(self, name))}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        self.anchor = _clone(params)
        for name in self.state_names:
            mine = getattr(self, name)
            for i, t in enumerate(mine):
                src = state.get(f"{name}.{i}")
                if src is None or src.shape != t.shape:
                    raise ValueError(f"outer state {name}.{i} missing or of the wrong shape")
                t.copy_(src)


class GASLoC(OuterUpdate):
    """GASLoC, one worker's view (algorithm.md):

        y = anchor + eta (theta - anchor)                        post-local-update point
        A: send y; z = mix(y); theta = z + gamma (y - y_prev)
        B: u = y + gamma (y - y_prev); send u; theta = mix(u)
        C: send y; z = mix(y); theta = z + gamma (z - z_prev - (1 - kappa) (z - y)); z_prev = z
        y_prev = y;  y_prev and z_prev start at theta_0

    A solo round (mixed = sent) still applies the momentum. With gamma=0, eta=1 this is gossip-AdamW.

    kappa (outer.mix_momentum, form C only; 1 is the form as published): with v = z - z_prev - (1 - kappa)(z - y),
    v_t = gamma v_{t-1} + eta g_t + kappa (z_t - y_t), where g is the inner drift and z - y the mixing correction.
    kappa = 1 lets momentum extrapolate the correction (1 + gamma times it at once, 1 / (1 - gamma) times in all):
    that is what speeds up consensus on a ring, and what overshoots toward a partner whose model drifted far away
    (docs/hetero-results.md). Every kappa keeps the swarm mean on DiLoCo's path, since the corrections of a
    mix sum to zero over the swarm.
    """

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("z_prev",) if self.cfg.form == "C" else ("y_prev",)

    def _reset_state(self, params):
        if self.cfg.form == "C":
            self.z_prev = _clone(params)
        else:
            self.y_prev = _clone(params)

    @torch.no_grad()
    def _y(self, params, in_place: bool = False) -> list[torch.Tensor]:
        # y = anchor + eta (theta - anchor); in place: the same operations in the same order, so the same bits
        if in_place:
            y = [p.detach() for p in params]
            torch._foreach_sub_(y, self.anchor)
        else:
            y = torch._foreach_sub(list(params), self.anchor)
        torch._foreach_mul_(y, self.eta)
        torch._foreach_add_(y, self.anchor)
        return y

    @torch.no_grad()
    def outgoing(self, params, in_place: bool = False):
        """What this worker sends: y (A, C) or u (B), as tensors that `apply` and `late_mix` only read, so they
        stay valid as the exchange's send buffer and, with overlap, until the late mix. Forms A and C allocate
        this one copy and nothing else; with `in_place` (a plain round: theta is not read again before `apply`
        writes the new one) y is built in the parameters' own storage and A and C allocate nothing: one
        parameter copy less at the round's peak. `sent` is then the parameters, valid until `apply`."""
        y = self._y(params, in_place)
        self._y_sent, self._y_in_params = y, in_place
        if self.cfg.form == "B":
            # u = y + gamma (y - y_prev)
            u = torch._foreach_sub(y, self.y_prev)
            torch._foreach_mul_(u, self.gamma)
            torch._foreach_add_(u, y)
            return u
        return y

    @torch.no_grad()
    def apply(self, params, mixed):
        """In place, with no parameter-sized allocation: the new theta is built in the momentum buffer (z_prev or
        y_prev), whose old value is read only there, and the anchor's buffer (free once y is sent) takes the value
        the momentum buffer keeps. `mixed` and y (outgoing's tensors) are only read; `mixed` may be `sent` itself
        (a solo round). Bit for bit the values of the allocating form: z - z_prev is computed as
        -(z_prev - z) and scaled by -gamma, which is exact in IEEE arithmetic (tests/golden/outer-*.json).
        y may be the parameters themselves (outgoing's `in_place`): it is read only before the last line writes
        params. `mixed` may be the anchor's own storage (idle_buffers): the anchor's value is never read here."""
        y, mixed = self._y_sent, list(mixed)
        form, anchor = self.cfg.form, self.anchor
        in_anchor = all(m.data_ptr() == a.data_ptr() for m, a in zip(mixed, anchor))
        if form == "B":  # theta = mix(u); y_prev = y
            torch._foreach_copy_(self.y_prev, y)
            torch._foreach_copy_(anchor, mixed)
        else:
            keep = self.z_prev if form == "C" else self.y_prev  # becomes gamma-extrapolated theta
            # A: theta = z + gamma (y - y_prev); C: theta = z + gamma (z - z_prev - (1 - kappa)(z - y))
            torch._foreach_sub_(keep, mixed if form == "C" else y)              # -(z - z_prev) | -(y - y_prev)
            if form == "C" and self.cfg.kappa != 1.0 and in_anchor:
                # z is in the anchor's buffer: -(z - y) = y - z in y's (read no more in form C; the parameters,
                # which the last line overwrites, or a copy), added with -(1 - kappa): the same bits
                d = y if self._y_in_params else torch._foreach_mul(y, 1.0)
                torch._foreach_sub_(d, mixed)
                torch._foreach_add_(keep, d, alpha=-(1 - self.cfg.kappa))
            elif form == "C" and self.cfg.kappa != 1.0:
                torch._foreach_copy_(anchor, mixed)                             # the anchor's buffer: z - y
                torch._foreach_sub_(anchor, y)
                torch._foreach_add_(keep, anchor, alpha=1 - self.cfg.kappa)
            torch._foreach_mul_(keep, -self.gamma)
            torch._foreach_add_(keep, mixed)                                    # keep = the new theta
            if form != "C" or not in_anchor:
                torch._foreach_copy_(anchor, mixed if form == "C" else y)       # the anchor's buffer = z | y
            if form == "C":
                self.z_prev, self.anchor = anchor, keep
            else:
                self.y_prev, self.anchor = anchor, keep
        del self._y_sent, self._y_in_params
        torch._foreach_copy_(list(params), self.anchor)

    def idle_buffers(self) -> list[torch.Tensor] | None:
        """After an in-place outgoing: the anchor. y was formed from it, and every form only writes it in `apply`
        (C: it becomes z_prev = z; A: y_prev = y; B: the new theta), so the partner's tensors can be decoded and
        mixed there: one parameter copy less at the exchange. Not after an allocating outgoing (overlap applies at
        once, and the anchor is the next round's)."""
        return self.anchor if getattr(self, "_y_in_params", False) else None

    @torch.no_grad()
    def late_mix(self, params: Sequence[torch.Tensor], sent: Sequence[torch.Tensor],
                 mixed: Sequence[torch.Tensor]) -> None:
        """Overlap: the round that sent `sent` was applied as solo (`apply(params, sent)`); its mix `mixed` arrived
        during the next inner phase. Shift params and the anchor by what `apply(params, mixed)` would have changed
        in theta - linear in mixed: (1 + gamma kappa)(mixed - sent) in form C, (mixed - sent) in A and B - and
        correct the momentum state (form C: z_prev is the mix). For an inner phase that does not depend on where it
        starts, this equals the undelayed update exactly; call it before this round's outgoing(). One temporary
        copy (the difference)."""
        d = torch._foreach_sub(list(mixed), list(sent))
        if self.cfg.form == "C":
            torch._foreach_add_(self.z_prev, d)
            torch._foreach_mul_(d, 1 + self.gamma * self.cfg.kappa)
        torch._foreach_add_(list(params), d)
        torch._foreach_add_(self.anchor, d)

    @torch.no_grad()
    def late_shift(self, sent: Sequence[torch.Tensor], mixed: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What late_mix adds to theta (and to the anchor)."""
        d = torch._foreach_sub(list(mixed), list(sent))
        if self.cfg.form == "C":
            torch._foreach_mul_(d, 1 + self.gamma * self.cfg.kappa)
        return d


class DiLoCo(OuterUpdate):
    """DiLoCo: Delta = anchor - theta; Delta_bar = mean over ALL workers; Nesterov SGD on the anchor:
    b = gamma b + Delta_bar;  x = x - eta (Delta_bar + gamma b). `mixed` must be the exact mean of everyone's Delta.
    """

    state_names = ("buf",)
    # One model: a peer steps only with its group's mean (peer/swarm/diloco.py); a round without one is dropped.
    # A solo step would move this peer's anchor where no other peer's goes, and the mean pseudo-gradients applied
    # afterwards never bring it back: a fork for good.
    solo_steps = False

    def _reset_state(self, params):
        self.buf = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def drop(self, params):
        """A round without the group's mean: no outer step; params go back to the anchor (the last step's model,
        still the swarm's unless the swarm stepped without us: then the caller downloads its state)."""
        torch._foreach_copy_(list(params), self.anchor)

    @torch.no_grad()
    def outgoing(self, params, in_place: bool = False):
        return torch._foreach_sub(self.anchor, list(params))

    @torch.no_grad()
    def apply(self, params, mixed):
        delta = list(mixed)
        torch._foreach_mul_(self.buf, self.gamma)
        torch._foreach_add_(self.buf, delta)
        step = torch._foreach_add(delta, self.buf, alpha=self.gamma)
        new = torch._foreach_add(self.anchor, step, alpha=-self.eta)
        self._finish(params, new)


class NoLoCo(OuterUpdate):
    """NoLoCo (public code): each pair exchanges phi (slow weights = anchor) and Delta = theta - phi;
    m = beta m + eta mean(Delta) + eta (mean(phi) - phi);  phi = phi + m;  theta = phi.
    Outgoing is [phi..., Delta...]: the mean of the concatenation is the concatenation of the means.
    """

    state_names = ("m",)

    def _reset_state(self, params):
        self.m = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def outgoing(self, params, in_place: bool = False):
        return _clone(self.anchor) + list(torch._foreach_sub(list(params), self.anchor))

    @torch.no_grad()
    def apply(self, params, mixed):
        n = len(self.anchor)
        phi_bar, delta_bar = list(mixed[:n]), list(mixed[n:])
        torch._foreach_mul_(self.m, self.gamma)                       # beta m
        torch._foreach_add_(self.m, delta_bar, alpha=self.eta)        # + eta mean(Delta)
        torch._foreach_add_(self.m, torch._foreach_sub(phi_bar, self.anchor), alpha=self.eta)
        self._finish(params, torch._foreach_add(self.anchor, self.m))


class Local(OuterUpdate):
    """No communication at all: the floor every method must beat. Sends nothing, changes nothing."""

    def outgoing(self, params, in_place: bool = False):
        return []

    def apply(self, params, mixed):
        self.anchor = _clone(params)


def make_outer(cfg: OuterConfig, params: Sequence[torch.Tensor]) -> OuterUpdate:
    """The outer update for `cfg.algorithm`, anchored at `params`."""
    cls = {"gasloc": GASLoC, "gossip": GASLoC, "diloco": DiLoCo, "noloco": NoLoCo, "local": Local}[cfg.algorithm]
    return cls(cfg, params)


class round_mix_momentum_applied:  # noqa: N801 (a context manager: `with round_mix_momentum_applied(outer, k)`)
    """Within: GASLoC form C carries `kappa` of this round's mixing correction on with its outer momentum (for this
    apply / late_mix only): the round's own kappa, protocol/averaging.py round_mix_momentum (0 for a partner we
    barely know, the mix decision's `momentum` False; else outer.mix_momentum, else the exchange's codec's, else
    1). Form C otherwise carries a correction ~1 / (1 - gamma) times its size. Other algorithms and forms carry no
    mixing correction with momentum: nothing changes."""

    def __init__(self, outer: OuterUpdate, kappa: float):
        self.outer, self.saved, self.kappa = outer, None, kappa
        self.active = isinstance(outer, GASLoC) and outer.cfg.form == "C" and kappa != outer.cfg.kappa

    def __enter__(self) -> OuterUpdate:
        if self.active:
            # model_copy does not validate: any kappa in [0, 1] is valid here (gasloc form C)
            self.saved, self.outer.cfg = self.outer.cfg, self.outer.cfg.model_copy(update={"mix_momentum": self.kappa})
        return self.outer

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            self.outer.cfg, self.saved = self.saved, None
