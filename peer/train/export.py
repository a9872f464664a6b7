"""`gasloc export`: the newest valid checkpoint -> a Hugging Face `LlamaForCausalLM` directory.

    gasloc export --checkpoint-dir runs/r1/peer/checkpoints --out my-model
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('my-model')"

Our parameter names are HF Llama's and RoPE uses HF's rotate-half layout, so the weights are copied unchanged; only
the tied lm_head is dropped (HF re-ties it from tie_word_embeddings). The tokenizer goes along: a Hugging Face one as
its tokenizer.json, the byte tokenizer as an equivalent byte-level tokenizer.json (id = byte value).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import click
from pydantic import BaseModel, ConfigDict, Field

from gasloc.runtime.config import resolve_for_cli

DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class ExportConfig(BaseModel):
    """Which checkpoint to export, and where."""
    model_config = ConfigDict(extra="forbid")

    checkpoint_dir: Path | None = Field(None, description="a peer's checkpoint directory; its newest valid "
                                        "checkpoint is exported")
    out_dir: Path | None = Field(None, description="output directory (created; existing files are overwritten)")
    tokenizer: str | None = Field(None, description="tokenizer to ship; unset: the one recorded in the checkpoint")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the saved weights")


def hf_config(model: dict, eos_id: int | None, dtype: str) -> dict:
    """config.json of LlamaForCausalLM for a checkpoint's model record (preset dims, config, vocab size)."""
    p, cfg = model["preset"], model["config"]
    theta = float(cfg["rope_theta"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(model["vocab_size"]), "hidden_size": p["dim"], "intermediate_size": p["ffn_dim"],
        "num_hidden_layers": p["n_layers"], "num_attention_heads": p["n_heads"],
        "num_key_value_heads": p["n_kv_heads"], "head_dim": p["dim"] // p["n_heads"],
        "max_position_embeddings": int(cfg["seq_len"]), "rms_norm_eps": 1e-5, "hidden_act": "silu",
        # both spellings: transformers >= 5 reads rope_parameters, 4.x reads rope_theta
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": bool(p.get("tie_embeddings", False)), "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None, "torch_dtype": dtype, "dtype": dtype,
    }


def run(cfg: ExportConfig) -> dict:
    """Export; returns a summary. Raises ValueError with one line when there is nothing valid to export."""
    import torch
    from safetensors.torch import save_file

    from gasloc.peer.checkpoint import scan
    from gasloc.peer.train.tokenizer import load_tokenizer

    if cfg.checkpoint_dir is None or cfg.out_dir is None:
        raise ValueError("give --checkpoint-dir DIR and --out DIR")
    if not cfg.checkpoint_dir.is_dir():
        raise ValueError(f"checkpoint directory {cfg.checkpoint_dir} does not exist")
    skipped, found = [], None
    for item in scan(cfg.checkpoint_dir):
        if item[0] == "skip":
            skipped.append(f"{item[1].name}: {item[2]}")
        else:
            found = item
            break
    if found is None:
        why = f" (skipped {len(skipped)}: {skipped[0]})" if skipped else ""
        raise ValueError(f"no valid checkpoint in {cfg.checkpoint_dir}{why}")
    _, path, record, tensors = found
    model = record.get("model", {})
    if not {"preset", "config", "vocab_size"} <= set(model):
        raise ValueError(f"checkpoint {path.name} does not record the model's shape (written by another model class?)")

    spec = cfg.tokenizer or record["meta"].get("tokenizer") or ("bytes" if model["vocab_size"] == 256 else None)
    tok = load_tokenizer(spec) if spec else None
    if tok is not None and tok.vocab_size != model["vocab_size"]:
        raise ValueError(f"tokenizer {spec!r} has {tok.vocab_size} tokens but the model has {model['vocab_size']}")

    tied = model["preset"].get("tie_embeddings", False)
    dtype = getattr(torch, cfg.dtype)
    weights = {k[len("model."):]: t.to(dtype).contiguous() for k, t in tensors.items() if k.startswith("model.")}
    if tied:
        weights.pop("lm_head.weight", None)
    else:  # an untied model stores both; an alias here would mean the checkpoint is not what its preset says
        for name, target in record["aliases"].items():
            weights.setdefault(name, weights[target].clone())

    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(model, tok.eos_id if tok is not None else None, cfg.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tok is not None:
        tok.save(out)
    summary = {"checkpoint": str(path), "round": record["round"], "fingerprint": record["fingerprint"],
               "tokenizer": spec, "params": int(sum(t.numel() for t in weights.values())), "dtype": cfg.dtype,
               "skipped": skipped}
    (out / "gasloc_export.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file with these fields")
@click.option("--print-config", is_flag=True, help="print the resolved config and exit")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), help="the peer's checkpoint directory")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="output directory")
@click.option("--tokenizer", help="tokenizer to ship (default: the checkpoint's)")
@click.option("--dtype", type=click.Choice(list(DTYPES)), help="weights dtype (default: float32)")
def export(config_file, print_config, **flags) -> None:
    """Export the newest valid checkpoint as a Hugging Face LlamaForCausalLM directory."""
    cfg = resolve_for_cli(ExportConfig, config_file, flags, print_config)
    try:
        s = run(cfg)
    except ValueError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    for reason in s["skipped"]:
        click.echo(f"warning: skipped {reason}", err=True)
    click.echo(f"exported round {s['round']} ({s['params'] / 1e6:.2f}M params, {s['dtype']}, tokenizer "
               f"{s['tokenizer'] or 'none'}) from {s['checkpoint']} to {cfg.out_dir}")
