"""`gasloc sim`'s config tree: the swarm, the virtual clock, and the same model/data/inner/outer sections as a
live peer (so a setting tuned here is the setting used there)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gasloc.peer.train.data import DataConfig
from gasloc.peer.train.inner import InnerConfig
from gasloc.peer.train.model import ModelConfig
from gasloc.peer.train.outer import OuterConfig, fit_to_h
from gasloc.protocol.codec import check_name as check_codec
from gasloc.protocol.guard import GuardConfig
from gasloc.protocol.matching import Topology
from gasloc.sim.clock import PROFILES, Link


class ClockConfig(BaseModel):
    """The virtual clock. Defaults describe a ~100M-parameter model trained by volunteers on 1 Gbit/s links."""
    model_config = ConfigDict(extra="forbid")

    profile: str = Field("uniform", description=f"per-worker speeds and links: one of {', '.join(PROFILES)}, or "
                         "a TOML/JSON file with a list 'workers' of {seconds_per_step, bandwidth_mbps, latency_ms}")
    seconds_per_step: float = Field(0.3, gt=0, description="virtual seconds per inner step (base value)")
    bandwidth_mbps: float = Field(1000.0, gt=0, description="access-link bandwidth, Mbit/s (base value)")
    latency_ms: float = Field(25.0, ge=0, description="one-way access-link latency, ms (base value); a pair's "
                              "link has the sum of both")
    bytes_per_param: float = Field(2.0, gt=0, description="bytes per communicated number on the wire (2: fp16)")
    charge_codec: bool = Field(True, description="with a codec set: charge its payload's bytes; false: "
                               "bytes_per_param a parameter whatever the codec, so that a codec's run keeps the "
                               "event schedule (the partners) of a run charged that many bytes (4: the fp32 wire's) "
                               "and a comparison paired by seed sees the codec's rounding apart from its bytes")
    nominal_params: int | None = Field(100_000_000, ge=1, description="model size the message bytes are scaled "
                                       "to (the simulated model is tiny; the clock charges as if it had this many "
                                       "parameters); unset: the simulated model's own size")
    allreduce_setup_s: float = Field(0.0, ge=0, description="fixed cost of every all-reduce before any byte moves "
                                     "(hivemind's matchmaking: bench/hetero.py runs DiLoCo with "
                                     "diloco.matchmaking_time_s = 5)")
    link_efficiency: float = Field(1.0, gt=0, le=1, description="share of the nominal bandwidth a transfer "
                                   "gets (pair exchanges and all-reduces alike); bench/hetero.py's measured "
                                   "exchanges ran at 0.7 of its tbf rates (docs/sim-results.md)")
    allreduce_efficiency: float | None = Field(None, gt=0, le=1, description="the same for DiLoCo's all-reduce "
                                               "on the live schedule (sim/groups.py; bench/hetero.py: 0.69, hivemind's "
                                               "butterfly all-reduce); unset: link_efficiency")
    match_timeout_s: float | None = Field(None, ge=0, description="schedule async: how long a ready worker waits "
                                          "for a partner before a solo round; unset: until a neighbour is ready")

    def base_link(self) -> Link:
        return Link(self.seconds_per_step, self.bandwidth_mbps * 1e6, self.latency_ms / 1e3)

    def effective(self, links: list[Link], allreduce: bool = False) -> list[Link]:
        """The links as transfers see them: bandwidth times link_efficiency (allreduce_efficiency for DiLoCo's
        all-reduce where set)."""
        eff = self.allreduce_efficiency if allreduce and self.allreduce_efficiency is not None else self.link_efficiency
        if eff == 1.0:
            return links
        return [Link(x.seconds_per_step, x.bandwidth_bps * eff, x.latency_s) for x in links]


class SearchConfig(BaseModel):
    """Schedule live: the live peer's partner search (peer config [swarm] and exchange_timeout_s of [exchange]);
    same names and defaults, so a value tuned here is the value to set there."""
    model_config = ConfigDict(extra="forbid")

    partner_deadline_s: float = Field(10.0, gt=0, description="per round, how long to look for a partner before "
                                      "a solo round")
    retry_interval_s: float = Field(0.25, gt=0, description="pause between partner attempts when nobody is ready")
    exchange_timeout_s: float = Field(30.0, gt=0, description="an exchange that would take longer is cut there: "
                                      "nothing is mixed and the caller backs off from that partner")
    min_backoff_s: float = Field(2.0, gt=0, description="first backoff from a partner whose exchange failed")
    max_backoff_s: float = Field(60.0, gt=0, description="longest backoff from a repeatedly failing partner")
    busy_cooldown_s: float = Field(0.5, ge=0, description="skip a partner that answered busy for this long")
    avoid_recent_partners: int = Field(3, ge=0, description="pass over this many most recent partners during the "
                                       "first half of a search, while someone else is due in it")
    slower_link_ratio: float = Field(0.0, ge=0, description="for the first half of a search, pass over (and answer "
                                     "busy to) peers whose last exchange with us ran this many times slower than "
                                     "our best; 0 = off (must be above 1 when set)")
    slower_link_open_share: float = Field(0.25, ge=0, le=1, description="with slower_link_ratio: this share of "
                                          "searches stays open to every link")
    matchmaking_time_s: float | None = Field(None, gt=0, description="schedule live, DiLoCo: run hivemind's "
                                             "matchmaking as the live peer does (diloco.matchmaking_time_s; "
                                             "sim/groups.py): a group closes when it has the opener's target "
                                             "(1 + the peers it lists) or this long after it opened; unset: "
                                             "every round waits for every worker (lock-step)")
    discovery_s: float = Field(0.0, ge=0, description="schedule live: for this long after the start, each worker "
                               "lists only a random share (discovery_share) of the others, as live peers whose "
                               "listings are still filling; 0: everyone from the start")
    allreduce_jitter: float = Field(0.0, ge=0, le=0.5, description="schedule live, DiLoCo with "
                                    "matchmaking_time_s: coefficient of variation of an all-reduce's duration "
                                    "(uniform around the clock's time; bench/hetero.py measured 0.10)")
    discovery_share: float = Field(1.0, ge=0, le=1, description="with discovery_s: the chance that a worker lists "
                                   "a given other worker before discovery_s (one draw per worker pair and seed)")
    initial_group_size: int | None = Field(None, ge=2, description="schedule live, DiLoCo with "
                                           "matchmaking_time_s: the start barrier (diloco.initial_group_size): the "
                                           "first group needs this many workers; unset: all of them, as "
                                           "bench/hetero.py runs it")

    @model_validator(mode="after")
    def _check(self) -> SearchConfig:
        if self.max_backoff_s < self.min_backoff_s:
            raise ValueError(f"max_backoff_s {self.max_backoff_s} is below min_backoff_s {self.min_backoff_s}")
        if 0 < self.slower_link_ratio <= 1:
            raise ValueError(f"slower_link_ratio {self.slower_link_ratio} must be above 1 (how many times slower a "
                             "link is passed over) or 0 (off)")
        return self


class SimConfig(BaseModel):
    """K workers trained in one process, each on its own shard, under a virtual clock."""
    model_config = ConfigDict(extra="forbid")

    workers: int = Field(8, ge=1, le=4096, description="K: simulated workers")
    rounds: int = Field(50, ge=1, description="outer rounds per worker on average (the run ends after K*rounds "
                        "worker-rounds; in a homogeneous swarm every worker does exactly this many)")
    seed: int = Field(0, description="seed of the model init (same for all workers) and of the matchings")
    topology: Topology = Field("random", description="complete (everyone averages with everyone: DiLoCo's "
                               "all-reduce) | random (random pairs) | ring | exponential; diloco always all-reduces")
    schedule: Literal["live", "lockstep", "async"] = Field(
        "live", description="live: every worker runs the live peer's partner search (protocol/search.py) on the "
        "virtual clock - busy answers, partner deadline, backoff, the slower-link rule (section [search]); "
        "lockstep: every worker does round r then r+1, each on its own clock, a pair waiting only for itself; "
        "async: no shared round counter, a ready worker pairs with a ready neighbour. DiLoCo, the complete "
        "topology and local run lockstep under every schedule (a live all-reduce waits for everyone)")
    num_partners: Literal[1, 2] = Field(1, description="partners per round: one matching, or the union of two")
    bandwidth_weighted: bool = Field(False, description="pick pairs with probability growing with their link "
                                     "bandwidth (min of the two workers')")
    eval_every: int = Field(5, ge=1, description="evaluate every this many rounds (per worker, on average)")
    max_sim_time_s: float | None = Field(None, gt=0, description="also stop once the virtual clock passes this")
    target_val_loss: float | None = Field(None, gt=0, description="also stop at the first evaluation whose mean "
                                          "validation loss is at or below this")
    threads: int = Field(1, ge=1, le=64, description="torch CPU threads")
    batched: bool = Field(False, description="run the workers' inner steps batched (stacked models, one vmapped "
                          "step for every worker whose phase has started; sim/batched.py): the same maths, many "
                          "times faster for small models and many workers; schedules live and lockstep, no overlap")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(seq_len=64))
    data: DataConfig = Field(default_factory=lambda: DataConfig(batch_size=4, val_batches=2))
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    clock: ClockConfig = Field(default_factory=ClockConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig, description="robust mixing, as a live peer runs it "
                               "(each worker judges each partner from its own distance history; no trust-based "
                               "partner choice: the matchings are the topology's)")
    search: SearchConfig = Field(default_factory=SearchConfig)
    codec: str | None = Field(None, description="wire codec of the pairwise exchange, as a live peer's "
                              "exchange.codec (protocol/codec.py): each worker mixes the wire form of both sides "
                              "and the clock charges the codec's bytes (unless clock.charge_codec is false); unset: the "
                              "tensors as they are, charged clock.bytes_per_param a parameter")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.codec is not None:
            check_codec(self.codec)
            if self.batched:
                raise ValueError("codec is not modelled by the batched trainer: unset batched or codec")
        if self.data.shard_index is not None or self.data.num_shards != 1:
            raise ValueError("data.shard_index and data.num_shards are set by the simulator (worker i reads shard "
                             "i of K); remove them")
        if self.outer.communicates and self.workers < 2:
            raise ValueError(f"algorithm {self.outer.algorithm!r} needs at least 2 workers")
        if self.outer.overlap and self.schedule != "lockstep":
            raise ValueError("outer.overlap is simulated on the lockstep schedule only; use --schedule lockstep or "
                             "drop --overlap")
        if self.batched and (self.outer.overlap or self.schedule == "async"):
            raise ValueError("batched inner steps are simulated on schedules live and lockstep without overlap; "
                             "drop --batched, --overlap or --schedule async")
        if self.schedule == "live" and self.num_partners != 1 and not self.barrier:
            raise ValueError("schedule live runs the live peer's search, which finds one partner per round; use "
                             "--num-partners 1 or --schedule lockstep")
        most = self.workers - 1 if self.topology == "complete" else self.num_partners
        if self.outer.mix_weight is not None and self.outer.mix_weight * most > 1:
            raise ValueError(f"outer.mix_weight {self.outer.mix_weight} times {most} partner(s) exceeds 1, so the "
                             "mix is no convex combination: lower the weight")
        self.outer = fit_to_h(self.outer, self.inner.inner_steps)
        return self

    @property
    def barrier(self) -> bool:
        """Whether a round waits for every worker (DiLoCo's all-reduce, or the complete topology)."""
        return self.outer.algorithm == "diloco" or (self.outer.communicates and self.topology == "complete")
