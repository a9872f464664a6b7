"""`gasloc peer`'s configuration: one pydantic tree, resolved as defaults < TOML < GASLOC_* env < flags
(gasloc.runtime.config.resolve). Hyperparameters live in the sections of the components they configure (model, data,
inner, outer, exchange, state_transfer, checkpoint); the peer's own sections are network (where it listens and
whom it dials), swarm (membership, partner choice, joining), diloco (the all-reduce baseline), run
(directories, limits, device) and metrics (Prometheus endpoints).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gasloc.peer.checkpoint import CheckpointConfig
from gasloc.peer.prometheus import MetricsConfig
from gasloc.peer.swarm.swarmkey import check_key_path
from gasloc.peer.train.data import DataConfig
from gasloc.peer.train.inner import InnerConfig
from gasloc.peer.train.model import ModelConfig
from gasloc.peer.train.outer import OuterConfig, fit_to_h
from gasloc.peer.transport.exchange import ExchangeConfig
from gasloc.peer.transport.state_transfer import StateTransferConfig
from gasloc.protocol.guard import GuardConfig
from gasloc.protocol.messages import check_run_id
from gasloc.runtime.maddrs import check_announce_ports, check_maddrs, expand_initial_peers


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NetworkConfig(_Section):
    """Where the peer listens and whom it dials first."""
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of running peers or bootstrap "
                                     "nodes, or files listing them (one per line); empty: start a new swarm")
    port: int = Field(0, ge=0, le=65535, description="TCP and UDP (QUIC) port to listen on, on every interface "
                      "(0: any free port); ignored when host_maddrs is set")
    host_maddrs: list[str] | None = Field(None, description="multiaddrs to listen on; unset: "
                                          "/ip4/0.0.0.0/tcp/<port> and /ip4/0.0.0.0/udp/<port>/quic-v1 (every "
                                          "interface, as a public host needs)")
    announce_maddrs: list[str] = Field(default_factory=list, description="multiaddrs other peers should dial "
                                       "(behind NAT or a port forward); empty: what libp2p observes")
    identity_path: str | None = Field(None, description="file with this peer's private key (created if missing) "
                                      "for a stable peer id; unset: a new random id each start")
    startup_timeout_s: float = Field(30.0, gt=0, description="how long to wait for p2pd and the DHT to come up")
    reachability: Literal["auto", "public", "private"] = Field(
        "auto", description="can other peers dial this one? auto: ask up to 5 live peers at start to dial our "
        "addresses back (reachable if half of those that answer can; nobody to ask: public); private (behind NAT "
        "without a port forward): DHT in client mode, auto-relay on, attach to forwarders, call rather than be "
        "called; public: others dial us (docs/nat.md)")
    probe_timeout_s: float = Field(5.0, gt=0, description="reachability auto: how long to wait for the probers")
    reprobe_every_s: float = Field(600.0, ge=0, description="reachability auto: probe again this often while "
                                   "running, and at once when our dialable addresses change; a flipped verdict "
                                   "attaches to or detaches from forwarders (the DHT mode stays until a restart); "
                                   "0: only the probe at start (docs/nat.md)")
    forwarding: bool = Field(True, description="when public: forward streams between peers behind NAT that "
                             "attach to us (costs twice the forwarded bytes of our link; counted in metrics)")
    forward_max_circuits: int = Field(16, ge=1, description="streams we forward at once (an exchange uses one "
                                      "per lane)")
    forward_max_attached: int = Field(32, ge=1, description="peers behind NAT that may attach to us at once")
    attach_forwarders: int = Field(2, ge=1, le=8, description="when private: how many public peers to stay "
                                   "attached to (others reach us through them)")

    @field_validator("initial_peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        return expand_initial_peers(v)

    _maddrs = field_validator("host_maddrs", "announce_maddrs")(check_maddrs)
    _explicit_port = field_validator("announce_maddrs")(check_announce_ports)

    @property
    def listen_maddrs(self) -> list[str]:
        if self.host_maddrs:
            return list(self.host_maddrs)
        return [f"/ip4/0.0.0.0/tcp/{self.port}", f"/ip4/0.0.0.0/udp/{self.port}/quic-v1"]


class SwarmConfig(_Section):
    """Membership in the run and how partners are found."""
    run_id: str = Field("gasloc", description="name of the training run: peers of one run share its DHT key")
    key_path: Path | None = Field(None, description="swarm key file (`gasloc keygen FILE`) of a private swarm: "
                                  "every DHT request, exchange and state download must prove the same key; "
                                  "peers without it are neither listed, served nor mixed with, and a membership "
                                  "read asks one DHT node, not three (no stranger can hide records). Unset: an "
                                  "open swarm (a stock hivemind DHT node works as its bootstrap)")
    announce_ttl_s: float = Field(15.0, ge=1, description="a peer's record expires this long after its last "
                                  "announcement (refreshed every ttl/3); also how long a dead peer stays listed")
    partner_deadline_s: float = Field(10.0, gt=0, description="per round, how long to look for a partner before "
                                      "a solo round")
    adaptive_deadline: bool = Field(False, description="end a plain round's partner search at median + "
                                    "adaptive_deadline_k * MAD of how long recent searches waited for their "
                                    "partner (at most partner_deadline_s, at least partner_deadline_min_s), and at "
                                    "once when no peer is ready and no training peer is expected ready before that "
                                    "deadline (from when it announced its inner phase and its announced tokens/s: "
                                    "nobody is coming); false: always search for partner_deadline_s")
    adaptive_deadline_k: float = Field(3.0, ge=0, description="adaptive_deadline: how many MADs above the "
                                       "median wait the deadline lies")
    partner_deadline_min_s: float = Field(1.0, gt=0, description="adaptive_deadline: the shortest deadline "
                                          "(listings are up to ~1 s old)")
    retry_interval_s: float = Field(0.25, gt=0, description="pause between partner attempts when nobody is "
                                    "available (incoming requests are accepted meanwhile)")
    min_backoff_s: float = Field(2.0, gt=0, description="first backoff from a partner whose exchange failed")
    max_backoff_s: float = Field(60.0, gt=0, description="longest backoff from a repeatedly failing partner")
    busy_cooldown_s: float = Field(0.5, ge=0, description="skip a partner that answered busy for this long")
    avoid_recent_partners: int = Field(3, ge=0, description="pass over this many most recent partners during "
                                       "the first half of the partner search, while someone else is due in it "
                                       "(peers that just exchanged become ready together and would otherwise "
                                       "pair again and again; 1 split equal-speed swarms into groups: "
                                       "docs/sim-results.md)")
    bandwidth_weighting: bool = Field(False, description="choose partners with probability proportional to "
                                      "their measured bandwidth instead of uniformly")
    slower_link_ratio: float = Field(0.0, ge=0, description="for the first half of a partner search, pass over "
                                     "and answer busy to peers whose last exchange with us ran over this many times "
                                     "slower than our best recent one (fast peers pair with fast ones); while "
                                     "none of our measured rates is that much slower, try peers we never "
                                     "exchanged with first; 0: off")
    slower_link_open_share: float = Field(0.25, ge=0, le=1, description="with slower_link_ratio: this share of "
                                          "partner searches (spread evenly: every 1/share-th one) serves the "
                                          "slower peers first, so peers on slow links keep getting partners even "
                                          "when the fast ones always find each other first")
    join_from_peers: bool = Field(True, description="a peer joining a running swarm (and not resuming a "
                                  "checkpoint) downloads the current parameters from a live peer")
    join_donor_pool: int = Field(3, ge=1, description="a joiner picks its donor at random among this many live "
                                 "peers it has seen longest (tenure, its own observation; an announced round orders "
                                 "nothing), checks the state on batches of its own and, if it is worse than its "
                                 "own model, tries another, at most this many times")
    join_cross_check: bool = Field(True, description="download a second donor's state too and compare: within "
                                   "join_agree of each other they confirm each other, else the one with the lower "
                                   "loss on batches only this peer knows is adopted (a joiner downloads twice)")
    join_agree: float = Field(0.5, gt=0, description="join_cross_check: two donors' states agree when their "
                              "relative distance ||a - b|| / ||b|| is at most this (honest donors of the 4-peer e2e "
                              "swarm measured 0.23 and 0.45 apart at rounds 18-24; further apart, the state with "
                              "the lower loss on our own batches is adopted)")
    join_check_batches: int = Field(2, ge=1, description="batches drawn privately from this peer's own data "
                                    "(never the validation batches every peer shares) on which a donor's state is "
                                    "checked")
    round_claim_slack: int = Field(5, ge=0, description="another peer's announced round is believed up to the "
                                   "median of the rounds already believed plus this when it is first seen, and "
                                   "from then on up to this plus round_claim_speedup rounds per round of ours; what "
                                   "is over is cut (behind resyncs, donor choice, the round and lr a joiner takes)")
    round_claim_speedup: float = Field(4.0, gt=0, description="how many times faster than us another peer's "
                                       "rounds may advance before its claims are cut (round_claim_slack)")
    join_timeout_s: float = Field(120.0, gt=0, description="give up downloading the state after this long, plus "
                                  "each candidate donor's payload time at state_transfer.min_rate_mbit (a 1b model "
                                  "does not travel in 120 s on a home link), and start from a fresh model")
    join_listing_wait_s: float = Field(3.0, ge=0, description="a joiner whose first listing names no other peer "
                                       "although initial peers are set lists again for up to this long before it "
                                       "starts from the seed model (its DHT node may not know the swarm yet)")
    resync_after_rounds: float = Field(3.0, ge=0, description="a peer whose process was stopped (SIGSTOP, "
                                       "suspend) for longer than announce_ttl_s and this many of its rounds "
                                       "downloads the swarm's state instead of mixing its stale model; 0: never")
    resync_behind_rounds: float = Field(3.0, ge=0, description="a peer more than this many rounds behind the "
                                        "listed peers' median, when it resumes from its checkpoint or when the "
                                        "guard finds its partner far, downloads the swarm's state instead of "
                                        "mixing its stale model; 0: never")

    _run_id = field_validator("run_id")(check_run_id)
    _key = field_validator("key_path")(check_key_path)

    @model_validator(mode="after")
    def _orders_and_ratios(self) -> SwarmConfig:
        if self.max_backoff_s < self.min_backoff_s:
            raise ValueError(f"max_backoff_s {self.max_backoff_s} is below min_backoff_s {self.min_backoff_s}")
        if 0 < self.slower_link_ratio <= 1:
            # a ratio of 1 or less would pass over peers as fast as we are, or faster
            raise ValueError(f"slower_link_ratio {self.slower_link_ratio} must be above 1 (how many times slower a "
                             f"peer's link must be to be passed over, e.g. 3), or 0 to turn it off")
        return self


class DilocoConfig(_Section):
    """outer.algorithm = "diloco": the exact all-reduce baseline through hivemind's DecentralizedAverager, as its users
    run it: groups keyed by epoch, no outer step without the group's mean, a start barrier, a fork check
    (peer/swarm/diloco.py)."""
    max_group_size: int | None = Field(None, ge=2, description="cap on the averaging group; unset: every live "
                                       "DiLoCo peer of the run")
    initial_group_size: int = Field(2, ge=2, description="start barrier: the first all-reduce of a fresh run "
                                    "(epoch 0) waits until a group of this many peers forms; set it to the swarm "
                                    "you start, so the first step is everyone's")
    matchmaking_time_s: float = Field(5.0, gt=0, description="how long a group waits for late members")
    averaging_timeout_s: float = Field(60.0, gt=0, description="one averaging attempt (matchmaking + all-reduce) "
                                       "must end within this; otherwise it failed and the peer tries again for "
                                       "the same epoch (never a solo step)")
    request_timeout_s: float = Field(3.0, gt=0, description="matchmaking request timeout (below "
                                     "matchmaking_time_s)")
    next_chunk_timeout_s: float = Field(10.0, gt=0, description="a groupmate silent this long is dropped")
    anchor_tolerance: float | None = Field(None, gt=0, lt=1, description="fork check: a member whose anchor "
                                           "sample differs (relative L2) by more than this from the group's model "
                                           "(the anchor most members agree with; the lowest peer id among equals) "
                                           "downloads it, and the group does not step until every member holds it; "
                                           "must exceed what the wire's rounding leaves between members; "
                                           "unset: 1e-4 with compression none, 1e-2 float16, 5e-2 uint8")
    compression: Literal["auto", "none", "float16", "uint8"] = Field(
        "auto", description="hivemind.compression of the all-reduce: none (fp32), float16, uint8 (uniform 8-bit); "
        "auto: the closest to exchange.codec that keeps one model (float32 -> none; float16, bfloat16, int8 and "
        "narrower -> float16: uint8 leaves members' anchors walking apart ~1.5e-3 a step). A lossy one leaves members' models apart "
        "by its rounding after each step (peer/swarm/diloco.py)")

    @model_validator(mode="after")
    def _timeouts(self) -> DilocoConfig:
        if self.request_timeout_s >= self.matchmaking_time_s:
            raise ValueError("request_timeout_s must be below matchmaking_time_s (hivemind deadlocks otherwise)")
        if self.averaging_timeout_s <= self.matchmaking_time_s:
            raise ValueError("averaging_timeout_s must exceed matchmaking_time_s")
        if self.max_group_size is not None and self.initial_group_size > self.max_group_size:
            raise ValueError(f"initial_group_size {self.initial_group_size} exceeds max_group_size "
                             f"{self.max_group_size}: the first group could never form")
        return self


class RunConfig(_Section):
    """This process: where it writes, how long it runs, what it trains on."""
    run_dir: Path | None = Field(None, description="metrics.jsonl and checkpoints go here; unset: "
                                 "runs/<run_id>/peer (one peer per directory: a lock file enforces it)")
    seed: int = Field(0, description="seed of the initial model; every peer of a run must use the same one")
    max_rounds: int | None = Field(None, ge=1, description="stop after this many outer rounds; unset: run until "
                                   "SIGINT/SIGTERM")
    max_seconds: float | None = Field(None, gt=0, description="stop after this many seconds of training")
    eval_every_rounds: int = Field(10, ge=1, description="validation loss every this many rounds (and at the "
                                   "first and last)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when present (bf16 "
                                                   "autocast), else CPU (fp32)")
    torch_threads: int | None = Field(None, ge=1, description="CPU threads for torch; unset: torch's default")
    memory_limit_mb: float | None = Field(None, gt=0, description="on the CPU, the most resident memory this "
                                          "process may use (MB = 10^6 B); the start-up check (a dry inner and "
                                          "outer step) refuses a config whose round does not fit. Unset: the "
                                          "cgroup's limit or the machine's available memory; on CUDA the "
                                          "device's free memory")
    compact_host_heap: bool = Field(False, description="on the CPU, give every tensor of 128 KB or more a "
                                    "mapping of its own (glibc's mmap threshold), so memory one phase of a round "
                                    "frees goes back to the kernel: 8.8 -> 6.4 parameter copies at the round's peak "
                                    "(bench/host_memory.py, int8), at a page fault per fresh 4 KB (an inner step "
                                    "43-57 % slower on the tiny and small presets at their default batch; "
                                    "docs/gpu.md)")


class FaultConfig(_Section):
    """TEST FAULT INJECTOR: makes this peer a hostile volunteer, so tests can show what the guard does against
    one. Never set it on a real peer. It changes only what this peer trains or sends, never how others treat it."""
    noise_std: float = Field(0.0, ge=0, description="after every inner step add Gaussian noise of this standard "
                             "deviation to every parameter (a noisy volunteer)")
    send_scale: float = Field(1.0, gt=0, description="multiply every tensor this peer sends in an exchange by "
                              "this (3: a peer that sends its model scaled x3)")
    nan_at_round: int | None = Field(None, ge=1, description="in this round (once per process) turn the "
                                     "parameters to NaN after the first inner step, so the training loss turns NaN "
                                     "mid-round")
    oom_at_round: int | None = Field(None, ge=1, description="in this round raise torch's out-of-memory error "
                                     "after the first inner step (an OOM mid-round: the peer must end, not loop)")
    fork_at_round: int | None = Field(None, ge=1, description="in this round, or the first one after it that the "
                                      "peer trains (once per process), move the "
                                      "parameters and the outer anchor alike by Gaussian noise of fork_scale x each "
                                      "tensor's RMS after the first inner step: a model that parted from its group's "
                                      "(a bad restore, a bit flip), which DiLoCo's group check must catch")
    fork_scale: float = Field(0.05, gt=0, description="the fork's size, relative to each tensor's RMS")
    bias: Literal["none", "fixed", "uphill"] = Field("none", description="offer our y plus a bias b sized under "
                                                     "the guard's tau (peer/fault.py): fixed (one random direction "
                                                     "from bias_seed, every round) or uphill (along this round's "
                                                     "own summed inner gradients); we mix with the true y")
    bias_share: float = Field(0.9, gt=0, description="size b so that a victim measures our offer at about this "
                              "x tau: ||b|| = sqrt((this x tau)^2 - m^2) x ||y||, tau and m (the median partner "
                              "distance) as our own guard sees them")
    bias_tensor: int | None = Field(None, ge=0, description="all of b in this one parameter tensor (its index in "
                                    "model.parameters(); 0: the token embedding); unset: spread over all")
    bias_seed: int = Field(0, description="seed of the fixed direction (Sybils sharing it push the same way)")


class PeerConfig(_Section):
    """Everything `gasloc peer` needs."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    exchange: ExchangeConfig = Field(default_factory=ExchangeConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    fault: FaultConfig | None = Field(None, description="TEST FAULT INJECTOR, never for real runs: make this "
                                      "peer hostile on purpose (tests/e2e/test_untrusted.py); unset: honest")
    state_transfer: StateTransferConfig = Field(default_factory=StateTransferConfig)
    checkpoint: CheckpointConfig | None = Field(default_factory=CheckpointConfig, description="periodic "
                                                "checkpoints, and resuming from the newest valid one at start "
                                                "(before any download from peers); null (GASLOC_CHECKPOINT=null or "
                                                "--no-checkpoint): none")
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    swarm: SwarmConfig = Field(default_factory=SwarmConfig)
    diloco: DilocoConfig = Field(default_factory=DilocoConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _communicating(self) -> PeerConfig:
        if self.outer.algorithm == "local":
            raise ValueError("outer.algorithm 'local' never communicates: it runs in `gasloc sim`, not in a swarm")
        if self.outer.algorithm == "diloco" and self.swarm.key_path is not None:
            # hivemind's DecentralizedAverager takes no authorizer: its all-reduce streams could not be gated
            raise ValueError("swarm.key_path (a private swarm) is not supported with outer.algorithm 'diloco': "
                             "hivemind's averager cannot check the swarm key")
        self.outer = fit_to_h(self.outer, self.inner.inner_steps)
        return self

    @property
    def run_dir(self) -> Path:
        return self.run.run_dir if self.run.run_dir is not None else Path("runs") / self.swarm.run_id / "peer"

    @property
    def checkpoint_dir(self) -> Path | None:
        if self.checkpoint is None:
            return None
        return self.checkpoint.dir if self.checkpoint.dir is not None else self.run_dir / "checkpoints"
