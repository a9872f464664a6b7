"""Multiaddr helpers shared by commands that take peer addresses (bootstrap, doctor; peers may use them too).
Pure string work: no hivemind import, so config validation stays fast."""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path

# /ip4/1.2.3.4/tcp/31337/p2p/Qm... (also ip6, dns*, udp/quic-v1)
FULL_MADDR = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/[^/]+/(tcp|udp)/\d+(/quic(-v1)?)?/p2p/[1-9A-HJ-NP-Za-km-z]+$")


def expand_initial_peers(items: list[str], base: Path | None = None) -> list[str]:
    """Each item is a full multiaddr ending in /p2p/<peer id>, or a file listing them one per line ('#' comments),
    like the one `gasloc bootstrap --maddrs-file` writes. Raises ValueError naming the first bad item."""
    out: list[str] = []
    for item in items:
        item = str(item).strip()
        path = Path(item) if base is None or Path(item).is_absolute() else base / item
        # an absolute file path also starts with "/": an existing file wins over a (malformed) multiaddr
        if item.startswith("/") and not path.is_file():
            if not FULL_MADDR.match(item):
                raise ValueError(f"initial peer {item!r} is not a full multiaddr like "
                                 f"/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW... (it must end with /p2p/<peer id>)")
            out.append(item)
            continue
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ValueError(f"initial peer {item!r} is neither a multiaddr (starting with /) nor a readable file "
                             f"({e.strerror})") from None
        listed = [ln.split("#", 1)[0].strip() for ln in lines]
        listed = [ln for ln in listed if ln]
        if not listed:
            raise ValueError(f"initial peers file {item!r} lists no multiaddr")
        for ln in listed:
            if not FULL_MADDR.match(ln):
                raise ValueError(f"initial peers file {item!r} holds {ln!r}, which is not a full multiaddr ending "
                                 f"with /p2p/<peer id>")
        out.extend(listed)
    return list(dict.fromkeys(out))


def host_of(maddr: str) -> tuple[str, str]:
    """('ip4'|'ip6'|'dns'..., host) of a multiaddr."""
    parts = maddr.split("/")
    if len(parts) < 3 or not parts[1]:
        raise ValueError(f"{maddr!r} is not a multiaddr")
    return parts[1], parts[2]


def port_of(maddr: str) -> tuple[str, int] | None:
    """('tcp'|'udp', port) of a multiaddr, if it has one."""
    parts = maddr.split("/")
    for proto in ("tcp", "udp"):
        if proto in parts:
            i = parts.index(proto)
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                return proto, int(parts[i + 1])
    return None


def peer_id_of(maddr: str) -> str | None:
    parts = maddr.split("/")
    return parts[parts.index("p2p") + 1] if "p2p" in parts and parts.index("p2p") + 1 < len(parts) else None


def address_scope(maddr: str) -> str:
    """'loopback', 'private' (RFC 1918, link-local, CGNAT, ULA, documentation ranges), 'unspecified', 'public', or
    'dns' (a name: resolved by the dialer, so it is taken as public)."""
    kind, host = host_of(maddr)
    if kind.startswith("dns"):
        return "dns"
    ip = ipaddress.ip_address(host)
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_private or ip.is_link_local or ip in ipaddress.ip_network("100.64.0.0/10"):
        return "private"
    return "public" if ip.is_global else "private"


# multiaddr protocols that take a value (the next path component), and the ones that take none; a protocol in
# neither ends the check (p2pd judges the rest)
_VALUED = {"ip4", "ip6", "tcp", "udp", "dns", "dns4", "dns6", "dnsaddr", "p2p", "ipfs"}
_BARE = {"quic", "quic-v1", "ws", "wss", "tls", "noise", "p2p-circuit", "webtransport", "http", "https"}


def check_maddrs(v: list[str] | None) -> list[str] | None:
    """A listen/announce multiaddr must look like one, with ports in 0-65535 and IP addresses that parse: caught
    here, a typo is a one-line config error, not a p2pd start-up failure after the node has begun to start."""
    for m in v or ():
        if not m.startswith("/"):
            raise ValueError(f"{m!r} is not a multiaddr (like /ip4/0.0.0.0/tcp/31337)")
        parts, i = m.split("/")[1:], 0
        while i < len(parts) and parts[i] in _VALUED | _BARE:
            proto = parts[i]
            if proto in _BARE:
                i += 1
                continue
            value = parts[i + 1] if i + 1 < len(parts) else ""
            if proto in ("tcp", "udp") and not (value.isdigit() and int(value) <= 65535):
                raise ValueError(f"{m!r}: {proto} port {value!r} is not a number from 0 to 65535")
            if proto in ("ip4", "ip6"):
                try:
                    (ipaddress.IPv4Address if proto == "ip4" else ipaddress.IPv6Address)(value)
                except ValueError:
                    raise ValueError(f"{m!r}: {value!r} is not an {proto} address") from None
            if not value:
                raise ValueError(f"{m!r}: /{proto} needs a value")
            i += 2
    return v


def check_announce_ports(v: list[str]) -> list[str]:
    """Port 0 means 'any' when listening; announced, nobody could dial it."""
    for m in v:
        if re.search(r"/(tcp|udp)/0(/|$)", m):
            raise ValueError(f"announce address {m!r} has port 0: peers cannot dial it; give the real port")
    return v
