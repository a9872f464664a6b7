"""Membership at scale (issue 13 items 1-2): what one searching peer reads from the DHT, and spends in CPU, to find
a ready partner among N members, with bucketed records against the single key of the layout before them.

Everything DHT-side is real and runs the peer's own code: `--dht-nodes` hivemind DHT processes (each with its
p2pd) hold the records; N members' records, each signed with the member's own key (`--identity`: Ed25519, what a
peer makes, or RSA-2048 as identity files made before 2026-12-04 hold), are written through the peer's `Membership`
(its store call into the keys `announce` writes, failed stores retried; one writer node signs for every member,
`MultiSigner`, since a DHT node signs with the keys its validators hold); the searching peer runs its own DHT
process with the peer's validators (`make_validators`) and an identity of the same kind and reads through `BucketReader` (listing, find) or, for the old design, a get of the single
key, parsed by `parse_listing` in both cases; peer exchange is the peer's `HintBook` / `merge_view` / `pick_hints`.

What is modelled, not run: the members themselves. Each has a fixed record: "exchanging" (ready) for
round(`--ready-share` x N) of them, drawn at random, else "training". A call to a ready member finds it free with
probability 1 - `--busy-share` (it may have paired meanwhile), after `--call-s` (a handshake); a busy member
answers with the hints a peer holding two listings' buckets would send (`pick_hints` over them) and, with
`--signed-hints` (the live peer), the signed records of the first 4 of them, as its bucket reads kept them
(`SignedRecords.attach`); the searcher checks such a record with the peer's `Admission` before it calls that peer,
instead of looking it up (`finds`). The callee's membership check of the searcher
is real: by default (`--callee-check inline`) the searcher's own signed record, as its requests carry it, checked
by the peer's `Admission` (one per callee, so each callee verifies it once, as a live callee does), on the callee's
CPU (reported apart: `callee_cpu_ms_per_round`), no DHT read; with `--callee-check lookup`, as before inline
records, a `find` of the searcher's record in its bucket from another DHT node, counted in the searcher's bytes.

One search (one round of a searching peer):
  buckets     list one bucket of the level below ours (`listing_level`, as the live listing does: the
              background refresh a round sees); while no ready peer is in
              sight, another bucket after listing_interval_s (0.3 s, doubling); call a ready peer from the
              listing or from hints (a hinted peer's handed record is checked first, `hint_checks`; without
              one it is looked up, one get, `finds`), until one is free or --deadline-s passes
  single-key  the peer before buckets: list the whole key (the first listing of the search), then every 0.3 s
              while nobody ready is free
Fresh records (the default): before each search the searcher's cached record checks are dropped, as if every
record had been re-signed since the last round, as a live swarm's are (`--static-records` keeps them).
Figures per design and N: dht_bytes_per_round (searcher's gets + a lookup callee's check of it, entry_bytes: each
get's merged answer counted once), dht_wire_in_per_round / dht_wire_out_per_round (what the searcher's DHT node
received and sent in its RPCs: every node a get asks sends its own copy of the bucket, so with --get-beam 3 about
three copies),
cpu_ms_per_round (CPU of the searcher's DHT process and its p2pd, plus our own process's - the bench thread's
parsing and checks and hivemind's thread receiving the gets' results - per search; split into dht_cpu_ms,
p2pd_cpu_ms, parse_cpu_ms; the modelled callees' CPU is apart, callee_cpu_ms),
partner_found_s_median (over the searches that found one), partner_found_share, and the startup probe's bytes.
The single key is expected to fail at ~4,000 records (one response over p2pd's 4 MiB message limit): its row
then carries `error`.

    python bench/scale.py --json scale.json                         # N = 10, 100, 1000, 5000
    python bench/scale.py --members 10,100 --searches 5 --dht-nodes 3 --json quick.json
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

KEY_BITS = 2048


# ---------------------------------------------------------------------------------------------------- keys
def _gen_key(_i: int) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    key = rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)
    return key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def load_keys(path: Path, n: int) -> list:
    """n RSA keys, generated once (50 ms of CPU each) and kept in `path` for the next run."""
    import multiprocessing as mp

    from cryptography.hazmat.primitives import serialization
    from hivemind.utils.crypto import RSAPrivateKey

    ders: list[bytes] = []
    if path.exists():
        blob = path.read_bytes()
        i = 0
        while i < len(blob):
            size = int.from_bytes(blob[i:i + 4], "big")
            ders.append(blob[i + 4:i + 4 + size])
            i += 4 + size
    if len(ders) < n:
        t0 = time.monotonic()
        with mp.get_context("fork").Pool(max(1, min(4, os.cpu_count() or 1))) as pool:
            ders += pool.map(_gen_key, range(n - len(ders)), chunksize=16)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(len(d).to_bytes(4, "big") + d for d in ders))
        print(f"generated {n} RSA-{KEY_BITS} keys in {time.monotonic() - t0:.0f} s -> {path}", file=sys.stderr)
    keys = []
    for der in ders[:n]:
        k = RSAPrivateKey.__new__(RSAPrivateKey)
        k._private_key = serialization.load_der_private_key(der, password=None)
        keys.append(k)
    return keys


def ed25519_identities(n: int, seed: int) -> list:
    """n Ed25519 identities, the kind a peer makes (runtime/identity.py), from `seed` (no cache: 50 us each)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gasloc.runtime.identity import Ed25519Identity
    rng = random.Random(seed)
    return [Ed25519Identity(Ed25519PrivateKey.from_private_bytes(rng.randbytes(32))) for _ in range(n)]


def _multi_signer(signers):
    """A validator that signs each record with the key of the member whose public key its subkey holds (one writer
    node stores for every member), of either kind; validates and strips like the validators every peer runs."""
    from gasloc.peer.swarm.membership import CachedEd25519Validator, CachedSignatureValidator

    base = CachedEd25519Validator if isinstance(signers[0], CachedEd25519Validator) else CachedSignatureValidator

    class MultiSigner(base):
        def __init__(self, signers):
            self.__dict__.update(signers[0].__dict__)
            self.by_key = {s.local_public_key: s for s in signers}

        def sign_value(self, record):
            for marker, s in self.by_key.items():
                if marker in (record.subkey or b""):
                    return s.sign_value(record)
            return record.value

    return MultiSigner(signers)


# ---------------------------------------------------------------------------------------------------- CPU
def _task_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads, to the nanosecond (/proc/<pid>/task/*/schedstat, first field): the
    10-ms ticks of /proc/<pid>/stat made one search read 0, 10 or 20 ms, so a row's mean moved by 0.5 ms per tick
    over 20 searches. A thread that exits between two readings takes its time with it: the DHT process's and
    p2pd's threads live as long as they do."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
    return total / 1e9


def proc_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of a process (the DHT process) and, apart, of its descendants (its p2pd)."""
    own, rest, stack = 0.0, 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            if p == pid:
                own += _task_cpu_s(p)
            else:
                rest += _task_cpu_s(p)
            for t in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return own, rest


async def _wire_bytes(_dht, node) -> tuple[int, int]:
    """Run in the searcher's DHT process (DHT.run_coroutine): bytes its DHT node has received and sent in RPCs
    (hivemind's unary calls through p2pd: finds, stores, pings; the serialized messages, without p2pd's framing),
    counted from the first call on. This is what the network carries: a `latest` get takes a bucket from every
    node it asks that holds a replica, while entry_bytes counts the merged result once."""
    client = node.protocol.p2p._client
    counts = client.__dict__.get("_gasloc_wire")
    if counts is None:
        counts = client._gasloc_wire = [0, 0]
        call = client.call_unary_handler

        async def counted(peer_id, handler_name, data):
            counts[1] += len(data)
            out = await call(peer_id, handler_name, data)
            counts[0] += len(out)
            return out
        client.call_unary_handler = counted
    return counts[0], counts[1]


async def _forget_checks(_dht, node) -> int:
    """Run in the searcher's DHT process (DHT.run_coroutine): drop its validators' cached results
    (CachedSignatureValidator, BucketSchemaValidator), as if every record had been signed anew since the last
    search. A live record is re-announced every announce_ttl_s / 3 (5 s) and at each state change, so by the next
    round a peer's record is new bytes and checking it is a miss; within one search the cache still saves the
    checks of the other replicas' copies. The bench's members store once, so without this every listing after the
    first pass over the buckets would cost a dict lookup per record, a faster path than the daemon runs."""
    dropped = 0
    for v in getattr(node.protocol.record_validator, "_validators", ()):
        cache = v.__dict__.get("_checked")
        if cache is not None:
            dropped += len(cache)
            cache.clear()
    return dropped


# ---------------------------------------------------------------------------------------------------- swarm
class Bench:
    def __init__(self, o: dict):
        self.o = o
        self.rng = random.Random(o["seed"])
        self.nodes: list = []
        self.workdir = Path(tempfile.mkdtemp(prefix="gasloc-scale-"))

    def start(self, run_ids: list[str], keys: list) -> None:
        from hivemind.p2p import P2P

        from gasloc.peer.swarm.membership import (
            DHT_CACHE_NEAREST,
            BucketSchemaValidator,
            load_identity,
            make_validators,
        )
        from gasloc.runtime.identity import write_identity_file
        from gasloc.runtime.safeproc import SafeDHT

        def signature_checks():
            """The signature validators a peer's DHT node runs (both kinds), with fresh keys of their own."""
            return [v for v in make_validators(run_ids[0])[1] if not isinstance(v, BucketSchemaValidator)]

        schemas = [BucketSchemaValidator(r) for r in run_ids]
        local = ["/ip4/127.0.0.1/tcp/0"]
        first = None
        for _ in range(self.o["dht_nodes"]):
            # the holders: other peers' DHT nodes, with the validators a peer runs
            d = SafeDHT(initial_peers=first, start=True, host_maddrs=local,
                        record_validators=[*signature_checks(), *schemas])
            first = first or [str(m) for m in d.get_visible_maddrs()]
            self.nodes.append(d)
        self.initial = first
        self.member_signers = [make_validators(run_ids[0], k)[0] for k in keys]
        # the writer signs for every member; client mode: it stores on the holders, holds nothing itself. It
        # stores thousands of records at once, so it never blacklists a holder: at 5,000 members its RPCs timed
        # out, it blacklisted every holder (5 s, doubling) and 2,309 of 15,000 stores then failed five times over
        # (a live peer stores only its own record). A store that times out is retried (populate)
        self.writer = SafeDHT(initial_peers=first, start=True, host_maddrs=local, client_mode=True,
                              blacklist_time=0,
                              # the multi-signer first: the checker of its own kind merges into it (and
                              # would otherwise absorb it, signing nothing)
                              record_validators=[_multi_signer(self.member_signers), *signature_checks(), *schemas])
        # the searching peer: its own libp2p identity, the validators a peer runs
        ident = self.workdir / "searcher.key"
        # the identity a peer makes now (Ed25519), or with --identity rsa an RSA file as hivemind makes them
        if self.o["identity"] == "ed25519":
            write_identity_file(ident)
        else:
            P2P.generate_identity(str(ident))
        # exactly what a peer gives its DHT (make_validators), plus the other sizes' run ids
        self.searcher_signer, validators = make_validators(run_ids[0], load_identity(ident))
        self.searcher = SafeDHT(initial_peers=first, start=True, host_maddrs=local, client_mode=True,
                                identity_path=str(ident), cache_nearest=DHT_CACHE_NEAREST,
                                record_validators=[*validators, *(BucketSchemaValidator(r) for r in run_ids[1:])])

    def stop(self) -> None:
        for d in [*self.nodes, getattr(self, "writer", None), getattr(self, "searcher", None)]:
            if d is not None:
                d.shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ populate
    async def populate(self, run_id: str, n: int) -> dict[str, str]:
        """N members' records, in both layouts: bucket keys through Membership.announce at the level a converged
        swarm of N holds, and the single key as gasloc before buckets stored it. Returns peer id -> state."""
        from gasloc.peer.swarm.membership import Membership, entry_bytes, peer_id_of, peers_key, signed_member
        from gasloc.protocol.buckets import level_for

        level = level_for(n)
        truth: dict[str, str] = {}
        members = []
        # exactly round(ready_share * n) ready members: a draw per member made 5 of 100 ready (seed 0), half the
        # share the row claims, and those 5 sat in 4 of the 16 buckets
        ready = set(self.rng.sample(range(n), max(1, round(self.o["ready_share"] * n))))
        for i, s in enumerate(self.member_signers[:n]):
            pid = peer_id_of(s.local_public_key)
            m = Membership(self.writer, s, run_id=run_id, peer_id=pid, fingerprint="bench", protocol=1,
                           ttl_s=self.o["ttl_s"], request_timeout_s=10.0)
            m.level = level
            state = "exchanging" if i in ready else "training"
            truth[pid] = state
            members.append((m, m.record(state=state, round=10, throughput_tps=1000.0, bandwidth_bps=1e7,
                                        loss=3.2, val_loss=3.3, round_s=12.0, partners=[])))

        async def old_store(m, rec):
            exp = time.time() + self.o["ttl_s"]
            return await m._store(peers_key(run_id), rec.dict(), exp)

        from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time
        m, rec = members[0]
        self.entry_size = entry_bytes(ValueWithExpiration({m.subkey: ValueWithExpiration(rec.dict(), 0.0)}, 0.0))
        # every store of both layouts: each member's bucket keys (Membership._keys: its level and the one below,
        # with the peer's store call) and the single key. On a loaded machine a share of them reaches no server in
        # time (222 of 3,000 at N = 1,000 in one run): those are retried, as a live peer re-announces, up to 4 times
        exp = get_dht_time() + self.o["ttl_s"]
        jobs = [(m, k, r) for m, r in members for k in m._keys()] + [(m, None, r) for m, r in members]
        for attempt in range(5):
            failed = []
            for i in range(0, len(jobs), 96):
                batch = jobs[i:i + 96]
                oks = await asyncio.gather(*(m._store(k, r.dict(), exp) if k is not None else old_store(m, r)
                                             for m, k, r in batch))
                failed += [j for j, ok in zip(batch, oks) if not ok]
            if not failed:
                break
            print(f"N={n}: {len(failed)} of {len(jobs)} stores not accepted (pass {attempt + 1})", file=sys.stderr)
            jobs = failed
        self.store_failures = len(failed)
        self.single_key_failures = sum(k is None for _, k, _ in failed)   # stores into the old single key
        self.visible = await self._visible_share(run_id, truth, level)
        # what a member's bucket reads give it of each record it reads: the signed record, as stored (signed
        # hints: a busy member's reply carries those of the peers it hints at, signed_hints.py)
        self.signed = {m.peer_id: signed_member(self.member_signers[i], m._keys()[0], r.dict(), exp)
                       for i, (m, r) in enumerate(members)}
        return truth

    async def _visible_share(self, run_id: str, truth: dict[str, str], level: int, sample: int = 16) -> float:
        """Share of the records of `sample` buckets that a get returns: a store that
        reached no server (all timed out) says ok from a client's own storage, and a row over fewer records than
        N is not a row of N (the first 5,000-member run read buckets holding a quarter of their records)."""
        from hivemind.utils.timed_storage import get_dht_time

        from gasloc.peer.swarm.membership import bucket_key, parse_listing
        from gasloc.protocol.buckets import bucket_of

        want: dict[int, set[str]] = {}
        for p in truth:
            want.setdefault(bucket_of(p, level), set()).add(p)
        picks = self.rng.sample(sorted(want), min(sample, len(want)))
        got = 0
        for b in picks:
            # through a holder (its get reads the others too), not the searcher, whose DHT would then hold these
            # records' checks in its cache before the searches are measured
            found = await self.nodes[0].get(bucket_key(run_id, level, b), latest=True, return_future=True)
            got += len(set(parse_listing(found, now=get_dht_time())) & want[b])
        share = got / max(1, sum(len(want[b]) for b in picks))
        print(f"N={len(truth)}: {share:.3f} of the sampled buckets' records visible", file=sys.stderr)
        return share

    # ------------------------------------------------------------------ one search, bucketed
    def _callee_reply(self, truth: dict[str, str], by_bucket: dict[int, list[str]], level: int, callee: str):
        """What a busy member tells us: pick_hints over the records a peer holds (two buckets of the level its
        listings read, `listing_level`), and
        the signed records of those it names (the live Network.members_for: SignedRecords.attach, at most 4, in
        the hints' order, ready ones first), as its bucket reads kept them."""
        from hivemind.utils.timed_storage import get_dht_time

        from gasloc.peer.swarm.signed_hints import SignedRecords
        from gasloc.protocol.buckets import HintBook, bucket_of, listing_level, pick_hints

        lv = listing_level(level)
        mine = {bucket_of(callee, lv), self.rng.randrange(1 << lv)}
        view = {p: (truth[p], 10) for b in mine for p in by_bucket.get(b, [])}
        hints = pick_hints(view, HintBook(callee), time.monotonic(), exclude=(callee,), rng=self.rng)
        held = SignedRecords()
        for p in view:
            held.keep(p, self.signed[p])
        members = held.attach([h.peer_id for h in hints], get_dht_time()) if self.o["signed_hints"] else ()
        return hints, members

    def callee_admits(self, callee: str, me: str, inline) -> tuple[bool, str, float]:
        """The callee's check of our inline record, as the live peer's `Network.admit_caller` runs it (each callee
        with its own Admission and cache): (admitted, why not, callee CPU seconds)."""
        from hivemind.utils.timed_storage import get_dht_time

        from gasloc.peer.swarm.admission import Admission

        t0 = time.thread_time()
        adm = self.admissions.get(callee)
        if adm is None:
            adm = self.admissions[callee] = Admission(self.run_id, fingerprint="bench", protocol=1,
                                                      validators=self.callee_validators)
        rec, why = adm.check(me, inline, get_dht_time()) if inline is not None else (None, "no inline record")
        return rec is not None, why, time.thread_time() - t0

    async def search_buckets(self, reader, responder, me: str, truth: dict[str, str],
                             by_bucket: dict[int, list[str]], level: int) -> dict:
        from hivemind.utils.timed_storage import get_dht_time

        from gasloc.peer.swarm.signed_hints import SignedRecords
        from gasloc.protocol.buckets import HintBook, listing_interval_s, merge_view

        o = self.o
        book = HintBook(me)
        handed = SignedRecords()     # what busy members' replies handed us (the live Network.signed)
        view: dict = {}
        tried: set[str] = set()
        listings = calls = finds = hint_checks = 0
        callee_cpu = 0.0
        ready_seen: set[str] = set()
        t0 = time.monotonic()
        next_listing = t0
        while time.monotonic() - t0 < o["deadline_s"]:
            now = time.monotonic()
            _, ready = merge_view({p: (r.state, r.round) for p, r in view.items()}, book, now)
            ready_seen |= ready
            cands = sorted(ready - tried - {me})
            if not cands:
                if now >= next_listing:
                    view.update(reader.prune(await reader.listing() or {}))
                    listings += 1
                    next_listing = time.monotonic() + listing_interval_s(listings)
                else:   # nothing else can show a ready peer before the next listing (no caller in this model)
                    await asyncio.sleep(next_listing - now)
                continue
            peer = self.rng.choice(cands)
            tried.add(peer)
            if peer not in view:                 # a hinted peer: its record first (the initiator's check)
                rec = None
                if handed.has_offer(peer):       # its signed record came with the hint (Network.confirm_member)
                    hint_checks += 1
                    rec, _why = handed.check(peer, self.searcher_admission, get_dht_time())
                if rec is None:
                    finds += 1
                    rec = await reader.find(peer)
                if rec is None:
                    continue
                view[peer] = rec
            calls += 1
            if o["callee_check"] == "lookup":
                if await responder.find(me) is None:  # the callee's check of us, in our bucket
                    return {"found": False, "s": None, "listings": listings, "calls": calls, "finds": finds,
                            "callee_cpu_s": callee_cpu, "ready_seen": len(ready_seen),
                            "error": "searcher not found by callee"}
            else:
                ok, why, cpu = self.callee_admits(peer, me, reader.inline)
                callee_cpu += cpu
                if not ok:
                    return {"found": False, "s": None, "listings": listings, "calls": calls, "finds": finds,
                            "callee_cpu_s": callee_cpu, "ready_seen": len(ready_seen),
                            "error": f"searcher refused by callee: {why}"}
            await asyncio.sleep(o["call_s"])
            if truth.get(peer) == "exchanging" and self.rng.random() >= o["busy_share"]:
                return {"found": True, "s": time.monotonic() - t0, "listings": listings, "calls": calls,
                        "finds": finds, "hint_checks": hint_checks, "callee_cpu_s": callee_cpu,
                        "ready_seen": len(ready_seen)}
            t_model = time.thread_time()         # the callee's side of the reply: its CPU, not ours
            hints, members = self._callee_reply(truth, by_bucket, level, peer)
            callee_cpu += time.thread_time() - t_model
            book.heard(peer, hints, time.monotonic())
            handed.offered(peer, members)
        return {"found": False, "s": None, "listings": listings, "calls": calls, "finds": finds,
                "hint_checks": hint_checks, "callee_cpu_s": callee_cpu, "ready_seen": len(ready_seen)}

    def _single_key_why(self, n: int, whole_mib: float) -> str:
        """Why a listing of the single key came back short: the whole key in one response is over p2pd's message
        limit (RSA records at 5,000 members), or the key never held every record (smaller Ed25519 records: at
        5,000 members stores into the key timed out or were refused once it held some 1,600-1,900; the mechanism
        was not traced, the old layout being only the baseline)."""
        if whole_mib > 4:
            return f"one response of ~{whole_mib:.1f} MiB; p2pd's message limit is 4 MiB"
        return (f"{self.single_key_failures} of its {n} records were never stored: stores into one key of "
                f"~{whole_mib:.1f} MiB failed")

    # ------------------------------------------------------------------ one search, single key
    async def search_single(self, reader, me: str, truth: dict[str, str]) -> dict:
        """The peer before buckets: every listing reads the whole key; a ready peer is called as above."""
        o = self.o
        t0 = time.monotonic()
        listings = 0
        tried: set[str] = set()
        while time.monotonic() - t0 < o["deadline_s"]:
            found = await reader.legacy_peers()
            listings += 1
            if found is None or len(found) < len(truth) // 2:
                return {"found": False, "s": None, "listings": listings,
                        "error": f"a listing of the single key returned {0 if found is None else len(found)} of "
                                 f"{len(truth)} records"}
            cands = sorted(p for p, r in found.items() if r.state == "exchanging" and p not in tried and p != me)
            for peer in cands[:3]:
                tried.add(peer)
                await asyncio.sleep(o["call_s"])
                if self.rng.random() >= o["busy_share"]:
                    return {"found": True, "s": time.monotonic() - t0, "listings": listings}
            await asyncio.sleep(0.3)
        return {"found": False, "s": None, "listings": listings}

    # ------------------------------------------------------------------ one N, both designs
    async def measure(self, run_id: str, n: int) -> list[dict]:
        from gasloc.peer.swarm.membership import BucketReader, Membership, make_validators, peer_id_of
        from gasloc.protocol.buckets import bucket_of, level_for, listing_level

        o = self.o
        from gasloc.peer.swarm.admission import Admission
        from gasloc.peer.swarm.signed_hints import SignedRecords

        self.run_id, self.admissions = run_id, {}
        self.callee_validators = make_validators(run_id)[1]
        # the searcher's check of signed hints: the live peer's Admission, its cache kept across rounds
        self.searcher_admission = Admission(run_id, fingerprint="bench", protocol=1,
                                            validators=make_validators(run_id)[1])
        t0 = time.monotonic()
        truth = await self.populate(run_id, n)
        populate_s = time.monotonic() - t0
        me = peer_id_of(self.searcher_signer.local_public_key)
        by_bucket: dict[int, list[str]] = {}          # the members' buckets of the level listings read, for the
        for p in truth:                               # modelled callees' views
            by_bucket.setdefault(bucket_of(p, listing_level(level_for(n))), []).append(p)
        own = Membership(self.searcher, self.searcher_signer, run_id=run_id, peer_id=me, fingerprint="bench",
                         protocol=1, ttl_s=o["ttl_s"], request_timeout_s=30.0, rng=random.Random(o["seed"]),
                         beam=o["get_beam"])
        # bucket reads keep their records' signatures, as the live peer's do (Network sets the same sink), so
        # the searcher's reads take the daemon's path (a get run in the DHT process, _signed_get)
        if o["signed_hints"]:
            own.signed_sink = SignedRecords().keep
        rows = []
        for design in ("buckets", "single-key"):
            reader = own
            responder = BucketReader(self.writer, run_id=run_id, request_timeout_s=30.0)
            startup_bytes = 0
            if design == "buckets":
                b0 = own.bytes_read
                await own.probe()                       # what a starting peer does (once)
                startup_bytes = own.bytes_read - b0
                own.level = level_for(n) if abs(own.level - level_for(n)) > 1 else own.level
                await own.announce(own.record(state="exchanging", round=10, throughput_tps=1.0, bandwidth_bps=0.0))
                responder.level = own.level
            per = []
            for _ in range(o["searches"]):
                if o["fresh_records"]:   # every record re-signed since the last round, as in a live swarm
                    await self.searcher.run_coroutine(_forget_checks, return_future=True)
                    self.searcher_admission._cache.clear()
                # our process whole (process_time): the bench thread and hivemind's thread that receives and
                # unpickles each get's result; the callees' modelled CPU (thread_time, in this thread) is taken out
                w0, x0 = await self.searcher.run_coroutine(_wire_bytes, return_future=True), own.wide_retries
                (dht0, p2pd0), th0 = proc_cpu_s(self.searcher.pid), time.process_time()
                b0, r0 = reader.bytes_read, responder.bytes_read
                if design == "buckets":
                    res = await self.search_buckets(reader, responder, me, truth, by_bucket, level_for(n))
                else:
                    res = await self.search_single(reader, me, truth)
                th1 = time.process_time()      # before reading /proc (0.1 ms): the bench's own cost is not ours
                dht1, p2pd1 = proc_cpu_s(self.searcher.pid)
                w1 = await self.searcher.run_coroutine(_wire_bytes, return_future=True)
                res.update(wire_in=w1[0] - w0[0], wire_out=w1[1] - w0[1], wide_retries=own.wide_retries - x0)
                callee = res.get("callee_cpu_s", 0.0)
                res.update(dht_cpu_ms=1000 * (dht1 - dht0), p2pd_cpu_ms=1000 * (p2pd1 - p2pd0),
                           parse_cpu_ms=1000 * (th1 - th0 - callee), callee_cpu_ms=1000 * callee)
                res["cpu_ms"] = res["dht_cpu_ms"] + res["p2pd_cpu_ms"] + res["parse_cpu_ms"]
                res["bytes"] = reader.bytes_read - b0 + responder.bytes_read - r0
                res["responder_bytes"] = responder.bytes_read - r0
                per.append(res)
                if res.get("error"):
                    break
            found = [r["s"] for r in per if r["found"]]
            errors = [r["error"] for r in per if r.get("error")]
            whole_mib = n * self.entry_size / 2**20     # what one response with every record would carry
            rows.append({
                "design": design, "members": n,
                "dht_bytes_per_round": round(statistics.mean(r["bytes"] for r in per)),
                "dht_wire_in_per_round": round(statistics.mean(r["wire_in"] for r in per)),
                "dht_wire_out_per_round": round(statistics.mean(r["wire_out"] for r in per)),
                "get_beam": o["get_beam"], "wide_retries": sum(r["wide_retries"] for r in per),
                "cpu_ms_per_round": round(statistics.mean(r["cpu_ms"] for r in per), 2),
                "partner_found_s_median": round(statistics.median(found), 3) if found else None,
                "partner_found_share": round(len(found) / len(per), 3),
                "searches": len(per),
                "listings_per_round": round(statistics.mean(r["listings"] for r in per), 2),
                "finds_per_round": round(statistics.mean(r.get("finds", 0) for r in per), 2),
                "hint_checks_per_round": round(statistics.mean(r.get("hint_checks", 0) for r in per), 2),
                "signed_hints": o["signed_hints"] if design == "buckets" else None,
                "responder_bytes_per_round": round(statistics.mean(r["responder_bytes"] for r in per)),
                **{f"{k}_per_round": round(statistics.mean(r[k] for r in per), 2)
                   for k in ("dht_cpu_ms", "p2pd_cpu_ms", "parse_cpu_ms", "callee_cpu_ms")},
                "callee_check": o["callee_check"] if design == "buckets" else None,
                "per_search": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
                               for r in per],
                "startup_bytes": startup_bytes,
                "buckets": (1 << own.level) if design == "buckets" else 1,
                "estimate": round(own.estimate.value) if design == "buckets" else None,
                "ready_share": o["ready_share"], "populate_s": round(populate_s, 1), "identity": o["identity"],
                "records_visible_share": round(self.visible, 3), "stores_failed": self.store_failures,
                "error": (f"{errors[0]} ({self._single_key_why(n, whole_mib)})"
                          if errors and design == "single-key" else (errors[0] if errors else None)),
            })
            print(json.dumps(rows[-1]), file=sys.stderr)
        return rows


async def _cancel_on_sigterm(coro):
    """Await `coro`; SIGTERM meanwhile cancels it (asyncio.run then raises CancelledError), as the loop does for
    SIGINT. Afterwards SIGTERM raises KeyboardInterrupt again."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    try:
        return await coro
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def _table(rows: list[dict]) -> str:
    head = ("design", "members", "KB/round (one copy)", "KB/round on the wire", "CPU ms/round", "partner s (median)",
            "found", "buckets", "estimate", "error")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        med = r["partner_found_s_median"]
        lines.append("| " + " | ".join(str(x) for x in (
            r["design"], r["members"], f"{r['dht_bytes_per_round'] / 1000:.1f}",
            f"{r['dht_wire_in_per_round'] / 1000:.1f}", f"{r['cpu_ms_per_round']:.1f}",
            "-" if med is None else f"{med:.2f}", f"{r['partner_found_share']:.2f}", r["buckets"],
            r["estimate"] if r["estimate"] is not None else "-", r["error"] or "")) + " |")
    return "\n".join(lines)


@click.command()
@click.option("--members", default="10,100,1000,5000", help="swarm sizes, comma-separated")
@click.option("--searches", default=20, type=click.IntRange(1), help="partner searches per size and design")
@click.option("--dht-nodes", default=8, type=click.IntRange(1, 32), help="DHT processes holding the records")
@click.option("--ready-share", default=0.1, type=click.FloatRange(0.01, 1.0),
              help="share of members whose record says ready (exchanging)")
@click.option("--busy-share", default=0.3, type=click.FloatRange(0.0, 0.99),
              help="share of calls to a ready member that find it taken")
@click.option("--call-s", default=0.05, type=click.FloatRange(0.0), help="seconds one call's handshake takes")
@click.option("--deadline-s", default=10.0, type=click.FloatRange(0.1), help="a search without a partner by then "
              "fails (swarm.partner_deadline_s)")
@click.option("--identity", default="ed25519", type=click.Choice(["ed25519", "rsa"]),
              help="the members' and the searcher's identity keys: Ed25519 (what a peer makes), or RSA-2048 (identity "
                   "files made before 2026-12-04, and every run before)")
@click.option("--keys", "keys_path", default="runs/scale-keys.bin", type=click.Path(dir_okay=False, path_type=Path),
              help="cache of the members' RSA keys (made on first use; --identity rsa)")
@click.option("--callee-check", default="inline", type=click.Choice(["inline", "lookup"]),
              help="how a callee checks the searcher: its inline signed record (the live peer), or a DHT lookup of "
                   "it (peers before inline records)")
@click.option("--signed-hints/--no-signed-hints", default=True,
              help="busy members' replies carry the signed records of the peers they hint at (the live peer), or "
                   "none (peers before signed hints: a hinted peer is looked up in the DHT before it is called)")
@click.option("--fresh-records/--static-records", default=True,
              help="before each search, forget the searcher's cached record checks, as if every record had been "
                   "re-signed since the last round (a live record is re-announced every 5 s and at each state "
                   "change); --static-records keeps them (the runs before 2026-12-02)")
@click.option("--get-beam", type=click.IntRange(1, 20), default=None,
              help="DHT nodes a bucket get asks: 3 (GET_BEAM) as an open swarm's peer does when not given, 1 "
                   "as a private swarm's (TRUSTED_GET_BEAM, with its retry of an empty bucket)")
@click.option("--seed", default=0, type=int)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="write {'rows': [...]}")
def main(members, searches, dht_nodes, ready_share, busy_share, call_s, deadline_s, identity, keys_path, callee_check,
         signed_hints, fresh_records, get_beam, seed, json_out):
    from gasloc.peer.swarm import membership
    try:
        sizes = [int(x) for x in members.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"not a comma-separated list of integers: {members!r}", param_hint="--members") from None
    if not sizes or min(sizes) < 2:
        raise click.BadParameter("every size must be at least 2", param_hint="--members")
    o = dict(searches=searches, dht_nodes=dht_nodes, ready_share=ready_share, busy_share=busy_share, call_s=call_s,
             deadline_s=deadline_s, seed=seed, ttl_s=3600.0, callee_check=callee_check, signed_hints=signed_hints,
             fresh_records=fresh_records, get_beam=get_beam or membership.GET_BEAM, identity=identity)
    keys = ed25519_identities(max(sizes), seed) if identity == "ed25519" else load_keys(keys_path, max(sizes))
    # SIGTERM unwinds like Ctrl+C, through Bench.stop (without it the DHT processes died with us and left their
    # p2pd sockets and the bench's key directory behind): outside the event loop as KeyboardInterrupt, inside it
    # by cancelling the main task (_cancel_on_sigterm), so that every await unwinds. A KeyboardInterrupt raised
    # wherever the loop happened to be landed once in one of a probe's gathered gets, and asyncio printed that
    # task's traceback at shutdown. (Not by sending ourselves SIGINT: a process started in the background by a
    # non-interactive shell, as CI starts it, inherits SIGINT ignored.)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rows: list[dict] = []
    # fresh DHT processes for every size: a row does not inherit the earlier rows' records, and in one invocation
    # of 100, 1,000 and 5,000 every one of the 15,000 stores at 5,000 was refused (0 records visible), which the
    # same size alone never showed
    for n in sizes:
        bench = Bench(o)
        try:
            bench.start([f"scale-n{n}"], keys[:n])
            rows += asyncio.run(_cancel_on_sigterm(bench.measure(f"scale-n{n}", n)))
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None
        finally:
            bench.stop()
    print(_table(rows))
    if json_out is not None:
        json_out.write_text(json.dumps({"rows": rows, "options": o}, indent=1))


if __name__ == "__main__":
    main()
