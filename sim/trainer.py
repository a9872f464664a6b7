"""The tensor side of a simulated run: K models (or their stacked form, sim/batched.py), each worker's shard,
AdamW and outer update, behind the engines' Trainer protocol (sim/engine.py)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gasloc.peer.train.data import BLOCK_TOKENS, WindowSampler, build_data, evaluate
from gasloc.peer.train.inner import inner_step, make_inner_optimizer
from gasloc.peer.train.model import build_model
from gasloc.peer.train.outer import make_outer, round_mix_momentum_applied
from gasloc.protocol.averaging import exact_mean, mix, pair_weight, round_mix_momentum
from gasloc.protocol.codec import parse as codec_parse
from gasloc.protocol.codec import probe, probe_steps
from gasloc.protocol.decision import MixJudge, PrivateChecks
from gasloc.sim.config import SimConfig


def worker_data(cfg: SimConfig) -> list:
    """Worker i's data: shard i of K, disjoint from the others' - while the corpus has a block for each worker.
    Beyond that (the embedded corpus has ~220 blocks of BLOCK_TOKENS; the scale suite runs 1,000 workers) worker i
    reads shard i mod S of S = the number of blocks, with its own sampling stream, so workers that share a shard
    draw different windows from it."""
    probe = build_data(cfg.data, cfg.model.seq_len)[0]
    blocks = max(len(getattr(probe, "train_tokens", ())) // BLOCK_TOKENS, 1)
    shards = cfg.workers if not hasattr(probe, "train_tokens") else min(cfg.workers, blocks)
    out = []
    for i in range(cfg.workers):
        d = build_data(cfg.data.model_copy(update={"shard_index": i % shards, "num_shards": shards}),
                       cfg.model.seq_len)[0]
        if i >= shards:  # a second reader of the shard: its own windows (the first keeps the shard's stream)
            d.train.stream = f"{d.train.stream}-reader-{i // shards}"
        out.append(d)
    return out


@dataclass
class WorkerGuard:
    """A worker's mix decision (protocol/decision.py) and the stream of private batches it checks offers on: windows
    of its own shard from a seeded stream of their own (seeded, so a run is reproducible; a live peer draws them
    from the OS's randomness, data.private_batches)."""
    judge: MixJudge
    batches: object


def guards_for(cfg: SimConfig, data: list) -> list[WorkerGuard]:
    out = []
    for i, d in enumerate(data):
        train = getattr(d, "train", None)
        if isinstance(train, WindowSampler):
            batches = WindowSampler(train.tokens, train.blocks, train.seq_len, train.batch_size,
                                    seed=cfg.seed * 7919 + i, stream="private-check", vocab_size=train.vocab_size)
        else:  # a streamed dataset: its validation batches (they cannot be sampled at random)
            batches = _Cycle(d.val_batches())
        out.append(WorkerGuard(MixJudge(cfg.guard, seed=cfg.seed * 1_000_003 + i), batches))
    return out


class _Cycle:
    def __init__(self, batches: list):
        self.batches, self.n = batches, 0

    def next_batch(self):
        self.n += 1
        return self.batches[(self.n - 1) % len(self.batches)]


class SimTrainer:
    """The tensor side of the engine's Trainer protocol: K models, optimizers, shards and outer updates."""

    def __init__(self, cfg: SimConfig):
        self.cfg, k = cfg, cfg.workers
        data = worker_data(cfg)
        vocab = build_data(cfg.data, cfg.model.seq_len)[1].vocab_size
        # every worker starts from the same weights, as DiLoCo and a swarm joining from one checkpoint do
        self.models = [build_model(cfg.model, vocab, seed=cfg.seed) for _ in range(k)]
        self.eval_model = build_model(cfg.model, vocab, seed=cfg.seed)
        self.params = [list(m.parameters()) for m in self.models]
        self.opts = [make_inner_optimizer(m, cfg.inner) for m in self.models]
        self.outers = [make_outer(cfg.outer, p) for p in self.params]
        self.data = data
        self.val = data[0].val_batches()
        self.steps = [0] * k
        self.rounds = [0] * k  # inner phases run: the lr decay's position is rounds x inner_steps, as a live peer's
        self.sent: list[list[torch.Tensor] | None] = [None] * k
        self.mixed: list[list[torch.Tensor] | None] = [None] * k
        self.weight = cfg.outer.mix_weight
        self.overlap = cfg.outer.overlap
        self.late: list[tuple[list[torch.Tensor], list[torch.Tensor]] | None] = [None] * k  # overlap: (sent, mixed)
        self.carry = [True] * k  # this round's mix correction gets outer momentum (protocol/decision.py momentum)
        self._init_wire(cfg)
        self.guards = guards_for(cfg, data)
        self.guard_counts = {"accept": 0, "check": 0, "clip": 0, "reject": 0}

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params[0])

    # ---- Trainer protocol (sim/engine.py)
    def plan(self, i: int, steps: int) -> None:
        pass  # each worker's steps run when its phase ends (inner)

    def position(self, i: int, n: int) -> int:
        """Where worker i's n-th step of its current inner phase is in the run, for the lr decay: rounds x
        inner_steps + n, as a live peer counts it (peer/daemon.py)."""
        return self.rounds[i] * self.cfg.inner.inner_steps + n

    def inner(self, i: int, steps: int) -> None:
        for n in range(steps):
            inner_step(self.models[i], self.opts[i], self.data[i].next_batch(), self.steps[i], self.cfg.inner,
                       position=self.position(i, n))
            self.steps[i] += 1
        self.rounds[i] += 1

    def arrive(self, i: int) -> None:
        if self.late[i] is not None:  # overlap: the previous round's mix, added where it arrived
            with round_mix_momentum_applied(self.outers[i], self._kappa(i)):
                self.outers[i].late_mix(self.params[i], *self.late[i])
            self.late[i] = None

    def _kappa(self, i: int) -> float:
        """Worker i's kappa this round, as a live peer's (protocol/averaging.py round_mix_momentum)."""
        return round_mix_momentum(self.cfg.outer.mix_momentum, self.codec_kappa, self.carry[i])

    def send(self, i: int) -> int:
        self.arrive(i)  # a mix that has not arrived yet is waited for (the engine's clock charges the wait)
        self.sent[i] = self.outers[i].outgoing(self.params[i])
        c = self.codec
        self.wire[i] = self.sent[i] if c is None or c.lossless or c.seeded else [
            c.decode(c.encode(t, generator=self.rngs[i]), torch.empty_like(t)) for t in self.sent[i]]
        return sum(t.numel() for t in self.sent[i])

    def mix_round(self, partners: Mapping[int, list[int]]) -> None:
        """Edge weights are symmetric (w_ij = w_ji), so every round keeps the swarm mean: the configured weight,
        else the codec's (a pairwise one), else the Metropolis weight 1/(1 + max(deg_i, deg_j)) - 1/2 for a plain
        pair (the pair mean), 1/3 where either side has two partners this round."""
        degree = {i: len(ps) for i, ps in partners.items()}
        codec_w = self.codec.mix_weight if self.codec is not None else None   # only pairwise codecs have one
        if self.codec is not None and self.codec.seeded:
            self._seeded_wire(partners)
        for i, ps in partners.items():
            # symmetric mixing of the wire forms: z_i = y_i + sum_j w (Q(y_j) - Q(y_i)), the pair's mean exact for
            # any codec (protocol/averaging.py mix_pair_); `own` below is Q(y_i), y_i's rounding added back last
            own = self._wire_of(i)
            theirs = {j: self.wire[(i, j)] if (i, j) in self.wire else self._wire_of(j) for j in ps}
            if self.cfg.guard.enabled:  # each worker judges what it received, as a live peer does
                theirs = self._guarded(i, theirs)
            groups: dict[float, list[int]] = {}
            for j in theirs:
                w = pair_weight(self.weight, codec_w, max(degree[i], degree[j]))
                groups.setdefault(w, []).append(j)
            if not groups:
                self.mixed[i] = self.sent[i]
                continue
            # z = own + sum_j w_j (x_j - own), one protocol.mix call per distinct weight
            parts = [mix(own, [theirs[j] for j in js], w) for w, js in groups.items()]
            for extra in parts[1:]:
                torch._foreach_add_(parts[0], torch._foreach_sub(extra, own))
            if own is not self.sent[i]:
                torch._foreach_add_(parts[0], torch._foreach_sub(self.sent[i], own))
            self.mixed[i] = parts[0]

    def _init_wire(self, cfg: SimConfig) -> None:
        """The wire form of what each worker sent this round (protocol/codec.py), what its partners receive and
        what it mixes against; the sent tensors themselves without a codec."""
        self.codec = codec_parse(cfg.codec) if cfg.codec is not None else None
        self.wire: dict = dict.fromkeys(range(cfg.workers))   # i -> its wire form; (i, j): j's, as i decodes it
        self.rngs = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + i) for i in range(cfg.workers)]
        self.pair_seed = 0   # seeded codecs: counts mix rounds, for each pair's seed
        # the kappa the codec warrants (every worker runs the one codec, so both sides of a pair alike); a barrier
        # run's all-reduce travels lossless and its pairwise rounds are solo (no correction): none there
        self.codec_kappa = self.codec.mix_momentum if self.codec is not None and not cfg.barrier else None

    def _wire_of(self, i: int) -> list[torch.Tensor]:
        """What worker i's partners receive: its sent tensors without a (lossy) codec, else their wire form."""
        return self.sent[i] if self.codec is None or self.codec.lossless else self.wire[i]

    def exchange_seed(self, i: int, j: int) -> int:
        """The seed both sides of this round's exchange between i and j share (a live exchange's reply carries it)."""
        return hash((self.pair_seed, min(i, j), max(i, j))) & 0x7FFFFFFF

    def _seeded_wire(self, partners: Mapping[int, list[int]]) -> None:
        """A seeded codec (sparse blocks, shared dither): each pair encodes with a seed both sides share (a live
        exchange's reply carries it); `wire[i]` becomes i's own wire form (a sparse codec's: its own tensors where
        no block was sent) and `wire[(i, j)]` what i decodes of j's payload (sparse: over wire[i])."""
        c, self.pair_seed = self.codec, self.pair_seed + 1
        for ps in partners.values():
            if len(ps) > 1:
                raise ValueError(f"codec {c.name} is pairwise: one partner a round")
        if c.modulo:
            self._modulo_wire(partners)
            return
        payloads = {}
        for i, ps in partners.items():
            for j in ps:
                seed = self.exchange_seed(i, j)
                payloads[i] = (seed, [c.encode(t, generator=self.rngs[i], seed=seed) for t in self.sent[i]])
        for i, ps in partners.items():
            if ps:
                seed, mine = payloads[i]
                self.wire[i] = [c.decode(p, torch.empty_like(t), seed, fill=t if c.sparse else None)
                                for p, t in zip(mine, self.sent[i])]
        for i, ps in partners.items():
            for j in ps:
                seed, theirs = payloads[j]
                self.wire[(i, j)] = [c.decode(p, torch.empty_like(t), seed, fill=t if c.sparse else None)
                                     for p, t in zip(theirs, self.wire[i])]

    def _modulo_wire(self, partners: Mapping[int, list[int]]) -> None:
        """A modulo codec: each pair sizes its steps from both sides' probes (a live exchange's request and reply
        carry them), and each side decodes the other's codes against its own tensors and codes; `wire[i]` is i's own
        tensors (its own wire form), `wire[(i, j)]` = y_i + step d_ij."""
        c = self.codec
        numels = [p.numel() for p in self.params[0]]
        payloads = {}
        for i, ps in partners.items():
            for j in ps:
                seed = self.exchange_seed(i, j)
                steps = probe_steps(c, numels, probe(self.sent[i], seed), probe(self.sent[j], seed))
                payloads[i] = (seed, steps, [c.encode(t, generator=self.rngs[i], seed=seed, step=st)
                                             for t, st in zip(self.sent[i], steps)])
        for i, ps in partners.items():
            if ps:
                self.wire[i] = self.sent[i]
            for j in ps:
                seed, steps, mine = payloads[i]
                theirs = payloads[j][2]
                self.wire[(i, j)] = [c.decode(p, torch.empty_like(t), seed, fill=t, ref=r, step=st)
                                     for p, r, t, st in zip(theirs, mine, self.sent[i], steps)]

    def _guarded(self, i: int, theirs: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
        """Worker i's partners' tensors after its mix decision (protocol/decision.py), as a live peer's: clipped
        toward its own per tensor, or left out; every offer checked on a batch of worker i's own private stream.
        `carry[i]`: whether this round's correction gets outer momentum (not from a partner it barely knows)."""
        own, out = self._wire_of(i), {}
        self.carry[i] = True
        model = len(own) == len(self.params[i])  # else NoLoCo: no batch check
        draw = self.guards[i].batches.next_batch
        checks = PrivateChecks(self._loss_at, lambda n: [draw() for _ in range(n)], self.cfg.guard.recheck_batches)
        for j, t in theirs.items():
            d = self.guards[i].judge.decide(own, t, partner=str(j), own_round=self.rounds[i],
                                            partner_round=self.rounds[j], loss=checks.loss if model else None,
                                            recheck=checks.recheck if model else None)
            self.guard_counts[d.verdict.action] += 1
            if not d.rejected:
                out[j] = d.apply(own, t)
                self.carry[i] = self.carry[i] and d.momentum
        return out

    @torch.no_grad()
    def _loss_at(self, point: list[torch.Tensor], batches: list[torch.Tensor] | None = None) -> float:
        """Loss of `point` on `batches` (default: one validation batch)."""
        for dst, src in zip(self.eval_model.parameters(), point):
            dst.copy_(src)
        return evaluate(self.eval_model, self.val[:1] if batches is None else batches)

    def allreduce(self, workers: list[int]) -> None:
        if self.weight is None:  # the exact mean, computed once (every update reads `mixed` without writing it)
            mean = exact_mean([self.sent[j] for j in workers])
            for i in workers:
                self.mixed[i] = mean
        else:
            for i in workers:
                self.mixed[i] = mix(self.sent[i], [self.sent[j] for j in workers if j != i], self.weight)

    def apply(self, i: int) -> None:
        if self.overlap:  # solo now; the mix is added where it lands in the next inner phase (arrive)
            self.outers[i].apply(self.params[i], self.sent[i])
            if self.mixed[i] is not self.sent[i]:
                self.late[i] = (self.sent[i], self.mixed[i])
        else:
            with round_mix_momentum_applied(self.outers[i], self._kappa(i)):
                self.outers[i].apply(self.params[i], self.mixed[i])
        self.sent[i] = self.mixed[i] = self.wire[i] = None
        for key in [key for key in self.wire if isinstance(key, tuple) and key[0] == i]:
            del self.wire[key]

    @torch.no_grad()
    def adopt(self, i: int, j: int, epoch: int) -> None:
        """DiLoCo behind (sim/groups.py): worker i takes over worker j's state at its last step - the anchor and the
        outer state, as a live peer downloads them - and the round position with it; its own inner optimizer stays
        and its round's inner work is dropped (peer/daemon.py `_resync`)."""
        torch._foreach_copy_(self.params[i], self.outers[j].anchor)
        self.outers[i].load_state_dict(self.outers[j].state_dict(), self.params[i])
        self.rounds[i] = epoch
        self.sent[i] = self.mixed[i] = self.wire[i] = None

    # ---- measurement
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Overlap: each worker is read with its in-flight mix added (the model it checkpoints at shutdown), not at
        the provisional point it trains from meanwhile."""
        saved = {i: [p.clone() for p in self.params[i]] for i, late in enumerate(self.late) if late is not None}
        for i in saved:
            torch._foreach_add_(self.params[i], self.outers[i].late_shift(*self.late[i]))
        try:
            return self._evaluate()
        finally:
            for i, copy in saved.items():
                torch._foreach_copy_(self.params[i], copy)

    def _evaluate(self) -> dict:
        losses = [evaluate(m, self.val) for m in self.models]
        mean = exact_mean(self.params)
        for dst, src in zip(self.eval_model.parameters(), mean):
            dst.copy_(src)
        mean_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in mean))
        dists = [math.sqrt(sum(float((p - q).double().pow(2).sum()) for p, q in zip(ps, mean)))
                 for ps in self.params]
        return {"val_loss_mean": sum(losses) / len(losses), "val_loss_avg_model": evaluate(self.eval_model, self.val),
                "consensus": sum(dists) / len(dists) / mean_norm, "val_loss_workers": losses}
