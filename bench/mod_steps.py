"""What the modulo codec's step could buy (issue 32): mod4-sd with other step rules, in the simulator.

    python bench/mod_steps.py --jobs 2 --json mod_steps.json                      # every rule, seeds 0 1 2
    python bench/mod_steps.py --rules fp32,block --seeds 0 --rounds 2 --workers 4  # a smoke run
    python bench/mod_steps.py --rules as-built --mix-weight 0.45 --jobs 2           # mod4-sd at another weight
    python bench/mod_steps.py --rules as-built --clock fp32 --jobs 2                # with the fp32 wire's partners
    python bench/mod_steps.py --rules as-built --codec mod3-sd --mix-momentum 1 --clock fp32 --jobs 2
                                                                    # another codec, its mixes carried whole
    python bench/mod_steps.py --rules fp32,wz --mix-weight 0.5 --mix-momentum 0 --clock fp32 --jobs 2
                                                                    # the best 1-bit code, an oracle (M)

The modulo rules mix with mod4-sd's own weight (0.4, protocol/codec.py; invocation E ran before it, at the pair's
mean 0.5: `--mix-weight 0.5` runs E again), fp32 with the pair's mean, its best (docs/codecs.md invocation G); and
with mod4-sd's own kappa, 0.5 (invocation J; every invocation before J ran 1: `--mix-momentum 1` runs them again).

`mod4-sd` (protocol/codec.py) sizes one step per tensor from 64 probe values of each side, so that the code range
spans 8 RMS of the pair's sampled difference. It missed issue 32's 0.5 % by +1.0 % (docs/codecs.md). This asks
which part of the step rule costs that, on the codec suite's setup (paper-cosine's claim (b), 8 workers, H = 20,
30 rounds, the cosine over 600 steps; `gasloc sim compare --suite codecs`), each rule paired by seed with the fp32
wire run in the same invocation:

    fp32        the lossless wire (the baseline)
    as-built    mod4-sd through the codec's own code (probe steps)
    band1       as built, and a code difference of 2^(b-1) - 1 or more left unmixed on both sides (a guard band
                against wraps: a coordinate just past the range reads as the far end and is not pulled wrongly)
    tensor      a step per tensor from the whole difference's RMS (no probe noise): what a perfect probe gives
    block       a step per 64-value block from that block's own difference RMS: an oracle, since neither side
                knows the difference before the exchange; it bounds what per-block steps could buy
    movement    a step per block whose shape comes from each side's own movement this round (y - anchor, the
                block's RMS rounded to a power of 2^(1/2), the larger of the two sides', as 4-bit codes both
                could send), scaled so that the tensor's RMS is the pair's actual difference: an implementable
                per-block rule, if the movement predicted the difference
    sign1       ONE bit a value, every value every round: each side sends its code's parity (floor(y / step + u)
                mod 2, the shared dither u); where the parities differ, a side reads the partner one step above
                it if its own value sits in the upper half of its cell, else one step below (exact, and the
                same on both sides, where |difference| < step / 2). The step per tensor is `--sign-range` times
                the pair's whole difference RMS (a perfect probe): what a dense 1-bit modulo code gives at best
    wz          an oracle of the best coder at `--wz-bits` (default 1) a value that decodes against the receiver's
                own model (Wyner-Ziv coding), if each 64-value block's difference were Gaussian: for a Gaussian
                difference of variance s^2 and our own values at the decoder, no code of R bits a value gets the
                mean squared error below D = s^2 2^(-2R), and the test channel that reaches it decodes
                alpha d + m, alpha = 1 - 2^(-2R), m ~ N(0, alpha D) independent of d. Both sides draw the same m
                (the pair's mean exact) and the block's s is the pair's actual one, which no coder knows: what
                one bit a value could buy with codes far longer and smarter than any built here, not a codec
    wz-tensor   the same with one variance per tensor (the pair's whole difference's mean square, what a probe
                estimates), as a coder that models each tensor's difference as one Gaussian would do

`--clock fp32` charges every run the fp32 wire's 4 bytes a parameter (clock.charge_codec false,
clock.bytes_per_param 4) instead of its codec's bytes: a modulo rule's exchanges then take as long as fp32's, so its
run meets the same partners at the same times as the fp32 run of its seed, and the paired difference is the codec's
rounding alone. By default (`codec`) each codec's own bytes are charged, as the suite does: a cheaper exchange ends
earlier, the live schedule's partners differ from fp32's, and the pairing mixes the two effects.

`--codec` runs another codec of protocol/codec.py as the as-built rule (the other rules are mod4-sd's arithmetic
written here), and `--mix-momentum` sets outer.mix_momentum (kappa, docs/algorithms.md: the share of a mix's
correction the outer momentum carries on; by default the codec's own: 0.5 for mod4-sd, 0 for mod3-sd, int8-p10 and
mod8-p12-sd, 1, the form as published, for every other) for every rule but fp32, which keeps its default (1) as it
keeps the pair's mean.

Every rule but fp32 and as-built replaces the simulator's modulo exchange (sim/trainer.py `_modulo_wire`) with an
exchange written here: for the step rules, both sides round y / step with the exchange's shared dither, send the
integers modulo 2^b and decode y_i + step * d, the pair's mean exact (d read as -d by the partner); sign1 and the wz
oracles as above, the pair's mean exact too (sign1's where the pair is within half a step). It is an experiment,
not a codec: nothing here is on any wire.
"""
from __future__ import annotations

import json
import statistics
from concurrent.futures import ProcessPoolExecutor

import click
import torch

RULES = ("fp32", "as-built", "band1", "tensor", "block", "movement", "sign1", "wz", "wz-tensor")
CODEC = "mod4-sd"   # what every rule but fp32 runs; `--codec` changes it for as-built alone
BITS, BLOCK, RANGE_RMS = 4, 64, 8.0
SIGN_RANGE_RMS = 4.0   # sign1's default step, in RMS of the pair's difference
WZ_BITS = 1.0          # wz's rate, bits a value
CLOCKS = ("codec", "fp32")
FP32_BYTES = 4.0   # what the fp32 wire's codec ("float32") charges a parameter: 32 bits, no header
HALF = 1 << (BITS - 1)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, (-x.numel()) % BLOCK)).view(-1, BLOCK)


def _block_rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean(1, keepdim=True).sqrt()


def _log_code(x: torch.Tensor) -> torch.Tensor:
    """x rounded to a power of 2^(1/2): what a 4-bit log code per block carries."""
    return torch.exp2(torch.round(torch.log2(x.clamp_min(1e-20)) * 2) / 2)


def steps_for(rule: str, a: torch.Tensor, b: torch.Tensor, ma: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    """The step of every block (a column) for one pair of flat float64 tensors: ours `a`, theirs `b`, and each
    side's movement this round `ma`, `mb`."""
    diff = _blocks(b - a)
    if rule == "block":
        rms = _block_rms(diff)
    elif rule == "movement":
        shape = torch.maximum(_log_code(_block_rms(_blocks(ma))), _log_code(_block_rms(_blocks(mb))))
        rms = shape * (diff.square().mean().sqrt() / shape.square().mean().sqrt().clamp_min(1e-30))
    else:   # tensor (band1 goes through the probe, below)
        rms = diff.square().mean().sqrt().expand(diff.shape[0], 1)
    return (RANGE_RMS * rms / HALF).clamp_min(1e-9)


def code_pair(step: torch.Tensor, a: torch.Tensor, b: torch.Tensor, gen: torch.Generator, band: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what a decodes of b, what b decodes of a): modulo codes with a shared dither, per-block steps."""
    n = a.numel()
    ab, bb = _blocks(a), _blocks(b)
    u = torch.rand(ab.shape, generator=gen, dtype=torch.float64)
    d = (torch.floor(bb / step + u) - torch.floor(ab / step + u) + HALF).remainder(2 * HALF) - HALF
    # d is in [-HALF, HALF): |d| >= HALF is the one difference both sides read alike (-HALF), left unmixed; a band
    # leaves the next `band` on either side unmixed too
    d = torch.where(d.abs() >= HALF - band, torch.zeros_like(d), d)
    return (ab + step * d).view(-1)[:n], (bb - step * d).view(-1)[:n]


def sign_pair(step: float, a: torch.Tensor, b: torch.Tensor, gen: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what a decodes of b, what b decodes of a) from one bit a value each way: rule sign1 (module docstring)."""
    u = torch.rand(a.shape, generator=gen, dtype=torch.float64)
    xa, xb = a / step + u, b / step + u
    qa, qb = torch.floor(xa), torch.floor(xb)
    differ = (qa - qb).remainder(2) != 0
    one = torch.ones_like(a)
    da = torch.where(differ, torch.where(xa - qa >= 0.5, one, -one), torch.zeros_like(a))
    db = torch.where(differ, torch.where(xb - qb >= 0.5, one, -one), torch.zeros_like(b))
    return a + step * da, b + step * db


def wz_pair(bits: float, a: torch.Tensor, b: torch.Tensor, gen: torch.Generator, per_block: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what a decodes of b, what b decodes of a) through the Gaussian Wyner-Ziv test channel at `bits` a value, a
    variance per 64-value block from the pair's actual difference (rule wz), or one for the whole tensor
    (`per_block` false: rule wz-tensor); module docstring."""
    n, d = a.numel(), b - a
    diff = _blocks(d)
    share = 2.0 ** (-2 * bits)                 # D / s^2: the least mean squared error a code of `bits` can reach
    alpha = 1 - share
    noise = torch.randn(diff.shape, generator=gen, dtype=torch.float64)
    rms = _block_rms(diff) if per_block else d.square().mean().sqrt()
    got = alpha * diff + noise * (alpha * share) ** 0.5 * rms
    return a + got.view(-1)[:n], b - got.view(-1)[:n]


def _patched_modulo_wire(rule: str, sign_range: float = SIGN_RANGE_RMS, wz_bits: float = WZ_BITS):
    from gasloc.protocol.codec import probe, probe_steps

    def _modulo_wire(self, partners) -> None:
        numels = [p.numel() for p in self.params[0]]
        for i, ps in partners.items():
            if ps:
                self.wire[i] = self.sent[i]
        done = set()
        for i, ps in partners.items():
            for j in ps:
                if (j, i) in done:
                    continue
                done.add((i, j))
                seed = self.exchange_seed(i, j)
                gen = torch.Generator().manual_seed(seed)
                probed = probe_steps(self.codec, numels, probe(self.sent[i], seed), probe(self.sent[j], seed)) \
                    if rule == "band1" else None
                wi, wj = [], []
                for k, (a, b, xa, xb) in enumerate(zip(self.sent[i], self.sent[j], self.outers[i].anchor,
                                                       self.outers[j].anchor)):
                    fa, fb = a.reshape(-1).double(), b.reshape(-1).double()
                    if rule == "sign1":
                        step = max(sign_range * float((fb - fa).square().mean().sqrt()), 1e-9)
                        da, db = sign_pair(step, fa, fb, gen)
                    elif rule in ("wz", "wz-tensor"):
                        da, db = wz_pair(wz_bits, fa, fb, gen, per_block=rule == "wz")
                    else:
                        if probed is not None:
                            step = torch.full((-(-fa.numel() // BLOCK), 1), probed[k], dtype=torch.float64)
                        else:
                            step = steps_for(rule, fa, fb, fa - xa.reshape(-1).double(),
                                             fb - xb.reshape(-1).double())
                        da, db = code_pair(step, fa, fb, gen, band=1 if rule == "band1" else 0)
                    wi.append(da.float().view_as(a))
                    wj.append(db.float().view_as(b))
                self.wire[(i, j)], self.wire[(j, i)] = wi, wj
    return _modulo_wire


def clock_overrides(clock: str) -> dict:
    """The clock settings of `--clock`: none for `codec` (each run charged its codec's bytes), the fp32 wire's bytes
    whatever the codec for `fp32` (set on the fp32 run too, where they change nothing: float32 charges 4 bytes)."""
    return {"clock.charge_codec": False, "clock.bytes_per_param": FP32_BYTES} if clock == "fp32" else {}


def simulate(rule: str, seed: int, overrides: dict, *, modulo_wire=None, mix_weight: float | None = None,
             clock: str = "codec", codec: str = CODEC, mix_momentum: float | None = None) -> dict:
    """One run of the codec suite's fp32 setup at `seed`, a row of the paired table: the fp32 wire for rule
    "fp32", else `codec` (mod4-sd) with its `_modulo_wire` replaced by `modulo_wire` where given (the exchange of
    an experiment; the codec's own code where not). `mix_weight`, `mix_momentum`: the outer settings of every
    rule but fp32 (None: the default)."""
    from gasloc.sim.runner import run
    from gasloc.sim.suite import SUITES, RunSpec, _config
    from gasloc.sim.trainer import SimTrainer

    suite = SUITES["codecs"]
    b = next(r.overrides for r in suite.runs if r.overrides.get("codec") == "float32")
    spec = {**b, **overrides, **clock_overrides(clock), "seed": seed,
            "codec": "float32" if rule == "fp32" else codec}
    if mix_weight is not None and rule != "fp32":   # fp32 keeps the pair's mean, its best (docs/codecs.md G)
        spec["outer.mix_weight"] = mix_weight
    if mix_momentum is not None and rule != "fp32":
        spec["outer.mix_momentum"] = mix_momentum
    original = SimTrainer._modulo_wire
    if modulo_wire is not None and rule != "fp32":
        SimTrainer._modulo_wire = modulo_wire
    try:
        r = run(_config(suite, RunSpec(f"{rule}-s{seed}", spec)))
    finally:
        SimTrainer._modulo_wire = original
    return {"rule": rule, "seed": seed, "final": r["final_val_loss"], "consensus": r["evals"][-1].get("consensus"),
            "mix_weight": mix_weight, "clock": clock, "sim_time_s": r["final_sim_time_s"],
            "codec": spec["codec"], "mix_momentum": mix_momentum if rule != "fp32" else None, "guard": r["guard"]}


def run_one(rule: str, seed: int, overrides: dict, mix_weight: float | None = None, clock: str = "codec",
            sign_range: float = SIGN_RANGE_RMS, codec: str = CODEC, mix_momentum: float | None = None,
            wz_bits: float = WZ_BITS) -> dict:
    wire = _patched_modulo_wire(rule, sign_range, wz_bits) if rule not in ("fp32", "as-built") else None
    return simulate(rule, seed, overrides, modulo_wire=wire, mix_weight=mix_weight, clock=clock, codec=codec,
                    mix_momentum=mix_momentum)


def paired(rows: list[dict]) -> dict[str, list[float]]:
    """Each rule's final loss against the fp32 run of the same seed, in % by seed (seeds without an fp32 run left
    out; fp32 itself has none)."""
    base = {r["seed"]: r["final"] for r in rows if r["rule"] == "fp32"}
    out = {}
    for rule in dict.fromkeys(r["rule"] for r in rows):
        rs = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["seed"])
        out[rule] = [100 * (r["final"] / base[r["seed"]] - 1) for r in rs if r["seed"] in base] \
            if rule != "fp32" else []
    return out


def table(rows: list[dict], extra: dict[str, dict[str, str]] | None = None) -> str:
    """The paired table; `extra`: more columns, name -> rule -> cell."""
    extra = extra or {}
    rel = paired(rows)
    out = ["| rule | final val loss by seed | against fp32, paired | mean | consensus at the end |"
           + "".join(f" {name} |" for name in extra),
           "|---|---|---|---|---|" + "---|" * len(extra)]
    for rule in rel:
        rs = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["seed"])
        finals = ", ".join(f"{r['final']:.4f}" for r in rs)
        by_seed = ", ".join(f"{x:+.2f} %" for x in rel[rule])
        mean = f"{statistics.mean(rel[rule]):+.2f} %" if rel[rule] else ""
        consensus = ", ".join(f"{r['consensus']:.3f}" for r in rs)
        codec = rs[0].get("codec", CODEC)
        label = f"{rule} ({codec})" if codec not in (CODEC, "float32") else rule
        out.append(f"| {label} | {finals} | {by_seed} | {mean} | {consensus} |"
                   + "".join(f" {col.get(rule, '')} |" for col in extra.values()))
    return "\n".join(out)


def seeds_and_overrides(seeds: str, rounds: int | None, workers: int | None) -> tuple[list[int], dict]:
    """`--seeds` as integers, and the smoke-run overrides that are set."""
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"{seeds!r} is not a comma-separated list of integers",
                                 param_hint="--seeds") from None
    return seed_list, {k: v for k, v in (("rounds", rounds), ("workers", workers)) if v is not None}


def paired_cells(run_cell, rules: list[str], seeds: list[int], jobs: int, *args) -> list[dict]:
    """`run_cell(rule, seed, *args)` for every rule and seed, `jobs` processes at once, fp32 added first where
    missing: every rule is read against the lossless wire of the same invocation. `run_cell` must be a module-level
    function (the pool pickles it by name)."""
    rules = rules if "fp32" in rules else ["fp32", *rules]
    tasks = [(rule, s) for s in seeds for rule in rules]
    with ProcessPoolExecutor(jobs) as pool:
        rows = list(pool.map(run_cell, *zip(*tasks), *([a] * len(tasks) for a in args)))
    for r in rows:
        click.echo(f"{r['rule']} seed {r['seed']}: final {r['final']:.4f} consensus {r['consensus']:.3f}", err=True)
    return rows


def clock_option(f):
    return click.option("--clock", type=click.Choice(CLOCKS), default="codec", show_default=True,
                        help="what the virtual clock charges an exchange: each run's codec's bytes, or fp32's 4 bytes "
                             "a parameter whatever the codec (every run then meets the fp32 run's partners)")(f)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rules", default=",".join(RULES), show_default=True, help=f"comma-separated, from {', '.join(RULES)}")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--jobs", type=click.IntRange(1, 16), default=1, show_default=True, help="runs at once (processes)")
@click.option("--rounds", type=click.IntRange(1), default=None, help="fewer rounds (a smoke run)")
@click.option("--workers", type=click.IntRange(2), default=None, help="fewer workers (a smoke run)")
@click.option("--mix-weight", type=click.FloatRange(0, 0.5, min_open=True), default=None,
              help="the modulo rules' weight per partner (default: the codec's own, 0.4 for mod4-sd; E ran at 0.5); "
                   "fp32 keeps the pair's mean")
@clock_option
@click.option("--sign-range", type=click.FloatRange(0, min_open=True), default=SIGN_RANGE_RMS, show_default=True,
              help="sign1: its step per tensor, in RMS of the pair's difference")
@click.option("--wz-bits", type=click.FloatRange(0, min_open=True), default=WZ_BITS, show_default=True,
              help="wz, wz-tensor: the oracles' rate, bits a value")
@click.option("--codec", default=CODEC, show_default=True,
              help="the codec of the as-built rule, any name protocol/codec.py reads (the other rules are mod4-sd's)")
@click.option("--mix-momentum", type=click.FloatRange(0, 1), default=None,
              help="kappa (outer.mix_momentum) of every rule but fp32: the share of a mix's correction the outer "
                   "momentum carries on (default: the codec's own, protocol/codec.py MIX_MOMENTUM; else 1, the form "
                   "as published)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(rules: str, seeds: str, jobs: int, rounds: int | None, workers: int | None, mix_weight: float | None,
         clock: str, sign_range: float, codec: str, mix_momentum: float | None, wz_bits: float,
         json_path: str | None) -> None:
    from gasloc.protocol.codec import CodecError, parse

    chosen = [r.strip() for r in rules.split(",") if r.strip()]
    if bad := [r for r in chosen if r not in RULES]:
        raise click.BadParameter(f"unknown rule(s) {', '.join(bad)}; choose from {', '.join(RULES)}",
                                 param_hint="--rules")
    try:
        parse(codec)
    except CodecError as e:
        raise click.BadParameter(str(e), param_hint="--codec") from None
    if codec != CODEC and (other := [r for r in chosen if r not in ("fp32", "as-built")]):
        raise click.BadParameter(f"rule(s) {', '.join(other)} are {CODEC}'s arithmetic; only as-built runs "
                                 f"{codec}", param_hint="--codec")
    seed_list, overrides = seeds_and_overrides(seeds, rounds, workers)
    rows = paired_cells(run_one, chosen, seed_list, jobs, overrides, mix_weight, clock, sign_range, codec,
                        mix_momentum, wz_bits)
    click.echo(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": rows, "overrides": overrides, "mix_weight": mix_weight, "clock": clock,
                       "sign_range": sign_range, "codec": codec, "mix_momentum": mix_momentum,
                       "wz_bits": wz_bits}, f, indent=1)


if __name__ == "__main__":
    main()
