"""A low-rank exchange of the pair's difference (PowerGossip, Vogels et al. 2020), in the simulator (issue 32's
<= 1-bit option): what a rank-r wire gives against the fp32 wire, paired by seed.

    python bench/low_rank.py --jobs 2 --json low_rank.json                        # every default variant, seeds 0 1 2
    python bench/low_rank.py --variants seeded-r2 --seeds 0 --rounds 1 --workers 2  # a smoke run

Per pair and matrix Y (a tensor of 2 or more dims, read as rows by the rest), with D = Y_b - Y_a (a the lower-index
worker: both sides orient the difference alike), one step of the power iteration per exchange, in two messages a
side:

    each side sends P_s = Y_s Q          (n x r)   both take P = P_b - P_a = D Q, orthonormalize it: P^
    each side sends Q_s = Y_s^T P^       (m x r)   both take Q' = Q_b - Q_a = D^T P^
    a reads b as Y_a + P^ Q'^T, b reads a as Y_b - P^ Q'^T

Both sides compute P^ and Q' from the same two messages (each side's own message as the other reads it, rounded to
the factors' precision), so they hold the same rank-r approximation P^ P^^T D, and the mix at weight w moves a by
+w and b by -w of it: the pair's mean is kept exactly, up to float rounding. A D of rank r or less is recovered
exactly (up to the factors' rounding) by one step from a Q in general position.

Variants, `{seeded|warm}-r{rank}`:

    seeded-rR   Q drawn fresh at every exchange from the exchange's seed (both peers derive it; no state per partner)
    warm-rR     Q is the pair's Q' of their previous exchange (PowerGossip's warm start: one state per partner and
                matrix), drawn from the seed at the pair's first exchange

Vectors (norms' weights; the tiny preset has no biases) and any matrix whose factors would cost more than itself are
sent whole in fp32: mixed exactly, at 32 bits a number. Bits a parameter count every message of one side in one
exchange (factors of every matrix at --factor-bits, the whole tensors at 32) over the model's parameters; the
exchange's seed and the protocol's framing are not counted.

The setup is the codec suite's (bench/mod_steps.py: claim (b)'s cosine setup, 8 workers, H = 20, 30 rounds), each
variant paired by seed with the fp32 wire of the same invocation, and the clock charging every run the fp32 wire's
4 bytes a parameter (bench/mod_steps.py `--clock fp32`): every run meets the fp32 run's partners, and the paired
difference is the approximation's alone. A variant runs through the simulator's modulo exchange (sim/trainer.py
`_modulo_wire`) replaced by the arithmetic here; it mixes with the pair's mean (w = 0.5: the rank-r part of the
difference is exact, there is no noise to pull less against) unless `--mix-weight` says otherwise. It is an
experiment, not a codec: nothing here is on any wire.
"""
from __future__ import annotations

import json
import math
import re

import click
import torch
from mod_steps import paired_cells, seeds_and_overrides, simulate, table

VARIANTS = ("seeded-r4", "seeded-r32", "warm-r3", "warm-r4")
DTYPES = {16: torch.float16, 32: torch.float32}


def parse_variant(name: str) -> tuple[str, int]:
    """("seeded" | "warm", rank) of a variant's name."""
    m = re.fullmatch(r"(seeded|warm)-r([1-9][0-9]*)", name)
    if m is None:
        raise ValueError(f"{name!r} is no variant: seeded-rR or warm-rR, R a rank >= 1")
    return m.group(1), int(m.group(2))


def sends_factors(shape: torch.Size | tuple, rank: int, factor_bits: int) -> bool:
    """Whether a tensor of this shape goes as rank-r factors: a matrix whose factors cost less than it in fp32."""
    if len(shape) < 2:
        return False
    n, m = shape[0], math.prod(shape[1:])
    return (n + m) * rank * factor_bits < n * m * 32


def bits_per_param(shapes: list, rank: int, factor_bits: int) -> float:
    """What one side sends in one exchange, in bits, over the model's parameters."""
    bits = 0
    for shape in shapes:
        if sends_factors(shape, rank, factor_bits):
            bits += (shape[0] + math.prod(shape[1:])) * rank * factor_bits
        else:
            bits += math.prod(shape) * 32
    return bits / sum(math.prod(s) for s in shapes)


def seeded_q(seed: int, cols: int, rank: int) -> torch.Tensor:
    return torch.randn(cols, rank, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def message(y: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One side's factor message Y M as both sides read it: rounded to the factors' precision (the sender uses the
    rounded form too, so that both sides compute from the same numbers)."""
    return (y @ m).to(dtype).double()


def low_rank_step(ya: torch.Tensor, yb: torch.Tensor, q: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pair's rank-r approximation of D = yb - ya, the Q' for a warm start) from one power-iteration step:
    float64 matrices ya, yb (n x m), q (m x r)."""
    p = message(yb, q, dtype) - message(ya, q, dtype)              # D Q
    # Householder QR, not Gram-Schmidt: a P of lower rank (a pair that agrees on a subspace) gives no 0/0
    basis = torch.linalg.qr(p).Q
    q_next = message(yb.T, basis, dtype) - message(ya.T, basis, dtype)   # D^T P^
    return basis @ q_next.T, q_next


def low_rank_wire(kind: str, rank: int, factor_bits: int):
    """A replacement of SimTrainer._modulo_wire: every pair's wire forms from the low-rank step, `wire[(a, b)]` =
    y_a + A and `wire[(b, a)]` = y_b - A, the vectors as they are; warm-start Qs on the trainer, per pair and
    tensor."""
    dtype = DTYPES[factor_bits]

    def _modulo_wire(self, partners) -> None:
        warm = self.__dict__.setdefault("low_rank_q", {})
        for i, ps in partners.items():
            if ps:
                self.wire[i] = self.sent[i]
        for a, ps in partners.items():
            for b in ps:
                if b < a:
                    continue   # each pair once, from the lower index's side
                seed = self.exchange_seed(a, b)
                wa, wb = [], []
                for k, (x, y) in enumerate(zip(self.sent[a], self.sent[b])):
                    if not sends_factors(x.shape, rank, factor_bits):
                        wa.append(y)
                        wb.append(x)
                        continue
                    ya, yb = x.reshape(x.shape[0], -1).double(), y.reshape(y.shape[0], -1).double()
                    q = warm.get((a, b, k)) if kind == "warm" else None
                    if q is None:
                        q = seeded_q(hash((seed, k)) & 0x7FFFFFFF, ya.shape[1], rank)
                    approx, q_next = low_rank_step(ya, yb, q, dtype)
                    if kind == "warm":
                        warm[(a, b, k)] = q_next
                    wa.append((ya + approx).float().view_as(x))
                    wb.append((yb - approx).float().view_as(y))
                self.wire[(a, b)], self.wire[(b, a)] = wa, wb
    return _modulo_wire


def run_variant(variant: str, seed: int, overrides: dict, mix_weight: float, factor_bits: int) -> dict:
    if variant == "fp32":
        return simulate("fp32", seed, overrides, clock="fp32")
    kind, rank = parse_variant(variant)
    # kappa 1, the form as published: the low-rank wire only borrows mod4-sd's slot in the simulator, whose own
    # kappa (0.5, docs/codecs.md J) is for its rounding noise; H ran 1
    return simulate(variant, seed, overrides, modulo_wire=low_rank_wire(kind, rank, factor_bits),
                    mix_weight=mix_weight, clock="fp32", mix_momentum=1.0)


def model_shapes(overrides: dict) -> list[tuple]:
    """The shapes of the setup's parameters, in the simulator's order."""
    from gasloc.peer.train.data import build_data
    from gasloc.peer.train.model import build_model
    from gasloc.sim.suite import SUITES, RunSpec, _config

    suite = SUITES["codecs"]
    b = next(r.overrides for r in suite.runs if r.overrides.get("codec") == "float32")
    cfg = _config(suite, RunSpec("shapes", {**b, **overrides}))
    vocab = build_data(cfg.data, cfg.model.seq_len)[1].vocab_size
    return [tuple(p.shape) for p in build_model(cfg.model, vocab, seed=0).parameters()]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--variants", default=",".join(VARIANTS), show_default=True,
              help="comma-separated, each seeded-rR or warm-rR (R the rank)")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--jobs", type=click.IntRange(1, 16), default=1, show_default=True, help="runs at once (processes)")
@click.option("--rounds", type=click.IntRange(1), default=None, help="fewer rounds (a smoke run)")
@click.option("--workers", type=click.IntRange(2), default=None, help="fewer workers (a smoke run)")
@click.option("--factor-bits", type=click.Choice(["16", "32"]), default="16", show_default=True,
              help="precision of the factor messages (fp16 or fp32); vectors always go in fp32")
@click.option("--mix-weight", type=click.FloatRange(0, 0.5, min_open=True), default=0.5, show_default=True,
              help="the low-rank variants' weight per partner; fp32 keeps the pair's mean")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(variants: str, seeds: str, jobs: int, rounds: int | None, workers: int | None, factor_bits: str,
         mix_weight: float, json_path: str | None) -> None:
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    for v in chosen:
        if v != "fp32":
            try:
                parse_variant(v)
            except ValueError as e:
                raise click.BadParameter(str(e), param_hint="--variants") from None
    seed_list, overrides = seeds_and_overrides(seeds, rounds, workers)
    fbits = int(factor_bits)
    shapes = model_shapes(overrides)
    bits = {v: bits_per_param(shapes, parse_variant(v)[1], fbits) for v in chosen if v != "fp32"}
    rows = paired_cells(run_variant, chosen, seed_list, jobs, overrides, mix_weight, fbits)
    click.echo(table(rows, {"bits / parameter": {"fp32": "32", **{v: f"{b:.3f}" for v, b in bits.items()}}}))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": rows, "overrides": overrides, "mix_weight": mix_weight, "factor_bits": fbits,
                       "clock": "fp32", "bits_per_param": bits}, f, indent=1)


if __name__ == "__main__":
    main()
