"""A caller's inline membership record (peer/swarm/admission.py), signed with an Ed25519 or an RSA identity: an
honest one admits its owner with one signature verification (then from the cache), and every forged, foreign,
expired, misplaced or oversize one is refused; the network admits with it and looks a caller up in the DHT only
when its request carries none."""
from __future__ import annotations

import asyncio
import base64
import time

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from gasloc.peer.config import PeerConfig
from gasloc.peer.swarm.admission import Admission
from gasloc.peer.swarm.ed25519 import Ed25519SignatureValidator
from gasloc.peer.swarm.membership import Membership, bucket_key, make_validators, peer_id_of, signed_member
from gasloc.peer.swarm.network import Network, PeerStatus
from gasloc.protocol.buckets import bucket_of
from gasloc.protocol.codes import Code
from gasloc.protocol.messages import MAX_MEMBER_VALUE_CHARS, PROTOCOL_VERSION, ExchangeRequest, StateRequest
from gasloc.protocol.wire import WireError, decode_header

RUN = "admitrun"


def _signer(kind: str = "ed25519"):
    """A peer's record signer: Ed25519 (what gasloc makes) or RSA (identity files made before; 1024-bit keys here:
    peer ids derive the same way at any size, and they are made ten times faster)."""
    if kind == "ed25519":
        return make_validators(RUN)[0]
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    return make_validators(RUN, key)[0]


def _identity(signer):
    """The identity key a signer of _signer signs with."""
    return signer.identity if hasattr(signer, "identity") else signer._private_key


class FakeDHT:
    """Stores nothing useful; counts gets (an admitted caller with an inline record must cost none)."""

    def __init__(self):
        self.gets: list[str] = []
        self.data: dict[str, dict] = {}

    async def store(self, key, value, expiration, subkey, return_future=True):
        self.data.setdefault(key, {})[subkey] = (value, expiration)
        return True

    async def get(self, key, latest=True, return_future=True, **kwargs):
        self.gets.append(key)
        entries = {k: ValueWithExpiration(v, e) for k, (v, e) in self.data.get(key, {}).items() if e > time.time()}
        return ValueWithExpiration(entries, time.time() + 60) if entries else None


@pytest.fixture(scope="module", params=["ed25519", "rsa"])
def signers(request):
    return [_signer(request.param) for _ in range(3)]


def _admission(signers) -> Admission:
    # the callee's validators with a key we already have
    return Admission(RUN, fingerprint="f", protocol=PROTOCOL_VERSION,
                     validators=make_validators(RUN, _identity(signers[2]))[1])


def _network(dht, signers) -> Network:
    """A searching peer's Network (signers[0]) at bucket level 3, with an Admission, on `dht`."""
    net = Network(PeerConfig.model_validate({"swarm": {"run_id": RUN}}), lambda: PeerStatus("training", 0, 0.0, 0.0))
    net.peer_id, net.fingerprint = peer_id_of(signers[0].local_public_key), "f"
    net.membership = Membership(dht, signers[0], run_id=RUN, peer_id=net.peer_id, fingerprint="f",
                                protocol=PROTOCOL_VERSION, ttl_s=15.0)
    net.membership.level = 3
    net.admission = _admission(signers)
    return net


def _announced(dht, signer, *, run=RUN, level=3, fingerprint="f", ttl_s=15.0) -> Membership:
    m = Membership(dht, signer, run_id=run, peer_id=peer_id_of(signer.local_public_key), fingerprint=fingerprint,
                   protocol=PROTOCOL_VERSION, ttl_s=ttl_s)
    m.level = level
    asyncio.run(m.announce(m.record(state="exchanging", round=4, throughput_tps=1.0, bandwidth_bps=0.0,
                                    partners=["x"])))
    return m


def test_an_honest_record_admits_its_owner_and_is_verified_once(signers):
    m = _announced(FakeDHT(), signers[0])
    adm = _admission(signers)
    for _ in range(3):
        rec, why = adm.check(m.peer_id, m.inline, get_dht_time())
        assert why == "" and rec is not None and rec.peer_id == m.peer_id and rec.round == 4
    assert adm.verified == 1          # the same signed bytes again: from the cache, no signature verification
    # it travels in both requests and stays far below the header caps
    assert len(m.inline.model_dump_json()) < 2000
    for cls in (ExchangeRequest, StateRequest):
        assert cls.model_fields["member"].default is None


def test_forged_foreign_expired_and_misplaced_records_are_refused(signers):
    honest, other = _announced(FakeDHT(), signers[0]), _announced(FakeDHT(), signers[1])
    adm = _admission(signers)
    now = get_dht_time()
    w = honest.inline
    value = base64.b64decode(w.value)
    flipped = value.replace(b"exchanging", b"training\0\0")   # same length, signature no longer matches
    cases = {
        # another peer's genuine record, presented by us
        "record belongs to another peer": (honest.peer_id, other.inline),
        # our bytes, altered after signing
        "signature or schema invalid": (honest.peer_id, w.model_copy(update={"value": base64.b64encode(flipped)
                                                                             .decode()})),
        # the signature covers the expiration: a later one (a record kept alive past its TTL) breaks it
        "signature or schema invalid ": (honest.peer_id, w.model_copy(update={"expiration": w.expiration + 600})),
        "record expired": (honest.peer_id, w.model_copy(update={"expiration": now - 1})),
        "record is not under a bucket key of this run": (honest.peer_id, w.model_copy(
            update={"key": w.key.replace(RUN, "otherrun")})),
        "record is not in the caller's bucket": (honest.peer_id, w.model_copy(
            update={"key": bucket_key(RUN, 3, (bucket_of(honest.peer_id, 3) + 1) % 8)})),
        "record is not base64 / ASCII": (honest.peer_id, w.model_copy(update={"value": "not*base64"})),
    }
    for why, (caller, member) in cases.items():
        rec, got = adm.check(caller, member, now)
        assert rec is None and got == why.strip(), (why, got)
    # a genuine record of another run (signed for its bucket key there) is foreign here
    foreign = _announced(FakeDHT(), signers[2], run="otherrun")
    assert adm.check(foreign.peer_id, foreign.inline, now)[1] == "record is not under a bucket key of this run"
    # a genuine record of another configuration admits nobody to ours
    other_fp = _announced(FakeDHT(), signers[2], fingerprint="g")
    assert adm.check(other_fp.peer_id, other_fp.inline, now)[1] == "record of another configuration or protocol"


def test_a_signed_record_that_breaks_the_schema_or_names_another_peer_is_refused(signers):
    s = signers[0]
    pid = peer_id_of(s.local_public_key)
    key = bucket_key(RUN, 2, bucket_of(pid, 2))
    adm = _admission(signers)
    good = _announced(FakeDHT(), s, level=2).record(state="training", round=1, throughput_tps=1.0,
                                                    bandwidth_bps=0.0).dict()
    exp = get_dht_time() + 10
    # validly signed by the caller's own key, but "round" a string: the DHT's schema check refuses it, so do we
    bad_schema = signed_member(s, key, {**good, "round": "1"}, exp)
    assert adm.check(pid, bad_schema, get_dht_time()) == (None, "signature or schema invalid")
    # validly signed by the caller, claiming to be someone else: bound to its key, it is nobody's
    claims_other = signed_member(s, key, {**good, "peer_id": peer_id_of(signers[1].local_public_key)}, exp)
    assert adm.check(pid, claims_other, get_dht_time()) == (None, "record names another peer id")


def test_an_oversize_record_is_a_bad_header():
    from gasloc.protocol.messages import WIDEST_MEMBER
    body = StateRequest(protocol_version=PROTOCOL_VERSION, fingerprint="f", member=WIDEST_MEMBER).model_dump_json()
    too_long = body.replace('"value":"v', '"value":"vv')
    assert len(WIDEST_MEMBER.value) == MAX_MEMBER_VALUE_CHARS
    decode_header(body.encode(), StateRequest)        # at the cap: parses (and is then refused by Admission)
    with pytest.raises(WireError) as e:
        decode_header(too_long.encode(), StateRequest)
    assert e.value.code == Code.BAD_HEADER


def test_the_network_admits_by_inline_record_and_looks_up_only_without_one(signers):
    dht = FakeDHT()
    caller = _announced(dht, signers[1])
    net = _network(dht, signers)
    pid = PeerID.from_base58(caller.peer_id)

    async def main():
        assert await net.admit_caller(pid, caller.inline)
        assert dht.gets == [] and caller.peer_id in net.live      # admitted without a lookup, and now in view
        net.live = {}
        net.records = {}
        forged = caller.inline.model_copy(update={"expiration": caller.inline.expiration + 5})
        assert not await net.admit_caller(pid, forged)
        assert dht.gets == []                                      # a bad record is refused, not looked up
        assert await net.admit_caller(pid, None)                   # an older caller: looked up in its bucket
        assert dht.gets and all(k.startswith(f"{RUN}_m") for k in dht.gets)
    asyncio.run(main())


def test_the_dht_validators_check_a_record_once_and_still_refuse_altered_bytes(signers, monkeypatch):
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator, DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    m = _announced(FakeDHT(), signers[0])
    _, validators = make_validators(RUN, _identity(signers[1]))
    calls = []
    # the signature check of the record's kind (the other kind's passes it by without a check)
    kind = Ed25519SignatureValidator if isinstance(signers[0], Ed25519SignatureValidator) else RSASignatureValidator
    real = kind.validate
    monkeypatch.setattr(kind, "validate", lambda self, r: calls.append(1) or real(self, r))
    composite = CompositeValidator(validators)
    w = m.inline
    record = DHTRecord(DHTID.generate(source=w.key).to_bytes(), MSGPackSerializer.dumps(w.subkey.encode()),
                       base64.b64decode(w.value), w.expiration)
    assert all(composite.validate(record) for _ in range(5)) and len(calls) == 1   # 5 replicas' answers: 1 check
    altered = DHTRecord(record.key, record.subkey, record.value.replace(b"exchanging", b"training\0\0"),
                        record.expiration_time)
    assert not composite.validate(altered) and len(calls) == 2
    assert not composite.validate(DHTRecord(record.key, record.subkey, record.value, record.expiration_time + 1))


def test_a_record_signed_to_expire_in_a_century_is_kept_only_a_few_ttls(signers):
    """Issue 29: a signed inline record had no upper bound on its expiry, so one admission kept a caller (a Sybil,
    or a peer long gone) in our view for as long as it chose."""
    dht = FakeDHT()
    caller = _announced(dht, signers[1], ttl_s=100 * 365 * 86400.0)
    net = _network(dht, signers)
    pid = PeerID.from_base58(caller.peer_id)
    now = get_dht_time()
    assert asyncio.run(net.admit_caller(pid, caller.inline))
    assert net.membership.expirations[caller.peer_id] <= now + net.max_record_ttl_s + 5
    assert net.max_record_ttl_s == 4 * net.cfg.swarm.announce_ttl_s
