"""The mix decision against an attacker that knows it, in the simulator (issue 29; docs/robust-mixing.md "Partners
that know the guard"): one worker of a `gasloc sim` swarm trains and mixes honestly but offers its partners its
model plus a bias, sized from the distances it measures to them (as an attacker reading its own guard would):

  none      no attacker (the clean swarm, same seed)
  uphill    bias along the attacker's own loss gradient on its own batch (up the loss), every offer
  uphill1   the same, all of it in one tensor (the token embedding)
  bias      one fixed random direction, every offer

||bias|| = alpha x the median of the attacker's last 8 partner distances x ||y||. Everything else is the simulator's
own trainer, schedule and guard (sim/trainer.py `_guarded`, protocol/decision.py); the attack replaces what the
attacker's partners receive, nothing else. Figures per run: the honest median validation loss at the last
evaluation (workers 1..K-1, also in the clean run, so the same workers are compared), the attacker's offers mixed
in (of those judged), and the honest-honest rejections as (judge, partner, judge's round, partner's round).

    python bench/guard_sim.py --seeds 0,1,2 --json guard_sim.json        # the table in docs/robust-mixing.md
    python bench/guard_sim.py --attacks none --profile half-slow-10x      # slow links: rounds apart, honest only

The old rule's column came from the same script run against a checkout of 388c7ab (PYTHONPATH pointing at it).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from gasloc.peer.train.data import WindowSampler
from gasloc.sim import runner
from gasloc.sim.config import SimConfig
from gasloc.sim.trainer import SimTrainer

ATTACKS = ("none", "uphill", "uphill1", "bias")


def _norm(ts) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


class Attack:
    """Worker 0's offers as its partners receive them, and what their guards made of everything they received."""

    def __init__(self, kind: str, alpha: float):
        self.kind, self.alpha, self.att = kind, alpha, (None if kind == "none" else 0)
        self.seen: list[float] = []      # the attacker's own partner distances (what it sizes from)
        self.offer: list[torch.Tensor] | None = None
        self.decisions: list[dict] = []
        self._sampler = self._direction = None

    def install(self) -> None:
        send, guarded = SimTrainer.send, SimTrainer._guarded
        attack = self

        def hooked_send(trainer, i):
            n = send(trainer, i)
            if i == attack.att:
                attack.offer = attack._poisoned(trainer, i)
            return n

        def hooked_guarded(trainer, i, theirs):
            own = trainer.wire[i] if trainer.wire[i] is not None else trainer.sent[i]
            theirs = {j: (attack.offer if j == attack.att and i != attack.att else t) for j, t in theirs.items()}
            if i == attack.att:
                attack.seen += [_norm([b - a for a, b in zip(own, t)]) / _norm(own) for t in theirs.values()]
            out = guarded(trainer, i, theirs)
            for j in theirs:
                attack.decisions.append({"i": i, "j": j, "ri": trainer.rounds[i], "rj": trainer.rounds[j],
                                         "mixed": j in out, "hostile": j == attack.att})
            return out

        SimTrainer.send, SimTrainer._guarded = hooked_send, hooked_guarded

    def _poisoned(self, trainer: SimTrainer, i: int) -> list[torch.Tensor]:
        y = trainer.wire[i] if trainer.wire[i] is not None else trainer.sent[i]
        size = self.alpha * (statistics.median(self.seen[-8:]) if self.seen else 0.05) * _norm(y)
        if self.kind in ("uphill", "uphill1"):
            if self._sampler is None:  # the attacker's own batches, a stream of their own
                tr = trainer.data[i].train
                self._sampler = WindowSampler(tr.tokens, tr.blocks, tr.seq_len, tr.batch_size, seed=7,
                                              stream="attacker")
            model = trainer.eval_model
            with torch.no_grad():
                for dst, src in zip(model.parameters(), y):
                    dst.copy_(src)
            model.zero_grad(set_to_none=True)
            model.loss(self._sampler.next_batch()).backward()
            d = [p.grad.detach().clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        else:
            if self._direction is None:
                g = torch.Generator().manual_seed(99)
                self._direction = [torch.randn(t.shape, generator=g) for t in y]
            d = [t.clone() for t in self._direction]
        if self.kind == "uphill1":
            d = [x if k == 0 else torch.zeros_like(x) for k, x in enumerate(d)]
        f = size / (_norm(d) or 1.0)
        return [t + f * x for t, x in zip(y, d)]


def run_one(kind: str, seed: int, args) -> dict:
    cfg = SimConfig.model_validate({
        "workers": args.workers, "rounds": args.rounds, "seed": seed, "eval_every": args.rounds,
        "inner": {"inner_steps": args.inner_steps, "warmup_steps": 20},
        **({"clock": {"profile": args.profile}} if args.profile != "uniform" else {})})
    saved = SimTrainer.send, SimTrainer._guarded
    attack = Attack(kind, args.alpha)
    attack.install()
    t0 = time.time()
    try:
        res = runner.run(cfg)
    finally:
        SimTrainer.send, SimTrainer._guarded = saved
    hostile = [d for d in attack.decisions if d["hostile"]]
    return {"attack": kind, "seed": seed, "profile": args.profile,
            "honest_median": statistics.median(res["evals"][-1]["val_loss_workers"][1:]),
            "hostile_mixed": sum(d["mixed"] for d in hostile), "hostile_judged": len(hostile),
            "honest_rejected": [(d["i"], d["j"], d["ri"], d["rj"]) for d in attack.decisions
                                if not d["hostile"] and d["i"] != attack.att and not d["mixed"]],
            "max_round_gap": max((abs(d["ri"] - d["rj"]) for d in attack.decisions), default=0),
            "guard": res["guard"], "wall_s": round(time.time() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=1.5, help="bias size in median partner distances")
    ap.add_argument("--profile", default="uniform", help="clock.profile (e.g. half-slow-10x)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kinds = [k for k in args.attacks.split(",") if k]
    bad = [k for k in kinds if k not in ATTACKS]
    if bad:
        print(f"unknown attack {bad[0]!r}; choose from {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for kind in kinds:
            rows.append(run_one(kind, seed, args))
            r = rows[-1]
            print(f"seed={seed} attack={kind:8s} honest_median={r['honest_median']:.4f} "
                  f"attacker_mixed={r['hostile_mixed']}/{r['hostile_judged']} "
                  f"honest_rejected={len(r['honest_rejected'])} guard={r['guard']} wall_s={r['wall_s']}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
