"""The swarm's membership record: schema and signature checks as a DHT node applies them, the binding of a record
to its owner's peer id, and the listing rules."""
from __future__ import annotations

import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import ValueWithExpiration

from gasloc.peer.swarm.membership import (
    IdentityError,
    Membership,
    PeerRecord,
    bucket_key,
    compatible,
    load_identity,
    make_validators,
    parse_listing,
    peer_id_of,
    peers_key,
    status_view,
)

RUN = "testrun"
ser = DHTProtocol.serializer


def _record(**over) -> dict:
    base = dict(peer_id="12D3KooWA", protocol=1, fingerprint="abc", state="training", round=3,
                throughput_tps=1000.0, bandwidth_bps=0.0, time=time.time())
    return {**base, **over}


def _dht_record(validator: CompositeValidator, signer, value, subkey=None, key=None) -> DHTRecord:
    """A record as DHTNode.store builds it: key id, msgpack subkey and value, then signed by our validators."""
    # records live in bucket keys (protocol/buckets.py); every one of them is schema-checked like the old single key
    rec = DHTRecord(key=DHTID.generate(source=key or bucket_key(RUN, 3, 5)).to_bytes(),
                    subkey=ser.dumps(subkey if subkey is not None else signer.local_public_key),
                    value=ser.dumps(value), expiration_time=time.time() + 30)
    return DHTRecord(rec.key, rec.subkey, validator.sign_value(rec), rec.expiration_time)


@pytest.fixture(scope="module", params=["ed25519", "rsa"])
def two_peers(request):
    """Two peers' validators (each with its own key) as their DHT nodes hold them: Ed25519 identities (what gasloc
    makes) or RSA ones (identity files made before)."""
    def identity():
        return None if request.param == "ed25519" else RSAPrivateKey()
    (sig_a, va), (sig_b, vb) = make_validators(RUN, identity()), make_validators(RUN, identity())
    return (sig_a, CompositeValidator(va)), (sig_b, CompositeValidator(vb))


def test_a_valid_record_passes_other_nodes_checks(two_peers):
    (sig_a, val_a), (_, val_b) = two_peers
    rec = _dht_record(val_a, sig_a, _record())
    assert val_b.validate(rec)
    withdrawn = _dht_record(val_a, sig_a, None)  # leaving: None under our own subkey
    assert val_b.validate(withdrawn)


@pytest.mark.parametrize("bad", [
    {"round": 3.0},                # a float where the schema says int: no type conversion allowed
    {"throughput_tps": 1000},      # an int where the schema says float
    {"state": "sleeping"},         # not one of joining/training/exchanging
    {"peer_id": 7},
])
def test_schema_rejects_wrong_types_and_states(two_peers, bad):
    (sig_a, val_a), (_, val_b) = two_peers
    assert not val_b.validate(_dht_record(val_a, sig_a, _record(**bad)))


def test_missing_field_is_rejected_and_unknown_fields_are_tolerated(two_peers):
    (sig_a, val_a), (_, val_b) = two_peers
    incomplete = _record()
    del incomplete["fingerprint"]
    assert not val_b.validate(_dht_record(val_a, sig_a, incomplete))
    # a newer peer may announce more fields (rolling upgrade); older peers still accept the record
    assert val_b.validate(_dht_record(val_a, sig_a, _record(gpu="H100")))
    # the NAT fields are such extra fields: records with and without them both pass
    assert val_b.validate(_dht_record(val_a, sig_a, _record(reach="relayed", via=["12D3KooWR"], forwards=False)))


def test_nobody_can_write_under_another_peers_key(two_peers):
    (sig_a, val_a), (sig_b, val_b) = two_peers
    # B signs a record placed under A's public-key subkey: B's validator does not sign it (not its key) and the
    # signature check on any node fails
    forged = _dht_record(val_b, sig_b, _record(peer_id="evil"), subkey=sig_a.local_public_key)
    assert not val_a.validate(forged)
    assert not val_b.validate(forged)
    # a subkey without any owner's public key is refused by the schema (OwnerSubkey)
    assert not val_b.validate(_dht_record(val_a, sig_a, _record(), subkey=b"anonymous"))


def _listing(entries: dict) -> ValueWithExpiration:
    return ValueWithExpiration({k: ValueWithExpiration(v, exp) for k, (v, exp) in entries.items()}, time.time() + 60)


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    """Four libp2p identities (as p2pd would run with): peer id -> the subkey its records are stored under."""
    from hivemind.p2p import P2P, PeerID
    out = {}
    for i in range(4):
        path = tmp_path_factory.mktemp("id") / f"k{i}"
        P2P.generate_identity(str(path))
        signer, _ = make_validators(RUN, load_identity(path))
        out[PeerID.from_identity(path.read_bytes()).to_base58()] = signer.local_public_key
    return out


def test_the_record_key_is_the_libp2p_identity(identities):
    # the subkey derives to exactly the peer id that p2pd shows (PeerID.from_identity of the same key file)
    for pid, subkey in identities.items():
        assert peer_id_of(subkey) == pid
    assert peer_id_of(b"no key in here") is None and peer_id_of(None) is None


def test_an_identity_file_that_is_no_key_is_one_line(tmp_path):
    bad = tmp_path / "k"
    bad.write_bytes(b"garbage")
    with pytest.raises(IdentityError, match="not a libp2p private key"):
        load_identity(bad)
    with pytest.raises(IdentityError, match="cannot read"):
        load_identity(tmp_path / "missing")


def test_parse_listing_drops_withdrawn_expired_and_malformed(identities):
    now = time.time()
    (a, sa), (b, sb), (c, sc), (d, sd) = identities.items()
    found = _listing({
        sa: (_record(peer_id=a), now + 10),
        sb: (None, now + 10),                       # withdrawn
        sc: (_record(peer_id=c), now - 1),          # expired
        sd: ({"peer_id": d}, now + 10),             # malformed (a node without validators served it)
    })
    assert set(parse_listing(found, now)) == {a}
    assert parse_listing(None, now) == {}


def test_a_forged_record_for_a_live_peer_leaves_the_victim_listed(identities):
    # Formerly (issue 11) any RSA key could sign a record naming any peer id, the newest self-declared time won,
    # and one forged record with another fingerprint or state "joining" made every peer drop the victim.
    now = time.time()
    (victim, sv), (attacker, sa), (_, sx), _ = identities.items()
    honest = _record(peer_id=victim, state="exchanging", time=now - 5)
    found = _listing({
        sv: (honest, now + 10),
        sa: (_record(peer_id=victim, fingerprint="other", state="joining", round=10**9, time=now + 1e6), now + 10),
        sx: (_record(peer_id=victim, bandwidth_bps=1e30, time=now + 1e6), now + 10),   # and a second forger
    })
    exp: dict[str, float] = {}
    listing = parse_listing(found, now, expirations=exp)
    assert set(listing) == {victim}                   # no entry under the forgers' own ids either: not theirs
    assert listing[victim].dict() == PeerRecord(**honest).dict()
    assert set(compatible(listing, peer_id="me", fingerprint="abc", protocol=1)) == {victim}
    assert exp == {victim: now + 10}


def test_freshness_is_the_dht_expiration_never_the_self_declared_time(identities, two_peers):
    from gasloc.peer.swarm.membership import Membership
    (sig_a, _), _ = two_peers
    (fresh, sf), (stale, ss), _, _ = identities.items()
    now = time.time()
    m = Membership(None, sig_a, run_id=RUN, peer_id="me", fingerprint="abc", protocol=1, ttl_s=6.0)
    # `stale` claims to have announced in the far future; its DHT entry expires in 1 s all the same
    listing = parse_listing(_listing({sf: (_record(peer_id=fresh, time=now - 100), now + 30),
                                      ss: (_record(peer_id=stale, time=now + 1e9), now + 1)}), now,
                            expirations=m.expirations)
    assert set(listing) == {fresh, stale}
    m.expirations[stale] = now - 0.1     # ...and that moment passed while the DHT did not answer
    assert set(m.prune(listing)) == {fresh}


def test_compatible_peers_share_fingerprint_and_protocol_and_exclude_self():
    recs = {pid: PeerRecord(**_record(peer_id=pid, **over)) for pid, over in [
        ("me", {}), ("same", {}), ("other-model", {"fingerprint": "xyz"}), ("newer", {"protocol": 2})]}
    assert set(compatible(recs, peer_id="me", fingerprint="abc", protocol=1)) == {"same"}


def test_a_failed_listing_keeps_the_last_one_minus_what_must_have_expired(two_peers):
    from gasloc.peer.swarm.membership import Membership
    (sig_a, _), _ = two_peers
    m = Membership(None, sig_a, run_id=RUN, peer_id="me", fingerprint="abc", protocol=1, ttl_s=6.0)
    now = time.time()
    last = {"fresh": PeerRecord(**_record(peer_id="fresh")), "stale": PeerRecord(**_record(peer_id="stale")),
            "unknown": PeerRecord(**_record(peer_id="unknown"))}
    m.expirations = {"fresh": now + 5.0, "stale": now - 1.0}
    assert set(m.prune(last)) == {"fresh"}


def test_status_view_travels_as_an_extra_field_and_older_records_still_pass(two_peers):
    """The view is what gasloc status reads; records without it (older peers) and with it both pass other nodes'
    checks, and a malformed view costs only the view, not the record."""
    (sig_a, val_a), (_, val_b) = two_peers
    view = {"loss": 2.5, "val_loss": None, "round_s": 1.5, "partners": ["12D3KooWB"], "version": "0.1.0"}
    assert val_b.validate(_dht_record(val_a, sig_a, _record(view=view)))
    rec = PeerRecord.parse_obj(_record(view=view))
    assert status_view(rec).partners == ["12D3KooWB"] and status_view(rec).loss == 2.5
    assert status_view(PeerRecord.parse_obj(_record())) is None
    assert status_view(PeerRecord.parse_obj(_record(view={"loss": "low"}))) is None


def test_a_nan_loss_is_announced_as_none():
    """NaN != NaN: a NaN in the record would fail the DHT's no-conversion check and drop the whole record."""

    class _Signer:
        local_public_key = b"k"

    m = Membership(None, _Signer(), run_id=RUN, peer_id="12D3KooWA", fingerprint="abc", protocol=1, ttl_s=15)
    rec = m.record(state="training", round=1, throughput_tps=1.0, bandwidth_bps=0.0, loss=float("nan"), round_s=2.0)
    assert rec.view["loss"] is None and rec.view["round_s"] == 2.0


@pytest.mark.parametrize("key", [bucket_key(RUN, 0, 0), bucket_key(RUN, 10, 1023), peers_key(RUN)])
def test_every_bucket_key_and_the_old_single_key_are_schema_checked(two_peers, key):
    """A malformed record is refused in any bucket of any level, and under the older layout's key (which is read
    to notice peers of that layout)."""
    (sig_a, val_a), (_, val_b) = two_peers
    assert val_b.validate(_dht_record(val_a, sig_a, _record(), key=key))
    assert not val_b.validate(_dht_record(val_a, sig_a, _record(round=3.0), key=key))
