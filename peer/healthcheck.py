"""Container health check: `python -m gasloc.peer.healthcheck [--tcp-port P] [--file F] [--fresh F --max-age-s S]`.

Healthy (exit 0) when every requested check passes:
  --tcp-port P   something accepts TCP connections on 127.0.0.1:P (the node's p2pd listens on 0.0.0.0:P)
  --file F       F exists and is not empty (the bootstrap's maddrs file: it is written once the node is up)
  --fresh F      F was modified within --max-age-s seconds (a peer appends to metrics.jsonl every round)
Otherwise it prints one line saying which check failed and exits 1, which is what Docker's HEALTHCHECK reads.
Kept free of torch and hivemind imports so that a check costs milliseconds, not seconds.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path


def check(tcp_port: int | None = None, file: Path | None = None, fresh: Path | None = None,
          max_age_s: float = 900.0, timeout_s: float = 3.0) -> str | None:
    """None when healthy, else the reason (one line)."""
    if tcp_port is not None:
        try:
            with socket.create_connection(("127.0.0.1", tcp_port), timeout=timeout_s):
                pass
        except OSError as e:
            return f"nothing accepts TCP connections on port {tcp_port} ({e.strerror or e})"
    if file is not None:
        try:
            if file.stat().st_size == 0:
                return f"{file} is empty"
        except OSError:
            return f"{file} does not exist yet"
    if fresh is not None:
        try:
            age = time.time() - fresh.stat().st_mtime
        except OSError:
            return f"{fresh} does not exist yet"
        if age > max_age_s:
            return f"{fresh} was last written {age:.0f} s ago (more than {max_age_s:.0f} s): training is stuck"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gasloc.peer.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("--tcp-port", type=int, help="a port that must accept TCP connections on 127.0.0.1")
    p.add_argument("--file", type=Path, help="a file that must exist and be non-empty")
    p.add_argument("--fresh", type=Path, help="a file that must have been written recently")
    p.add_argument("--max-age-s", type=float, default=900.0, help="how recent --fresh must be [900]")
    args = p.parse_args(argv)
    if args.tcp_port is None and args.file is None and args.fresh is None:
        p.error("give at least one of --tcp-port, --file, --fresh")
    reason = check(args.tcp_port, args.file, args.fresh, args.max_age_s)
    if reason:
        print(f"unhealthy: {reason}")
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
