"""`gasloc export`: a checkpoint becomes a directory that transformers loads as LlamaForCausalLM with the same
logits as our model, and with a tokenizer that encodes like ours."""
from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from gasloc.cli.main import cli  # noqa: E402
from gasloc.peer.checkpoint import CheckpointConfig, save_checkpoint  # noqa: E402
from gasloc.peer.train import model as model_mod  # noqa: E402
from gasloc.peer.train.inner import InnerConfig, make_inner_optimizer  # noqa: E402
from gasloc.peer.train.model import ModelConfig, Preset, build_model  # noqa: E402
from gasloc.peer.train.outer import OuterConfig, make_outer  # noqa: E402

transformers = pytest.importorskip("transformers")  # part of the dev/hf extras; installed in CI

TEXT = "def f(x):\n    return x * 2  # héllo wörld\n"


@pytest.fixture
def gqa_preset(monkeypatch):
    """A small untied grouped-query-attention preset (the shape of 'large'/'xl', at test size)."""
    monkeypatch.setitem(model_mod.PRESETS, "test-gqa",
                        Preset(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, tie_embeddings=False))
    return "test-gqa"


def _checkpoint(tmp_path, preset: str, vocab: int, tokenizer: str, seq_len: int = 48):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, seq_len=seq_len, rope_theta=5000.0), vocab)
    with torch.no_grad():  # move every weight (norms start at 1) so a mis-mapped tensor shows in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    opt = make_inner_optimizer(model, InnerConfig())
    outer = make_outer(OuterConfig(), list(model.parameters()))
    save_checkpoint(CheckpointConfig(dir=tmp_path / "ckpt"), model=model, inner_opt=opt, outer=outer,
                    data_state={"batches": 0}, round=4, meta={"fingerprint": "x", "tokenizer": tokenizer})
    return model


def _export(tmp_path, *extra) -> str:
    out = tmp_path / "hf"
    res = CliRunner().invoke(cli, ["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out), *extra])
    assert res.exit_code == 0, res.output
    assert "exported round 4" in res.output
    return str(out)


def _same_logits(ours, out: str, vocab: int, seq_len: int = 48) -> None:
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours.eval()
    tokens = torch.randint(0, vocab, (3, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(tokens), hf(tokens).logits
    assert a.shape == b.shape
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_tied_byte_model_matches_transformers(tmp_path):
    ours = _checkpoint(tmp_path, "tiny", 256, "bytes")
    out = _export(tmp_path)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 256
    _same_logits(ours, out, 256)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(TEXT)["input_ids"] == list(TEXT.encode("utf-8"))  # the byte tokenizer, as a real HF tokenizer
    assert tok.decode(list(TEXT.encode("utf-8"))) == TEXT


def test_untied_gqa_model_with_hf_tokenizer(tmp_path, gqa_preset):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator([TEXT * 3, "some more text for merges"],
                           trainers.BpeTrainer(vocab_size=280, special_tokens=["</s>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk_path = tmp_path / "tokenizer.json"
    tk.save(str(tk_path))
    vocab = tk.get_vocab_size()
    ours = _checkpoint(tmp_path, gqa_preset, vocab, str(tk_path))
    out = _export(tmp_path, "--dtype", "float32")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == tk.token_to_id("</s>")
    _same_logits(ours, out, vocab)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(TEXT)["input_ids"] == tk.encode(TEXT).ids


def test_bf16_export_halves_the_file(tmp_path):
    _checkpoint(tmp_path, "tiny", 256, "bytes")
    fp32 = os.path.getsize(_export(tmp_path) + "/model.safetensors")
    bf16 = os.path.getsize(_export(tmp_path, "--dtype", "bfloat16") + "/model.safetensors")
    assert bf16 < 0.55 * fp32
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert next(hf.parameters()).dtype == torch.bfloat16


def test_export_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(cli, ["export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path)])
    assert r.exit_code == 2 and r.output == f"Error: checkpoint directory {tmp_path / 'none'} does not exist\n"
    (tmp_path / "ckpt" / ".tmp-ckpt-00000001-1-2-ab").mkdir(parents=True)
    r = CliRunner().invoke(cli, ["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path)])
    assert r.exit_code == 2 and "no valid checkpoint" in r.output and "interrupted save" in r.output
    r = CliRunner().invoke(cli, ["export", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--checkpoint-dir" in r.output
