"""Data sources without Hugging Face datasets: embedded corpus, local text/JSONL files, token shards
(`gasloc tokenize`), resumable positions, and the one-line errors for bad input."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from pydantic import ValidationError

from gasloc.cli.main import cli
from gasloc.peer.train.data import ByteTokenizer, DataConfig, TokenData, build_data, embedded_tokens, evaluate
from gasloc.peer.train.sources import ShardWriter, TokenSeq, open_token_shard
from gasloc.peer.train.tokenizer import load_tokenizer

SEQ = 32


def _docs(n: int, tag: str = "d") -> list[str]:
    return [f"<{tag}{i:03d}> " + "lorem ipsum dolor sit amet " * (3 + i % 5) for i in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """Three files: a .txt, a .jsonl and a gzipped .jsonl (with an extra field and a blank line)."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("plain text file\n" * 200)
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(_docs(60))))
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"text": t}) for t in _docs(40, "z")) + "\n\n")
    return d


def test_embedded_default_keeps_its_api():
    data, tok = build_data(DataConfig(), SEQ)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    assert isinstance(data, TokenData)
    b = data.next_batch()
    assert b.shape == (8, SEQ + 1) and b.dtype == torch.int64
    assert len(data.val_batches()) == 4 and data.state_dict() == {"batches": 1}
    assert len(embedded_tokens()) > 400_000


def test_window_position_resumes_exactly():
    cfg = DataConfig(batch_size=3, shard_index=0, num_shards=2)
    a, _ = build_data(cfg, SEQ)
    for _ in range(5):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b, _ = build_data(cfg, SEQ)
    b.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(a.next_batch(), b.next_batch())


def test_files_source_reads_every_file_in_order(corpus):
    cfg = DataConfig(source="files", paths=[str(corpus / "*.txt"), str(corpus / "*.jsonl*")], batch_size=4,
                     val_fraction=0.1)
    data, tok = build_data(cfg, SEQ)
    stream = tok.decode(np.asarray(data.tokens))
    assert stream.startswith("plain text file") and "<d059>" in stream
    assert stream.endswith(_docs(40, "z")[-1] + "\n\n")  # every document ends with the separator
    assert stream.index("<d000>") < stream.index("<z000>")
    b = data.next_batch()
    assert b.shape == (4, SEQ + 1) and int(b.max()) < 256
    val_text = tok.decode(np.asarray(data.val_tokens))
    assert "<z039>" in val_text and "<d0" not in val_text  # the tail of the last file is the validation split
    assert tok.decode(data.val_batches()[-1][-1].tolist()) in val_text


def test_tokenize_cli_then_tokens_source_equals_files_source(corpus, tmp_path):
    out = tmp_path / "tok"
    res = CliRunner().invoke(cli, ["tokenize", "--input", str(corpus / "*"), "--out", str(out),
                                   "--shard-tokens", "4000"])
    assert res.exit_code == 0, res.output
    assert "use: data.source = \"tokens\"" in res.output
    shards = sorted(out.glob("*.bin"))
    assert len(shards) > 2 and all(s.with_suffix(".json").is_file() for s in shards)
    header = json.loads(shards[0].with_suffix(".json").read_text())
    assert header == {"format": "gasloc-tokens", "version": 1, "dtype": "uint16", "num_tokens": 4000,
                      "vocab_size": 256, "tokenizer": "bytes"}

    kw = dict(batch_size=4, val_fraction=0.1, shard_index=1, num_shards=2)
    files, _ = build_data(DataConfig(source="files", paths=[str(corpus / "*")], **kw), SEQ)
    tokens, _ = build_data(DataConfig(source="tokens", paths=[str(out / "*.bin")], **kw), SEQ)
    assert isinstance(tokens.tokens, TokenSeq) and len(tokens.tokens) == len(files.tokens)
    for _ in range(5):  # windows that cross shard files gather from both
        assert torch.equal(files.next_batch(), tokens.next_batch())
    assert all(torch.equal(x, y) for x, y in zip(files.val_batches(), tokens.val_batches(), strict=True))


def test_token_seq_gathers_across_arrays():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 1000, n).astype(np.uint16) for n in (5, 0, 17, 3, 40)]
    whole = np.concatenate(parts)
    seq = TokenSeq(parts)
    idx = rng.integers(0, len(whole), (7, 9))
    assert len(seq) == len(whole) and np.array_equal(seq[idx], whole[idx])
    tail = seq[20:]
    assert len(tail) == len(whole) - 20 and np.array_equal(tail[np.arange(len(tail))], whole[20:])


def test_npy_shards_and_token_id_beyond_vocab(tmp_path):
    good = np.frombuffer(("hello world " * 400).encode(), dtype=np.uint8).astype(np.uint16)
    np.save(tmp_path / "good.npy", good)
    data, _ = build_data(DataConfig(source="tokens", paths=[str(tmp_path / "good.npy")], batch_size=2), SEQ)
    assert data.next_batch().shape == (2, SEQ + 1)
    bad = good.copy()
    bad[:] = 300  # not a byte: made with another tokenizer
    np.save(tmp_path / "bad.npy", bad)
    data, _ = build_data(DataConfig(source="tokens", paths=[str(tmp_path / "bad.npy")], batch_size=2), SEQ)
    with pytest.raises(ValueError, match="token id 300 .* >= the tokenizer's vocabulary size 256"):
        data.next_batch()


def test_shard_header_mismatches_are_caught(tmp_path):
    w = ShardWriter(tmp_path, 1000, "some-tokenizer", shard_tokens=10_000)
    w.write(np.arange(500) % 1000)
    (shard,) = w.close()
    with pytest.raises(ValueError, match="vocabulary 1000.* data.tokenizer='bytes' has 256"):
        build_data(DataConfig(source="tokens", paths=[str(shard)]), SEQ)
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        open_token_shard(shard)
    shard.with_suffix(".json").unlink()
    with pytest.raises(ValueError, match="no sidecar"):
        open_token_shard(shard)


@pytest.mark.parametrize("setup,cfg,message", [
    (None, dict(source="files", paths=["/no/such/file.txt"]), "matches no file"),
    ("empty", dict(source="files", paths=["{d}/e.txt"]), "is empty"),
    ("nofield", dict(source="files", paths=["{d}/x.jsonl"]), r"x.jsonl:1 has no field 'text'"),
    ("badjson", dict(source="files", paths=["{d}/x.jsonl"]), r"x.jsonl:2 is not valid JSON"),
    ("wrongsuffix", dict(source="files", paths=["{d}/x.csv"]), "is not a text"),
    (None, dict(tokenizer="./no/such/tokenizer.json"), "does not exist"),
    (None, dict(tokenizer="no-such-org/no-such-tokenizer"), "unknown tokenizer"),
])
def test_bad_input_is_one_line_value_error(tmp_path, monkeypatch, setup, cfg, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = tmp_path
    if setup == "empty":
        (d / "e.txt").write_text("")
    elif setup == "nofield":
        (d / "x.jsonl").write_text('{"body": "hi"}\n')
    elif setup == "badjson":
        (d / "x.jsonl").write_text('{"text": "hi"}\n{"text": \n')
    elif setup == "wrongsuffix":
        (d / "x.csv").write_text("a,b\n")
    cfg = {k: ([p.format(d=d) for p in v] if k == "paths" else v) for k, v in cfg.items()}
    with pytest.raises(ValueError, match=message) as e:
        build_data(DataConfig(**cfg), SEQ)
    assert "\n" not in str(e.value)


def test_config_cross_checks():
    with pytest.raises(ValidationError, match="needs data.paths"):
        DataConfig(source="files")
    with pytest.raises(ValidationError, match="needs data.hf_dataset"):
        DataConfig(source="hf", shard_index=0)
    with pytest.raises(ValidationError, match="needs data.shard_index"):
        DataConfig(source="hf", hf_dataset="json")


def test_tokenize_cli_errors_exit_2_with_one_line(tmp_path):
    r = CliRunner().invoke(cli, ["tokenize", "--out", str(tmp_path)])
    assert r.exit_code == 2 and r.output.startswith("Error: ") and "nothing to tokenize" in r.output
    r = CliRunner().invoke(cli, ["tokenize", "--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "matches no file" in r.output and r.output.count("\n") == 1
    r = CliRunner().invoke(cli, ["tokenize", "--input", "x.txt", "--out", str(tmp_path), "--print-config"])
    assert r.exit_code == 0 and 'tokenizer = "bytes"' in r.output


def test_evaluate_accepts_an_autocast_context():
    from gasloc.peer.train.model import ModelConfig, autocast_for, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(seq_len=SEQ), 256)
    data, _ = build_data(DataConfig(batch_size=2, val_batches=2), SEQ)
    plain = evaluate(model, data.val_batches())
    assert evaluate(model, data.val_batches(), autocast_for("cpu")) == plain
    assert 5.0 < plain < 6.0  # about ln(256) for an untrained model


def test_tokenizer_spec_bytes():
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_private_batches_are_unpredictable_and_leave_the_training_position():
    """A donor's state or a partner's offer is checked on batches nobody else can know (issue 29: the shared
    validation batch let a state be tuned to pass): every call draws new windows, none is a validation batch,
    and the training stream's position does not move."""
    from gasloc.peer.train.data import private_batches

    data, _ = build_data(DataConfig(batch_size=4), SEQ)
    before = data.state_dict()
    a, b = private_batches(data, 2), private_batches(data, 2)
    assert data.state_dict() == before
    assert len(a) == 2 and a[0].shape == (4, SEQ + 1) and a[0].dtype == torch.int64
    assert not torch.equal(a[0], b[0])                      # not the same windows on every call
    val = data.val_batches()
    assert all(not torch.equal(x, v) for x in a + b for v in val)
    # windows of our training tokens (not the held-out tail)
    train = torch.from_numpy(np.asarray(data.train_tokens).astype(np.int64))
    row = a[0][0]
    hits = (train.unfold(0, SEQ + 1, 1) == row).all(dim=1)
    assert bool(hits.any())
    assert private_batches(data, 0) == []
