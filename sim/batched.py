"""Batched inner steps (`batched = true`): the K workers' models stacked along a leading dimension, and one
vmapped forward/backward plus one stacked AdamW step for many workers at once, instead of K small ones.

Why: a micro-preset step takes ~4 ms on one core, almost all of it per-call overhead (Python, dispatcher, autograd
graph), so 1,000 workers x 20 rounds x 5 steps = 100,000 steps cost ~7 minutes before any mixing; batched, the
overhead is paid once per batch. The maths is the per-worker maths (tests/unit/test_sim_batched.py compares it
with the unbatched trainer): each worker keeps its own shard, step count, warm-up, grad-norm clip and AdamW
moments; only the order of floating-point operations differs.

Deferral, and why it is exact: a worker's inner phase depends only on its own parameters, AdamW state and data,
and nothing else touches them between the start of that phase and its end (in COMPUTE a worker is in no exchange).
So the engine announces each phase when it starts (`plan`), and the first worker whose phase ends (`inner`) runs
every planned phase at once. Workers whose phase has not ended in virtual time yet keep a copy of their parameters
from before it, and evaluations read that copy: at any virtual time a worker is seen as it is on the clock.

Not simulated batched: overlap (its mix lands between two inner steps).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from gasloc.peer.train.data import build_data
from gasloc.peer.train.inner import lr_at
from gasloc.peer.train.model import build_model
from gasloc.peer.train.outer import make_outer
from gasloc.sim.trainer import SimTrainer, guards_for, worker_data

EVAL_CHUNK = 256  # workers per vmapped evaluation forward: bounds the logits' memory (chunk x B x T x vocab)
TRAIN_CHUNK = 256  # workers per vmapped forward/backward: bounds the activations kept for the backward pass


class BatchedTrainer(SimTrainer):
    """SimTrainer with stacked parameters: worker i's tensors are views `stack[i]`, so mixing and the outer
    updates (which write in place) run unchanged on them."""

    def __init__(self, cfg):  # noqa: D107 - sets what SimTrainer.__init__ sets, without K modules and optimizers
        self.cfg, k = cfg, cfg.workers
        self.data = worker_data(cfg)
        vocab = build_data(cfg.data, cfg.model.seq_len)[1].vocab_size
        self.template = build_model(cfg.model, vocab, seed=cfg.seed)  # every worker starts from these weights
        self.eval_model = build_model(cfg.model, vocab, seed=cfg.seed)
        named = list(self.template.named_parameters())  # tied weights appear once, as in model.parameters()
        self.names = [n for n, _ in named]
        self.stack = [p.detach().unsqueeze(0).repeat(k, *([1] * p.dim())).contiguous() for _, p in named]
        self.exp_avg = [torch.zeros_like(s) for s in self.stack]
        self.exp_avg_sq = [torch.zeros_like(s) for s in self.stack]
        self.params = [[s[i] for s in self.stack] for i in range(k)]
        self.outers = [make_outer(cfg.outer, p) for p in self.params]
        self.val = self.data[0].val_batches()
        self.steps = [0] * k
        self.rounds = [0] * k
        self.sent = [None] * k
        self.mixed = [None] * k
        self.weight = cfg.outer.mix_weight
        self.overlap = False
        self.late = [None] * k
        self.carry = [True] * k
        self._init_wire(cfg)   # no codec: SimConfig refuses one with batched
        self.guards = guards_for(cfg, self.data)
        self.guard_counts = {"accept": 0, "check": 0, "clip": 0, "reject": 0}
        self.planned: dict[int, int] = {}   # worker -> steps of the phase it started and that has not run yet
        self.ahead: dict[int, list[torch.Tensor]] = {}  # ran ahead of the clock: its parameters before the phase
        self.batch_sizes: list[int] = []    # workers per batched phase (reported: how much batching happened)

    @property
    def num_params(self) -> int:
        return sum(s[0].numel() for s in self.stack)

    # ---- the Trainer protocol
    def plan(self, i: int, steps: int) -> None:
        self.planned[i] = steps

    def inner(self, i: int, steps: int) -> None:
        if i not in self.ahead:
            if self.planned.get(i) != steps:
                raise RuntimeError(f"worker {i} ends a phase of {steps} steps it never planned")
            self._run_planned()
        self.ahead.pop(i)

    def arrive(self, i: int) -> None:
        pass  # overlap is not simulated batched (config validation refuses it)

    # ---- the batched phase
    def _run_planned(self) -> None:
        by_steps: dict[int, list[int]] = {}
        for i, s in sorted(self.planned.items()):
            by_steps.setdefault(s, []).append(i)
        self.planned.clear()
        for steps, ws in by_steps.items():
            for i in ws:
                self.ahead[i] = [p.clone() for p in self.params[i]]
            self._phase(ws, steps)
            self.batch_sizes.append(len(ws))

    def _loss(self, params: tuple[torch.Tensor, ...], batch: torch.Tensor) -> torch.Tensor:
        # model.loss (peer/train/model.py) on one worker's parameters; the math kernel of attention, since the CPU
        # flash kernel has no vmap rule (torch falls back to a loop over workers)
        with sdpa_kernel(SDPBackend.MATH):
            logits = functional_call(self.template, dict(zip(self.names, params)), (batch[:, :-1],))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    @torch.no_grad()
    def _phase(self, ws: list[int], steps: int) -> None:
        c = self.cfg.inner
        everyone = len(ws) == len(self.params)
        idx = torch.tensor(ws)
        # all workers: step the stacks in place; a subset: on gathered copies, scattered back at the end
        p = self.stack if everyone else [s[idx] for s in self.stack]
        m = self.exp_avg if everyone else [s[idx] for s in self.exp_avg]
        v = self.exp_avg_sq if everyone else [s[idx] for s in self.exp_avg_sq]
        step_fn = vmap(grad_and_value(self._loss))
        for n in range(steps):
            batch = torch.stack([self.data[i].next_batch() for i in ws])
            parts = []
            with torch.enable_grad():
                for lo in range(0, len(ws), TRAIN_CHUNK):
                    parts.append(step_fn(tuple(x[lo:lo + TRAIN_CHUNK] for x in p), batch[lo:lo + TRAIN_CHUNK]))
            grads = [torch.cat(gs) for gs in zip(*(g for g, _ in parts))] if len(parts) > 1 else list(parts[0][0])
            loss = torch.cat([x for _, x in parts])
            if not bool(torch.isfinite(loss).all()):
                bad = [(ws[n], float(x)) for n, x in enumerate(loss) if not math.isfinite(float(x))]
                raise FloatingPointError(f"training loss became {bad[0][1]} at inner step {self.steps[bad[0][0]]} "
                                         f"of worker {bad[0][0]}: lower inner.lr")
            if c.grad_clip is not None:  # torch.nn.utils.clip_grad_norm_, per worker
                norm = torch.stack([g.pow(2).flatten(1).sum(1) for g in grads]).sum(0).sqrt()
                scale = (c.grad_clip / (norm + 1e-6)).clamp(max=1.0)
                grads = [g * _per_worker(scale, g) for g in grads]
            self._adamw(ws, p, m, v, grads, n)
            for i in ws:
                self.steps[i] += 1
        for i in ws:
            self.rounds[i] += 1
        if not everyone:
            for dst, src in ((self.stack, p), (self.exp_avg, m), (self.exp_avg_sq, v)):
                for d, s in zip(dst, src):
                    d[idx] = s

    def _adamw(self, ws: list[int], p, m, v, grads, n: int) -> None:
        """torch.optim.AdamW's update (foreach, no amsgrad), with each worker's own lr and step count; `n`: the
        step's index in the phase (the lr decay's position, SimTrainer.position)."""
        c = self.cfg.inner
        lr = torch.tensor([lr_at(self.steps[i], c, self.position(i, n)) for i in ws], dtype=torch.float64)
        t = torch.tensor([self.steps[i] + 1 for i in ws], dtype=torch.float64)  # the optimizer's step, from 1
        bc1, bc2_sqrt = 1 - c.beta1 ** t, (1 - c.beta2 ** t).sqrt()
        decay, step_size = (1 - lr * c.weight_decay).float(), (lr / bc1).float()
        for pi, mi, vi, g in zip(p, m, v, grads):
            pi.mul_(_per_worker(decay, pi))
            mi.lerp_(g, 1 - c.beta1)
            vi.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
            denom = (vi.sqrt() / _per_worker(bc2_sqrt.float(), vi)).add_(1e-8)
            pi.addcdiv_(mi * _per_worker(step_size, mi), denom, value=-1.0)

    # ---- measurement
    @torch.no_grad()
    def _evaluate(self) -> dict:
        """As SimTrainer._evaluate, vmapped; a worker that ran ahead of the clock is read from before its phase."""
        seen = [s.clone() for s in self.stack] if self.ahead else self.stack
        for i, before in self.ahead.items():
            for s, b in zip(seen, before):
                s[i] = b
        k = len(self.params)
        fwd = vmap(self._loss, in_dims=(0, None))
        losses = torch.zeros(k, dtype=torch.float64)
        for lo in range(0, k, EVAL_CHUNK):
            chunk = tuple(s[lo:lo + EVAL_CHUNK] for s in seen)
            for b in self.val:
                losses[lo:lo + EVAL_CHUNK] += fwd(chunk, b).double()
        losses /= len(self.val)
        mean = [s.sum(0) / k for s in seen]
        for dst, src in zip(self.eval_model.parameters(), mean):
            dst.copy_(src)
        mean_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in mean))
        dist = torch.stack([(s - t).double().pow(2).flatten(1).sum(1) for s, t in zip(seen, mean)]).sum(0).sqrt()
        from gasloc.peer.train.data import evaluate
        return {"val_loss_mean": float(losses.mean()), "val_loss_avg_model": evaluate(self.eval_model, self.val),
                "consensus": float(dist.mean()) / mean_norm, "val_loss_workers": [float(x) for x in losses]}


def _per_worker(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (K,) vector shaped to broadcast over a (K, ...) stacked tensor."""
    return x.view(-1, *([1] * (like.dim() - 1)))
