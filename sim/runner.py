"""One simulated run: K workers of the model in this process, each on its own shard with its own AdamW, driven by
the engine's virtual clocks through the same inner loop, outer updates and mixing rules as a live peer.

`run(cfg)` returns a JSON-able dict; the same config gives the same dict, bit for bit.
"""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable

import numpy as np
import torch

from gasloc.peer.train.inner import steps_this_round
from gasloc.protocol.codec import parse as codec_parse
from gasloc.protocol.matching import bandwidth_weights, graph_edges
from gasloc.protocol.partners import Backoff
from gasloc.protocol.search import SearchRules
from gasloc.sim.batched import BatchedTrainer
from gasloc.sim.clock import build_links
from gasloc.sim.config import SimConfig
from gasloc.sim.engine import AsyncEngine
from gasloc.sim.groups import GroupEngine
from gasloc.sim.live import LiveEngine
from gasloc.sim.lockstep import LockstepEngine
from gasloc.sim.trainer import SimTrainer

log = logging.getLogger(__name__)

# progress(done worker-rounds, total worker-rounds, virtual seconds, last mean val loss or None)
Progress = Callable[[int, int, float, float | None], None]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run(cfg: SimConfig, progress: Progress | None = None) -> dict:
    """Simulate `cfg` and return the result dict (config, evals, final_val_loss, bytes_sent_per_worker, ...)."""
    # CPU kernels are deterministic for a fixed thread count (tests check the JSON is identical run to run);
    # torch.use_deterministic_algorithms would add nothing here but a 3 s import
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        _seed_everything(cfg.seed)
        return _run(cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: SimConfig, progress: Progress | None) -> dict:
    k = cfg.workers
    links = build_links(cfg.clock.profile, k, cfg.clock.base_link())
    moving = cfg.clock.effective(links)  # what the engines' transfers see (the result reports the nominal links)
    if cfg.batched:
        trainer: SimTrainer = BatchedTrainer(cfg)
    else:
        trainer = SimTrainer(cfg)
    scale = cfg.clock.nominal_params / trainer.num_params if cfg.clock.nominal_params else 1.0
    # a codec's bytes (scales and padding of the simulated model's tensors included), else the clock's figure; the
    # clock's figure also where a codec's bytes are not charged (charge_codec false): its run then keeps the event
    # schedule, partners included, of a lossless run charged that figure, and a paired comparison sees the codec's
    # rounding alone
    bytes_per_param = (codec_parse(cfg.codec).bits_per_param([p.numel() for p in trainer.params[0]]) / 8
                        if cfg.codec is not None and cfg.clock.charge_codec else cfg.clock.bytes_per_param)
    edges = graph_edges(cfg.topology, k)
    weights = bandwidth_weights(k, [x.bandwidth_bps for x in links], edges) if cfg.bandwidth_weighted else None
    sc = cfg.search
    common = dict(barrier=cfg.barrier, communicates=cfg.outer.communicates,
                  steps_for=lambda i: steps_this_round(cfg.inner, links[i].seconds_per_step),
                  wire_bytes=lambda numel: numel * bytes_per_param * scale,
                  rng=random.Random(cfg.seed), num_partners=cfg.num_partners, weights=weights,
                  allreduce_setup_s=cfg.clock.allreduce_setup_s)
    engine: LockstepEngine | AsyncEngine | LiveEngine | GroupEngine
    if cfg.schedule == "live" and cfg.outer.algorithm == "diloco" and sc.matchmaking_time_s is not None:
        engine = GroupEngine(cfg.clock.effective(links, allreduce=True), matchmaking_s=sc.matchmaking_time_s, discovery_s=sc.discovery_s,
                             discovery_share=sc.discovery_share, jitter=sc.allreduce_jitter, seed=cfg.seed,
                             initial_group=sc.initial_group_size, **common)
    elif cfg.schedule == "live" and cfg.outer.communicates and not cfg.barrier:
        rules = SearchRules(partner_deadline_s=sc.partner_deadline_s, retry_interval_s=sc.retry_interval_s,
                            exchange_timeout_s=sc.exchange_timeout_s, bandwidth_weighting=cfg.bandwidth_weighted,
                            slower_link_ratio=sc.slower_link_ratio, slower_link_open_share=sc.slower_link_open_share)
        engine = LiveEngine(moving, edges, rules=rules,
                            backoff=Backoff(sc.min_backoff_s, sc.max_backoff_s, sc.busy_cooldown_s),
                            avoid_recent=sc.avoid_recent_partners, seed=cfg.seed, discovery_s=sc.discovery_s,
                            discovery_share=sc.discovery_share, round_budget=k * cfg.rounds, **common)
    elif cfg.schedule in ("lockstep", "live"):
        engine = LockstepEngine(moving, cfg.topology, overlap=cfg.outer.overlap, **common)
    else:
        engine = AsyncEngine(moving, edges, match_timeout_s=cfg.clock.match_timeout_s, **common)
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
    total = k * cfg.rounds
    evals: list[dict] = []

    def record(t: float) -> dict:
        e = {"step": engine.total_steps // k, "round": engine.total_rounds / k, "sim_time_s": t,
             "tokens": engine.total_steps * tokens_per_step, **trainer.evaluate()}
        evals.append(e)
        log.info("round=%.2f sim_time_s=%.1f val_loss_mean=%.4f val_loss_avg_model=%.4f consensus=%.4g",
                 e["round"], t, e["val_loss_mean"], e["val_loss_avg_model"], e["consensus"])
        return e

    record(0.0)
    next_eval, stopped_by = cfg.eval_every * k, "max_sim_time"
    horizon = cfg.max_sim_time_s if cfg.max_sim_time_s is not None else math.inf
    for t in engine.run(trainer, horizon):
        done = engine.total_rounds
        if done >= next_eval or done >= total:
            next_eval = (done // (cfg.eval_every * k) + 1) * cfg.eval_every * k
            e = record(t)
            if cfg.target_val_loss is not None and e["val_loss_mean"] <= cfg.target_val_loss:
                stopped_by = "target_val_loss"
                break
        if progress is not None:
            progress(min(done, total), total, t, evals[-1]["val_loss_mean"])
        if done >= total:
            stopped_by = "rounds"
            break
    if evals[-1]["sim_time_s"] != engine.now:
        record(engine.now)
    ws = engine.workers
    return {
        "config": cfg.model_dump(mode="json"),
        "links": [x.as_dict() for x in links],
        "model_params": trainer.num_params,
        "guard": dict(trainer.guard_counts),  # verdicts on partners (all zero with guard.enabled = false)
        "bytes_scale": scale,
        "evals": evals,
        "final_val_loss": evals[-1]["val_loss_mean"],
        "final_sim_time_s": evals[-1]["sim_time_s"],
        "tokens": evals[-1]["tokens"],
        "stopped_by": stopped_by,
        "bytes_sent_per_worker": [w.bytes_sent for w in ws],
        "rounds_per_worker": [w.rounds for w in ws],
        "inner_steps_per_worker": [w.steps for w in ws],
        "idle_s_per_worker": [w.idle_s for w in ws],
        # live: calls, busy, paired/solo rounds; groups: all-reduce sizes, solo rounds
        "search": engine.stats if isinstance(engine, LiveEngine | GroupEngine) else None,
        "pairs_by_links": _pairs_by_links(engine, cfg.clock.link_efficiency),
        # batched: how many workers' inner phases ran per batch (mean, max), i.e. how much the batching bought
        "batching": _batching(trainer),
    }


def _batching(trainer) -> dict | None:
    sizes = getattr(trainer, "batch_sizes", None)
    if not sizes:
        return None
    return {"phases": len(sizes), "mean_workers": sum(sizes) / len(sizes), "max_workers": max(sizes)}


def _pairs_by_links(engine, efficiency: float) -> dict[str, int] | None:
    """Schedule live, few link classes: completed exchanges by the partners' nominal Mbit/s ("3/30": slow with
    fast)."""
    if not isinstance(engine, LiveEngine) or len({x.bandwidth_bps for x in engine.links}) > 4:
        return None
    return {f"{round(a / efficiency / 1e6, 3):g}/{round(b / efficiency / 1e6, 3):g}": n
            for (a, b), n in sorted(engine.pairs.items())}
