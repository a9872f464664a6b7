"""Reachability: who can call whom, and the messages of the forwarding service (peer/swarm/forward.py). Pure.

A peer is `direct` (others can dial it), `relayed` (behind NAT, but attached to at least one public peer that
forwards streams to it) or `outbound-only` (behind NAT and attached to nobody: it can only call). Its record says
which, and lists the forwarders it is attached to (`via`).

Who calls whom: a NATed peer can always dial a public one; a NATed peer is reached through a forwarder it is
attached to: the caller opens a stream to the forwarder, which opens one to the callee over the connection the
callee keeps open to it (the callee dialled out, so its NAT lets that connection in), and copies bytes both ways.
A NATed peer attached to nobody is never called (it calls). Nothing here depends on libp2p's relays, whose
limits the bundled daemon does not let us set for sure (docs/nat.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from gasloc.protocol.messages import PROTOCOL_VERSION, _Wire

RECORD_REACH = ("direct", "relayed", "outbound-only")
MAX_VIA = 8            # forwarders listed in a record (and attached to at once)
MAX_PROBE_ADDRS = 8    # addresses one probe may ask a prober to dial
Route = Literal["direct", "forwarded"]


def record_reach(private: bool, attached: int) -> str:
    """Our record's reachability from what we know of ourselves."""
    if not private:
        return "direct"
    return "relayed" if attached > 0 else "outbound-only"


def route(ours: str, theirs: str, their_via: Sequence[str]) -> Route | None:
    """How we call a peer: directly, through one of its forwarders, or not at all (None: it will call us).

    - it is direct: we dial it (whoever we are; a NATed peer can always dial out);
    - it is behind NAT and attached to a forwarder (`relayed`): through the forwarder, whoever we are. For a
      public caller that spends the forwarder's link on a pair that has a direct path the other way, but without
      it a NATed peer gets a partner only when it calls: measured on the NAT lab, NATed peers then waited 0.56 s
      per round against the public peers' 0.17 s and finished 70% of their rounds;
    - `outbound-only` (attached to nobody): nobody can reach it - we do not call; it calls us."""
    if theirs == "direct":
        return "direct"
    return "forwarded" if their_via else None


def probe_verdict(answers: Sequence[bool]) -> bool | None:
    """Reachable from outside? As Petals decides: yes when at least half of the probers that answered could dial us
    back; None when nobody answered (we cannot tell)."""
    if not answers:
        return None
    return sum(answers) * 2 >= len(answers)


def probed_reachability(have_addrs: bool, asked: int, answers: Sequence[bool]) -> tuple[bool, str]:
    """(behind NAT?, how we know) for reachability "auto", from the probe: `have_addrs` - we had an address
    another host could dial; `asked` probers; `answers` from those that replied.

    Loopback only is a swarm on one machine (everyone dials everyone): public. Nobody to ask, or nobody answered:
    public as well, marked unprobed - a peer that wrongly thinks itself public costs others a dial that times out
    (the situation before this rule existed), one that wrongly thinks itself NATed never gets called at all."""
    if not have_addrs:
        return False, "unprobed(loopback only)"
    if not asked:
        return False, "unprobed(no peer to ask)"
    verdict = probe_verdict(answers)
    if verdict is None:
        return False, "unprobed(no prober answered)"
    return not verdict, f"probe({sum(answers)}/{len(answers)} dialled back)"


def reprobe_due(now: float, probed_at: float, every_s: float, addrs: Sequence[tuple[str, int]],
                probed_addrs: Sequence[tuple[str, int]]) -> str | None:
    """Why a running peer should probe its reachability again now, or None. `every_s` 0: never (only the probe at
    start). Otherwise at once when the addresses we would ask probers to dial (announced, else what libp2p reports,
    as at start) differ from those of the last probe - a new network, a new port mapping - and every `every_s`
    seconds anyway (a router can start or stop forwarding our port without any address of ours changing). Times on
    one monotonic clock."""
    if every_s <= 0:
        return None
    if sorted(addrs) != sorted(probed_addrs):
        return "addresses changed"
    if now - probed_at >= every_s:
        return "period"
    return None


def reprobed_reachability(private: bool, have_addrs: bool, asked: int, answers: Sequence[bool]) -> tuple[bool, str]:
    """(behind NAT?, how we know) after a probe on a running peer that believes `private` now. As at start
    (probed_reachability), except that a probe that could not decide - no address to offer, nobody to ask, nobody
    answered - keeps the current verdict: at start "public" is the safer guess for a peer nobody knows yet, but a
    running peer's last real answer is a better guess than none, and a flip costs an attach or detach and a
    re-announcement."""
    now_private, source = probed_reachability(have_addrs, asked, answers)
    if source.startswith("unprobed("):
        return private, source
    return now_private, source


class RelayRequest(_Wire):
    """First frame on a stream to a peer's relay service.

    kind "attach": keep this stream (and so our connection to you) open and forward to me what others send me;
    "forward": connect this stream to `target`'s handler `handler` (an attached peer of yours);
    "probe": try to open a TCP connection to each of `addrs` (host, port) and tell me which worked."""
    protocol_version: int = PROTOCOL_VERSION
    kind: Literal["attach", "forward", "probe"]
    target: str = Field("", max_length=128)
    handler: str = Field("", max_length=200)
    addrs: tuple[tuple[str, int], ...] = Field((), max_length=MAX_PROBE_ADDRS)


class RelayReply(_Wire):
    protocol_version: int = PROTOCOL_VERSION
    code: int
    message: str = Field("", max_length=500)
    reachable: tuple[bool, ...] = Field((), max_length=MAX_PROBE_ADDRS)   # probe: one per requested address


class ForwardedHello(_Wire):
    """First frame a forwarder writes on the stream it opens to an attached peer: whose stream this is and for
    which of the peer's handlers. The peer trusts `origin` as far as it trusts the forwarder (a live member)."""
    protocol_version: int = PROTOCOL_VERSION
    origin: str = Field(max_length=128)
    handler: str = Field(max_length=200)
