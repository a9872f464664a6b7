"""The swarm's membership record: schema and signature checks as a DHT node applies them, and the listing rules."""
from __future__ import annotations

import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils.timed_storage import ValueWithExpiration

from gasloc.peer.swarm.membership import PeerRecord, compatible, make_validators, parse_listing, peers_key

RUN = "testrun"
ser = DHTProtocol.serializer


def _record(**over) -> dict:
    base = dict(peer_id="12D3KooWA", protocol=1, fingerprint="abc", state="training", round=3,
                throughput_tps=1000.0, bandwidth_bps=0.0, time=time.time())
    return {**base, **over}


def _dht_record(validator: CompositeValidator, signer, value, subkey=None, key=None) -> DHTRecord:
    """A record as DHTNode.store builds it: key id, msgpack subkey and value, then signed by our validators."""
    rec = DHTRecord(key=DHTID.generate(source=key or peers_key(RUN)).to_bytes(),
                    subkey=ser.dumps(subkey if subkey is not None else signer.local_public_key),
                    value=ser.dumps(value), expiration_time=time.time() + 30)
    return DHTRecord(rec.key, rec.subkey, validator.sign_value(rec), rec.expiration_time)


@pytest.fixture(scope="module")
def two_peers():
    """Two peers' validators (each with its own RSA key) as their DHT nodes hold them."""
    (sig_a, va), (sig_b, vb) = make_validators(RUN), make_validators(RUN)
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
    # a subkey without any [owner:...] public key is refused by the schema (BytesWithPublicKey)
    assert not val_b.validate(_dht_record(val_a, sig_a, _record(), subkey=b"anonymous"))


def _listing(entries: dict) -> ValueWithExpiration:
    return ValueWithExpiration({k: ValueWithExpiration(v, exp) for k, (v, exp) in entries.items()}, time.time() + 60)


def test_parse_listing_drops_withdrawn_expired_and_malformed():
    now = time.time()
    found = _listing({
        b"a": (_record(peer_id="A"), now + 10),
        b"b": (None, now + 10),                       # withdrawn
        b"c": (_record(peer_id="C"), now - 1),        # expired
        b"d": ({"peer_id": "D"}, now + 10),           # malformed (a node without validators served it)
    })
    assert set(parse_listing(found, now)) == {"A"}
    assert parse_listing(None, now) == {}


def test_parse_listing_keeps_the_newest_record_of_a_peer_id():
    now = time.time()
    found = _listing({b"old": (_record(peer_id="A", round=1, time=now - 5), now + 10),
                      b"new": (_record(peer_id="A", round=2, time=now), now + 10)})
    assert parse_listing(found, now)["A"].round == 2


def test_compatible_peers_share_fingerprint_and_protocol_and_exclude_self():
    recs = {pid: PeerRecord(**_record(peer_id=pid, **over)) for pid, over in [
        ("me", {}), ("same", {}), ("other-model", {"fingerprint": "xyz"}), ("newer", {"protocol": 2})]}
    assert set(compatible(recs, peer_id="me", fingerprint="abc", protocol=1)) == {"same"}


def test_a_failed_listing_keeps_the_last_one_minus_what_must_have_expired(two_peers):
    from gasloc.peer.swarm.membership import Membership
    (sig_a, _), _ = two_peers
    m = Membership(None, sig_a, run_id=RUN, peer_id="me", fingerprint="abc", protocol=1, ttl_s=6.0)
    now = time.time()
    last = {"fresh": PeerRecord(**_record(peer_id="fresh", time=now - 1.0)),
            "stale": PeerRecord(**_record(peer_id="stale", time=now - 7.0))}
    assert set(m.prune(last)) == {"fresh"}
