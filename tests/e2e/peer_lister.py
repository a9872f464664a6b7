"""A DHT observer for e2e tests, run as its own process (forking a DHT from inside pytest, which has threads, can
deadlock): every --period-s it writes the run's live peer listing, exactly as peers read it, to --out as JSON
{"time": unix_s, "peers": {peer_id: record}} (atomically). SIGTERM stops it."""
from __future__ import annotations

import argparse
import json
import os
import signal
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--initial-peers", nargs="+", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--period-s", type=float, default=0.05)
    args = ap.parse_args()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))

    from gasloc.peer.swarm.membership import bucket_key, make_validators, parse_listing
    from gasloc.runtime.safeproc import SafeDHT, remove_own_shm

    # the validators also strip the records' signatures: without them hivemind cannot decode a signed value
    dht = SafeDHT(initial_peers=args.initial_peers, start=True, client_mode=True,
                  host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators(args.run_id)[1])
    try:
        while not stopping:
            # an e2e swarm (a dozen peers at most) sits at level 0 or 1 (protocol/buckets.py): every record has a
            # copy in level 0's one bucket or in one of level 1's two
            peers = {}
            for level, bucket in ((0, 0), (1, 0), (1, 1)):
                found = dht.get(bucket_key(args.run_id, level, bucket), latest=True)
                peers.update({pid: r.dict() for pid, r in parse_listing(found, time.time()).items()})
            tmp = f"{args.out}.tmp"
            with open(tmp, "w") as f:
                json.dump({"time": time.time(), "peers": peers}, f)
            os.replace(tmp, args.out)
            time.sleep(args.period_s)
    finally:
        dht.shutdown()
        remove_own_shm()


if __name__ == "__main__":
    main()
