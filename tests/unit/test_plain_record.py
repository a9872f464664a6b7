"""BucketSchemaValidator's fast path (`plain_record`) held against hivemind's SchemaValidator, the reference.

Every DHT node runs the schema check on every record it stores or reads, so the fast path must never accept a
record that hivemind's check refuses: for random, mutated records (wrong types, bools for ints, ints for floats,
NaN, missing and unknown keys, keys that are not strings, odd subkeys) the two must agree, and the records our
peers write must take the fast path (otherwise this test would compare hivemind's check with itself).
"""
from __future__ import annotations

import math
import random

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer as ser
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gasloc.peer.swarm.membership import (
    PEER_STATES,
    BucketSchemaValidator,
    Membership,
    PeerRecord,
    bucket_key,
    peer_id_of,
    plain_record,
    record_of,
)

RUN = "plainrun"
SIGNER = RSASignatureValidator(RSAPrivateKey())
OWNER = SIGNER.local_public_key
KEY = DHTID.generate(source=bucket_key(RUN, 4, 3)).to_bytes()
BATCH, EXAMPLES = 100, 60           # 6,000 records, about 30 % of them left as a live peer writes them


def live_value(**view) -> dict:
    """A record value exactly as a live peer stores it (Membership.record(...).dict(), announce)."""
    m = Membership(None, SIGNER, run_id=RUN, peer_id=peer_id_of(OWNER), fingerprint="fp", protocol=1, ttl_s=15.0)
    return m.record(state="exchanging", round=7, throughput_tps=1234.5, bandwidth_bps=0.0, reach="relayed",
                    via=["12D3KooWRelay"], forwards=True, **view).dict()


def dht_record(value, subkey=OWNER, key=KEY) -> DHTRecord:
    return DHTRecord(key=key, subkey=ser.dumps(subkey), value=ser.dumps(value), expiration_time=1e10)


def reference(validator: BucketSchemaValidator, record: DHTRecord) -> bool:
    """hivemind's check; where it raises (an extra key named `dict` breaks pydantic v1's .dict()), a refusal."""
    try:
        return SchemaValidator.validate(validator, record)
    except Exception:  # noqa: BLE001 - whatever pydantic v1 raises on a hostile record
        return False


ODD_VALUES = [0, 1, -1, 2**40, True, False, 0.0, 1.5, math.nan, math.inf, -math.inf, "", "training", "x" * 300,
              b"", b"bytes", None, [], [1, "a"], (1, 2), {}, {"a": 1}, {1: 2}]
ODD_KEYS = ["view", "reach", "via", "forwards", "extra_from_a_newer_peer", "__pydantic_self__", "_private", "dict",
            "fields", 1, b"peer_id", ("t",)]


def mutate(rng: random.Random, value: dict):
    """None to three random changes of a valid record value (or the whole value replaced)."""
    if rng.random() < 0.3:
        return value
    if rng.random() < 0.05:
        return rng.choice(ODD_VALUES)
    v = dict(value)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        if op == 0:                                   # a field, a type that is not its own
            v[rng.choice(sorted(PeerRecord.__fields__))] = rng.choice(ODD_VALUES)
        elif op == 1 and v:                           # a key removed
            v.pop(rng.choice(sorted(v, key=repr)))
        elif op == 2:                                 # a key added
            v[rng.choice(ODD_KEYS)] = rng.choice(ODD_VALUES + [{"loss": math.nan}])
        elif op == 3:                                 # a state
            v["state"] = rng.choice([*PEER_STATES, "Training", "gone", 3])
        elif op == 4:                                 # numbers of the neighbouring type
            f = rng.choice(["protocol", "round", "throughput_tps", "bandwidth_bps", "time"])
            x = v.get(f, 1)
            v[f] = (float(x) if isinstance(x, int) else int(x) if isinstance(x, float) and math.isfinite(x) else x)
        else:                                         # the view, odd inside
            view = v.get("view") if isinstance(v.get("view"), dict) else {}
            v["view"] = {**view, rng.choice(["loss", "partners", "x"]): rng.choice(ODD_VALUES)}
    return v


def test_live_records_and_withdrawals_take_the_fast_path(monkeypatch):
    """What our peers store is accepted without hivemind's pydantic v1 check (and that check accepts it too)."""
    validator = BucketSchemaValidator(RUN)
    calls = []
    monkeypatch.setattr(SchemaValidator, "validate", lambda self, record: calls.append(record) or True)
    for value in (live_value(), live_value(loss=2.0, val_loss=3.0, partners=["a", "b"]), None):
        assert validator.validate(dht_record(value))
    assert calls == []
    assert plain_record(live_value()) and not plain_record({**live_value(), "round": True})


def test_records_the_fast_path_does_not_know_go_to_hivemind(monkeypatch):
    validator = BucketSchemaValidator(RUN)
    calls = []
    monkeypatch.setattr(SchemaValidator, "validate", lambda self, record: calls.append(record) or False)
    assert not validator.validate(dht_record({**live_value(), "time": 5}))            # an int for a float
    assert not validator.validate(dht_record(live_value(), subkey=b"no owner here"))
    assert len(calls) == 2


def test_a_record_that_breaks_hiveminds_check_is_refused():
    """An extra key `dict` shadows pydantic v1's BaseModel.dict, and hivemind's check raises TypeError out of the
    DHT's validation; ours refuses the record."""
    assert not BucketSchemaValidator(RUN).validate(dht_record({**live_value(), "dict": 1.0}))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_fast_path_agrees_with_hiveminds_check(seed):
    rng = random.Random(seed)
    validator = BucketSchemaValidator(RUN)
    base = live_value()
    odd_subkeys = [b"\n" + OWNER, b"prefix" + OWNER + b"suffix", b"no owner", OWNER.decode(), 7]
    fast_accepted = 0
    for _ in range(BATCH):
        value, subkey = mutate(rng, base), OWNER if rng.random() < 0.5 else rng.choice(odd_subkeys)
        record = dht_record(value, subkey)
        expected = reference(validator, record)
        assert validator.validate(record) == expected, (seed, subkey, value)
        try:
            seen = ser.loads(record.value)              # what the DHT node checks (msgpack refuses int map keys)
        except ValueError:
            continue
        if plain_record(seen) and subkey is OWNER:
            fast_accepted += 1
            assert expected, (seed, seen)               # the fast path never admits what hivemind refuses
            assert record_of(seen).dict() == PeerRecord.parse_obj(seen).dict()
    assert 0 < fast_accepted < BATCH                    # both paths are taken


def test_keys_of_a_merged_foreign_schema_are_judged_by_that_schema():
    """hivemind merges a node's SchemaValidators; a key of another schema is that schema's to judge, not the fast
    path's, even when the record is one of ours."""
    import pydantic.v1 as pv1

    class Other(pv1.BaseModel):
        experts: dict[pv1.StrictStr, pv1.StrictInt]

    validator = BucketSchemaValidator(RUN)
    assert validator.merge_with(SchemaValidator(Other, prefix="x"))
    foreign = DHTID.generate(source="x_experts").to_bytes()
    record = dht_record(live_value(), key=foreign)
    assert reference(validator, record) is False and validator.validate(record) is False
    merged = BucketSchemaValidator(RUN)
    assert merged.merge_with(BucketSchemaValidator("another-run"))
    theirs = dht_record(live_value(), key=DHTID.generate(source=bucket_key("another-run", 4, 3)).to_bytes())
    assert merged.validate(theirs) and reference(merged, theirs)


def test_bucket_keys_of_another_run_and_reserved_subkeys_are_hiveminds_to_judge():
    validator = BucketSchemaValidator(RUN)
    other = DHTID.generate(source=bucket_key("another-run", 4, 3)).to_bytes()
    for record in (dht_record(live_value(), key=other),
                   DHTRecord(KEY, b"", ser.dumps(live_value()), 1e10),         # hivemind's IS_DICTIONARY
                   DHTRecord(KEY, ser.dumps(None), ser.dumps(live_value()), 1e10)):  # its IS_REGULAR_VALUE
        assert validator.validate(record) == reference(validator, record)
