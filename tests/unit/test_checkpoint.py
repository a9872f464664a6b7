"""Checkpoints: bit-exact save/restore of model, AdamW and outer state; resumed training equals uninterrupted
training; corrupt or partial checkpoints are skipped with a reason; retention."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gasloc.peer.checkpoint import CheckpointConfig, config_fingerprint, load_latest, read_checkpoint, save_checkpoint
from gasloc.peer.train.data import DataConfig, build_data
from gasloc.peer.train.inner import InnerConfig, inner_step, make_inner_optimizer
from gasloc.peer.train.model import ModelConfig, build_model
from gasloc.peer.train.outer import OuterConfig, make_outer

FP = "fp-test"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the test machine's cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

INNER = InnerConfig(warmup_steps=2, inner_steps=3)
MODEL = ModelConfig(preset="tiny", seq_len=32)
DATA = DataConfig(batch_size=2, shard_index=1, num_shards=3)


class Peer:
    """The state a peer checkpoints: model, inner AdamW, outer update, data position, step and round counters."""

    def __init__(self, seed: int = 0, algorithm: str = "gasloc", form: str = "C"):
        self.model = build_model(MODEL, 256, seed=seed)
        self.opt = make_inner_optimizer(self.model, INNER)
        self.outer = make_outer(OuterConfig(algorithm=algorithm, form=form), list(self.model.parameters()))
        self.data, _ = build_data(DATA, MODEL.seq_len)
        self.step, self.round = 0, 0

    def train_round(self) -> None:
        for _ in range(INNER.inner_steps):
            inner_step(self.model, self.opt, self.data.next_batch(), self.step, INNER)
            self.step += 1
        params = list(self.model.parameters())
        sent = self.outer.outgoing(params)
        self.outer.apply(params, sent)  # a solo round: still applies momentum
        self.round += 1

    def save(self, cfg: CheckpointConfig, fp: str = FP) -> Path:
        return save_checkpoint(cfg, model=self.model, inner_opt=self.opt, outer=self.outer,
                               data_state=self.data.state_dict(), round=self.round,
                               meta={"fingerprint": fp, "inner_step": self.step, "tokenizer": "bytes"})

    def load(self, cfg: CheckpointConfig, fp: str = FP):
        loaded = load_latest(cfg, model=self.model, inner_opt=self.opt, outer=self.outer, fingerprint=fp)
        if loaded is not None:
            self.data.load_state_dict(loaded.data_state)
            self.step, self.round = loaded.meta["inner_step"], loaded.round
        return loaded


def assert_same_state(a: Peer, b: Peer) -> None:
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]) and v.dtype == sb["state"][i][k].dtype, (i, k)
    oa, ob = a.outer.state_dict(), b.outer.state_dict()
    assert oa.keys() == ob.keys() and oa
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    assert all(torch.equal(x, y) for x, y in zip(a.outer.anchor, b.outer.anchor, strict=True))
    assert a.data.state_dict() == b.data.state_dict()


@pytest.mark.parametrize("algorithm,form", [("gasloc", "C"), ("gasloc", "A"), ("diloco", "C")])
def test_roundtrip_is_bit_exact(tmp_path, algorithm, form):
    cfg = CheckpointConfig(dir=tmp_path)
    a = Peer(algorithm=algorithm, form=form)
    a.train_round()
    a.train_round()
    a.save(cfg)
    b = Peer(seed=7, algorithm=algorithm, form=form)  # different initial weights: everything must be overwritten
    loaded = b.load(cfg)
    assert loaded is not None and loaded.round == 2 and loaded.skipped == []
    assert_same_state(a, b)
    assert b.model.lm_head.weight is b.model.model.embed_tokens.weight  # tied weights stay tied


def test_resumed_training_equals_uninterrupted(tmp_path):
    cfg = CheckpointConfig(dir=tmp_path)
    straight = Peer()
    for _ in range(2):
        straight.train_round()
    straight.save(cfg)
    for _ in range(2):
        straight.train_round()

    resumed = Peer(seed=3)
    assert resumed.load(cfg).round == 2
    for _ in range(2):
        resumed.train_round()
    assert resumed.round == straight.round == 4
    assert_same_state(straight, resumed)


def _three_checkpoints(tmp_path) -> tuple[CheckpointConfig, Peer, list[Path]]:
    cfg = CheckpointConfig(dir=tmp_path, keep=5)
    p = Peer()
    paths = []
    for _ in range(3):
        p.train_round()
        paths.append(p.save(cfg))
    return cfg, p, paths


def _truncate(path: Path) -> None:
    f = path / "state.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    f = path / "state.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    f.write_bytes(bytes(raw))


def _bad_json(path: Path) -> None:
    (path / "meta.json").write_text('{"format": "gasloc-checkpoint", "rou')


def _missing_file(path: Path) -> None:
    (path / "state.safetensors").unlink()


@pytest.mark.parametrize("corrupt,reason", [(_truncate, "truncated"), (_flip_byte, "checksum mismatch"),
                                            (_bad_json, "not valid JSON"), (_missing_file, "missing")])
def test_corrupt_newest_is_skipped_and_reported(tmp_path, corrupt, reason, caplog):
    cfg, _, paths = _three_checkpoints(tmp_path)
    corrupt(paths[-1])
    fresh = Peer(seed=5)
    with caplog.at_level("WARNING", logger="gasloc.peer.checkpoint"):
        loaded = fresh.load(cfg)
    assert loaded is not None and loaded.round == 2 and loaded.path == paths[1]
    assert [p for p, _ in loaded.skipped] == [paths[2]]
    assert reason in loaded.skipped[0][1]
    assert "checkpoint_skipped" in caplog.text and reason in caplog.text


def test_fingerprint_mismatch_and_all_bad(tmp_path):
    cfg, _, paths = _three_checkpoints(tmp_path)
    fresh = Peer(seed=5)
    before = [t.clone() for t in fresh.model.parameters()]
    assert load_latest(cfg, model=fresh.model, inner_opt=fresh.opt, outer=fresh.outer, fingerprint="other") is None
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))
    with pytest.raises(Exception) as e:
        read_checkpoint(paths[0], fingerprint="other")
    assert "fingerprint" in str(e.value)


def test_shape_mismatch_is_skipped_without_touching_the_model(tmp_path):
    cfg, _, paths = _three_checkpoints(tmp_path)
    other = build_model(ModelConfig(preset="small", seq_len=32), 256)
    opt = make_inner_optimizer(other, INNER)
    outer = make_outer(OuterConfig(), list(other.parameters()))
    before = [t.clone() for t in other.parameters()]
    assert load_latest(cfg, model=other, inner_opt=opt, outer=outer, fingerprint=FP) is None
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


def test_leftovers_are_reported_then_cleaned_and_old_ones_pruned(tmp_path):
    cfg, p, paths = _three_checkpoints(tmp_path)
    leftover = tmp_path / ".tmp-ckpt-00000004-123-999-abcd"
    shutil.copytree(paths[-1], leftover)  # a crash after writing, before the rename
    loaded = Peer(seed=2).load(cfg)
    assert loaded.round == 3 and loaded.skipped[0][0] == leftover and "interrupted save" in loaded.skipped[0][1]
    p.train_round()
    newest = p.save(CheckpointConfig(dir=tmp_path, keep=2))
    assert not leftover.exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted([paths[-1].name, newest.name])


def test_same_round_twice_keeps_the_later_one(tmp_path):
    cfg = CheckpointConfig(dir=tmp_path)
    p = Peer()
    p.train_round()
    p.save(cfg)
    with torch.no_grad():
        p.model.model.norm.weight.add_(1.0)
    second = p.save(cfg)
    q = Peer(seed=4)
    assert q.load(cfg).path == second
    assert torch.equal(q.model.model.norm.weight, p.model.model.norm.weight)


def test_meta_json_records_what_export_and_audits_need(tmp_path):
    cfg, _, paths = _three_checkpoints(tmp_path)
    record = json.loads((paths[-1] / "meta.json").read_text())
    assert record["round"] == 3 and record["fingerprint"] == FP and record["version"] == 1
    assert record["model"]["vocab_size"] == 256 and record["model"]["config"]["preset"] == "tiny"
    assert len(record["files"]["state.safetensors"]["sha256"]) == 64
    assert record["data_state"] == {"batches": 9}


def test_bad_arguments_are_one_line_errors(tmp_path):
    p = Peer()
    with pytest.raises(ValueError, match="checkpoint.dir is not set"):
        p.save(CheckpointConfig())
    with pytest.raises(ValueError, match="fingerprint"):
        save_checkpoint(CheckpointConfig(dir=tmp_path), model=p.model, inner_opt=p.opt, outer=p.outer,
                        data_state={}, round=0, meta={})
    with pytest.raises(ValueError, match="JSON-able"):
        save_checkpoint(CheckpointConfig(dir=tmp_path), model=p.model, inner_opt=p.opt, outer=p.outer,
                        data_state={"x": object()}, round=0, meta={"fingerprint": FP})
    assert list(tmp_path.iterdir()) == []
    assert load_latest(CheckpointConfig(dir=tmp_path / "none"), model=p.model, inner_opt=p.opt, outer=p.outer,
                       fingerprint=FP) is None


def test_config_fingerprint_is_stable_and_sensitive():
    assert config_fingerprint(MODEL, {"tok": "bytes"}) == config_fingerprint(ModelConfig(preset="tiny", seq_len=32),
                                                                          {"tok": "bytes"})
    assert config_fingerprint(MODEL) != config_fingerprint(ModelConfig(preset="tiny", seq_len=64))


def test_a_non_finite_state_is_never_written_and_a_non_finite_checkpoint_is_skipped(tmp_path, caplog):
    """Issue 11: a NaN checkpoint would be resumed on every restart (a crash loop)."""
    from safetensors.torch import load_file, save_file

    from gasloc.peer.checkpoint import META_FILE, STATE_FILE, CheckpointError, _sha256

    cfg = CheckpointConfig(dir=tmp_path / "ck", keep=5)
    p = Peer()
    p.train_round()
    good = p.save(cfg)
    p.train_round()
    with torch.no_grad():
        next(p.model.parameters())[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        p.save(cfg)
    assert sorted(x.name for x in cfg.dir.iterdir()) == [good.name]  # nothing written, no leftover
    # a checkpoint that holds an Inf anyway (an older gasloc, or edited by hand) is skipped, and the log says why
    bad = cfg.dir / good.name.replace("-00000001-", "-00000009-")
    shutil.copytree(good, bad)
    tensors = load_file(str(bad / STATE_FILE))
    name = next(iter(tensors))
    tensors[name] = torch.full_like(tensors[name], float("inf"))
    save_file(tensors, str(bad / STATE_FILE), metadata={"format": "gasloc-checkpoint"})
    meta = json.loads((bad / META_FILE).read_text())
    meta["files"][STATE_FILE] = {"sha256": _sha256(bad / STATE_FILE), "bytes": (bad / STATE_FILE).stat().st_size}
    (bad / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        read_checkpoint(bad, FP)
    q = Peer()
    loaded = q.load(cfg)
    assert loaded.path == good and loaded.skipped[0][0] == bad and "NaN or Inf" in loaded.skipped[0][1]
    assert "checkpoint_skipped" in caplog.text


def test_a_cpu_peer_stages_its_state_without_a_copy_and_the_checkpoint_is_the_same(tmp_path):
    """stage(copy=False), what a CPU peer's daemon does before it waits for the write: the staged tensors are the
    live state's own storage (no 4 parameter copies on top of the round's peak), and what is written reads back bit
    for bit as the copying path's."""
    from gasloc.peer.checkpoint import stage, write_staged

    a = Peer()
    a.train_round()
    live = {t.untyped_storage().data_ptr() for t in [*a.model.state_dict().values(), *a.outer.state_dict().values(),
                                                       *(v for st in a.opt.state.values() for v in st.values()
                                                         if torch.is_tensor(v))]}
    kw = dict(model=a.model, inner_opt=a.opt, outer=a.outer, data_state=a.data.state_dict(), round=a.round,
              meta={"fingerprint": FP, "inner_step": a.step, "tokenizer": "bytes"})
    shared = stage(**kw, copy=False)
    copied = stage(**kw)
    assert {t.untyped_storage().data_ptr() for t in shared.tensors.values()} <= live
    assert not {t.untyped_storage().data_ptr() for t in copied.tensors.values()} & live
    _, t1 = read_checkpoint(write_staged(CheckpointConfig(dir=tmp_path / "a"), shared), FP)
    _, t2 = read_checkpoint(write_staged(CheckpointConfig(dir=tmp_path / "b"), copied), FP)
    assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)
