"""Whom a joiner (or a peer catching up) downloads the swarm's state from, what it believes of the donor's reply, and
how it checks one donor against another. Pure: no I/O, no clock, no torch (the driver measures distances and
losses and passes them in). The driver is peer/swarm/joining.py and peer/daemon.py `_adopt_swarm_state`.

Threats (docs/robust-mixing.md, "Claims"): a donor that lies in its metadata (a round of "soon", -7 or 10^9, another
peer's id, fields missing or added), a donor state tuned to pass a check, an outer state (momentum) that jumps the
model at the next outer step, and donors that are Sybils chosen because they claim the highest round.

- Metadata (`check_metadata`): the reply's `round` field is the round (an int >= 0 by the header's schema); a
  `round` or `num_outer` in the metadata must be the same int, a `peer_id` there must be the stream's remote peer
  (libp2p authenticates it); anything else is a status code for that donor, never an exception. The donor's id is
  always the transport's, never a claim. Other keys are ignored (a newer peer may add some).
- Choice (`pick_donors`): peers we have seen longest first (tenure: our own observation, not a claim), a random one
  of the `pool` longest-seen first so that one peer is not every joiner's donor; a peer whose believed round is 0
  (it trained nothing: peers started together hold the seed already) or that is joining is no donor. The claimed
  round orders nothing. A peer whose trust our own guard lowered (its offers clipped or rejected, protocol/guard.py
  TrustBook) is asked only after every other candidate, the most trusted first.
- Cross-check (`cross_check`): a second donor's state is downloaded too; two states within `agree` of each other
  (relative distance) confirm each other, else the one with the lower loss on batches only we know wins.
- The donor's outer state is never adopted (the joiner resets its outer state to the adopted parameters), and the
  round adopted is the lower of the two donors' rounds, cut to what we believe (protocol/claims.py).
"""
from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gasloc.protocol.codes import Code

# metadata keys the protocol defines; the state server puts them there (peer/daemon.py snapshot)
META_KEYS = ("round", "num_outer", "peer_id")


def _same_int(value: Any, expected: int) -> bool:
    return type(value) is int and value == expected     # not a bool, a float, a str: JSON says what it means


def check_metadata(metadata: Any, *, reply_round: int, num_outer: int, donor: str,
                   max_round: int | None = None, listed_round: int | None = None) -> tuple[Code, str]:
    """Whether a donor's reply metadata is consistent with its header and with who sent it: (Code.OK, "") or a code
    and why. `reply_round` and `num_outer` are the reply header's fields (already ints >= 0), `donor` the stream's
    remote peer id, `max_round` the most we believe of its round (protocol/claims.py; None: no bound): a donor
    that claims more lies about one thing at least, and its state is not taken. `listed_round` the round its record
    announces (None: not listed): a state far behind that claim is refused too (record_overclaims)."""
    if not isinstance(metadata, Mapping):
        return Code.BAD_HEADER, f"metadata is a {type(metadata).__name__}, not an object"
    if type(reply_round) is not int or reply_round < 0:
        return Code.BAD_HEADER, f"round {reply_round!r} is not a round"
    if "round" in metadata and not _same_int(metadata["round"], reply_round):
        return Code.BAD_HEADER, f"metadata round {_short(metadata['round'])} contradicts the header's {reply_round}"
    if "num_outer" in metadata and not _same_int(metadata["num_outer"], num_outer):
        return Code.BAD_HEADER, (f"metadata num_outer {_short(metadata['num_outer'])} contradicts the header's "
                                 f"{num_outer}")
    if "peer_id" in metadata and metadata["peer_id"] != donor:
        return Code.DISTRUSTED, f"claims to be {_short(metadata['peer_id'])}, but the stream is from {donor}"
    if max_round is not None and reply_round > max_round:
        return Code.DISTRUSTED, f"claims round {reply_round}, past the {max_round} we believe it can have reached"
    if record_overclaims(listed_round, reply_round):
        return Code.DISTRUSTED, (f"its record claims round {listed_round}, the state it serves is of round "
                                 f"{reply_round}")
    return Code.OK, ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# How far a donor's listed round may run ahead of the state it serves: its record is announced at round boundaries
# and its snapshot taken at the next one, so an honest record trails or equals the served round (a round of slack
# for a boundary crossed in between, one for a record refreshed just before a stop)
MAX_RECORD_LEAD = 2


def record_overclaims(listed_round: int | None, served_round: int) -> bool:
    """A donor whose listing claims more rounds than the state it just served lied in one of the two (its state's
    round is checked against what we believe of it; its listing was the claim that made it a donor). A joiner's
    first listing may hold nobody else, so what we believe of a lone peer is its own claim: bench/adversary.py's
    ready-liar and Sybils (records 1,000 rounds ahead, states honestly trained) were every joiner's donor at round
    1."""
    return listed_round is not None and listed_round > served_round + MAX_RECORD_LEAD


def pick_donors(believed_rounds: Mapping[str, int], states: Mapping[str, str], tenure_s: Mapping[str, float], *,
                pool: int, rng: random.Random, exclude: Collection[str] = (),
                claimed_rounds: Mapping[str, int] | None = None, first: Collection[str] = (),
                trust: Mapping[str, float] | None = None) -> list[str]:
    """Donor candidates in the order to try them. `believed_rounds`: peer -> its round as far as we believe it
    (RoundClaims); `states`: peer -> announced state; `tenure_s`: peer -> how long we have seen it (absent: 0);
    `claimed_rounds`: what they announce: a peer that claims more than we believe is no donor (it lies about its
    round, and what else is then not ours to find out on our model). Longest-seen first, ties in random order; one
    of the `pool` longest-seen goes first at random. Candidates in `first` go before all others (in that order):
    a DiLoCo fork asks the members that hold its group's model, whatever their tenure. `trust`: peer -> score of
    the peers whose trust our guard lowered (a clip or rejection; it recovers with guard.trust_half_life_s, so a
    rejection keeps a peer behind the others for minutes, not only the ~30 s it is turned away as a partner); they
    go after all others, highest score first. Not left out: a peer that is the odd one out has rejected the very
    peers it must download from (a 3-peer swarm: all of them), and what any donor serves is checked on our own
    batches all the same. Before, a resync drew its donors from every peer alike:
    in CI's hostile-volunteer test an honest resync took over the state of the peer that sent 3x its parameters
    in every exchange (a state honestly trained: nothing on our batches could tell it from an honest one)."""
    claimed = claimed_rounds or {}
    cands = [p for p, r in believed_rounds.items()
             if r > 0 and states.get(p) != "joining" and p not in exclude and claimed.get(p, r) <= r]
    rng.shuffle(cands)                                           # ties: random
    cands.sort(key=lambda p: -tenure_s.get(p, 0.0))              # stable: keeps the shuffle among ties
    top = cands[:pool]
    rng.shuffle(top)
    ordered = top + cands[pool:]
    low = trust or {}
    ordered = [p for p in ordered if p not in low] + sorted((p for p in ordered if p in low), key=lambda p: -low[p])
    early = [p for p in first if p in ordered]
    return early + [p for p in ordered if p not in early]


@dataclass(frozen=True)
class CrossCheck:
    """Which of two donors' states to adopt: `first` (True: the first), whether they agreed, and why."""
    first: bool
    agreed: bool
    reason: str


def cross_check(distance: float, first_loss: float, second_loss: float, *, agree: float) -> CrossCheck:
    """Two donors' states: `distance` = ||a - b|| / ||b|| and each one's loss on our private batches. Within
    `agree`: they confirm each other (the first is adopted). Further apart (or not finite): one of them is not the
    swarm's state, and the one our own data prefers is adopted."""
    if math.isfinite(distance) and distance <= agree:
        return CrossCheck(True, True, f"the donors agree (distance {distance:.3g} <= {agree:g})")
    first_better = math.isfinite(first_loss) and (not math.isfinite(second_loss) or first_loss <= second_loss)
    return CrossCheck(first_better, False,
                      f"the donors disagree (distance {distance:.3g} > {agree:g}); losses on our own batches "
                      f"{first_loss:.4f} and {second_loss:.4f}")


def adopted_round(rounds: Collection[int], believed_cap: int | None) -> int:
    """The round a joiner takes over: the lowest of the donors' (checked) rounds, cut to what we believe of the
    donor (`believed_cap`, None: no cap). The lr decay follows it, so a lie can at most move it to the cap."""
    r = min(rounds)
    return r if believed_cap is None else max(0, min(r, believed_cap))
