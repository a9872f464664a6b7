"""`gasloc sim`'s config tree: the swarm, the virtual clock, and the same model/data/inner/outer sections as a
live peer (so a setting tuned here is the setting used there)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gasloc.peer.train.data import DataConfig
from gasloc.peer.train.inner import InnerConfig
from gasloc.peer.train.model import ModelConfig
from gasloc.peer.train.outer import OuterConfig
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
    nominal_params: int | None = Field(100_000_000, ge=1, description="model size the message bytes are scaled "
                                       "to (the simulated model is tiny; the clock charges as if it had this many "
                                       "parameters); unset: the simulated model's own size")
    match_timeout_s: float | None = Field(None, ge=0, description="schedule async: how long a ready worker waits "
                                          "for a partner before a solo round; unset: until a neighbour is ready")

    def base_link(self) -> Link:
        return Link(self.seconds_per_step, self.bandwidth_mbps * 1e6, self.latency_ms / 1e3)


class SimConfig(BaseModel):
    """K workers trained in one process, each on its own shard, under a virtual clock."""
    model_config = ConfigDict(extra="forbid")

    workers: int = Field(8, ge=1, le=256, description="K: simulated workers")
    rounds: int = Field(50, ge=1, description="outer rounds per worker on average (the run ends after K*rounds "
                        "worker-rounds; in a homogeneous swarm every worker does exactly this many)")
    seed: int = Field(0, description="seed of the model init (same for all workers) and of the matchings")
    topology: Topology = Field("random", description="complete (everyone averages with everyone: DiLoCo's "
                               "all-reduce) | random (random pairs) | ring | exponential; diloco always all-reduces")
    schedule: Literal["lockstep", "async"] = Field("lockstep", description="lockstep: every worker does round r "
                                                   "then r+1, each on its own clock, a pair waiting only for "
                                                   "itself; async: no shared round counter, a ready worker pairs "
                                                   "with a ready neighbour (fast workers do more rounds)")
    num_partners: Literal[1, 2] = Field(1, description="partners per round: one matching, or the union of two")
    bandwidth_weighted: bool = Field(False, description="pick pairs with probability growing with their link "
                                     "bandwidth (min of the two workers')")
    eval_every: int = Field(5, ge=1, description="evaluate every this many rounds (per worker, on average)")
    max_sim_time_s: float | None = Field(None, gt=0, description="also stop once the virtual clock passes this")
    target_val_loss: float | None = Field(None, gt=0, description="also stop at the first evaluation whose mean "
                                          "validation loss is at or below this")
    threads: int = Field(1, ge=1, le=64, description="torch CPU threads")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(seq_len=64))
    data: DataConfig = Field(default_factory=lambda: DataConfig(batch_size=4, val_batches=2))
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    clock: ClockConfig = Field(default_factory=ClockConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig, description="robust mixing, as a live peer runs it "
                               "(each worker judges each partner from its own distance history; no trust-based "
                               "partner choice: the matchings are the topology's)")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.data.shard_index is not None or self.data.num_shards != 1:
            raise ValueError("data.shard_index and data.num_shards are set by the simulator (worker i reads shard "
                             "i of K); remove them")
        if self.outer.communicates and self.workers < 2:
            raise ValueError(f"algorithm {self.outer.algorithm!r} needs at least 2 workers")
        if self.outer.overlap and self.schedule != "lockstep":
            raise ValueError("outer.overlap is simulated on the lockstep schedule only; use --schedule lockstep or "
                             "drop --overlap")
        most = self.workers - 1 if self.topology == "complete" else self.num_partners
        if self.outer.mix_weight is not None and self.outer.mix_weight * most > 1:
            raise ValueError(f"outer.mix_weight {self.outer.mix_weight} times {most} partner(s) exceeds 1, so the "
                             "mix is no convex combination: lower the weight")
        return self

    @property
    def barrier(self) -> bool:
        """Whether a round waits for every worker (DiLoCo's all-reduce, or the complete topology)."""
        return self.outer.algorithm == "diloco" or (self.outer.communicates and self.topology == "complete")
