"""`gasloc tokenize`: text files or a Hugging Face dataset -> token shards (the `tokens` data source).

    gasloc tokenize --input 'corpus/*.jsonl' --tokenizer ./tokenizer.json --out data/tok
    gasloc peer ... with [data] source = "tokens", paths = ["data/tok/*.bin"], tokenizer = "./tokenizer.json"

The shard format is described in peer/train/sources.py. Tokenizing once up front keeps the peers' CPUs free and
lets them memory-map corpora far larger than RAM.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gasloc.runtime.config import resolve_for_cli


class TokenizeConfig(BaseModel):
    """What to tokenize, with which tokenizer, and where the shards go."""
    model_config = ConfigDict(extra="forbid")

    out_dir: Path | None = Field(None, description="directory for tokens-NNNNN.bin and their .json sidecars")
    paths: list[str] = Field(default_factory=list, description="input .txt/.jsonl(.gz) files or globs; with "
                             "hf_dataset: data_files for it")
    text_field: str = Field("text", description="the text field of a .jsonl line or a dataset row")
    tokenizer: str = Field("bytes", description="'bytes', a tokenizer.json, a directory holding one, or a hub name")
    hf_dataset: str | None = Field(None, description="read this Hugging Face dataset (streamed) instead of files")
    hf_config: str | None = Field(None, description="its configuration")
    hf_split: str = Field("train", description="its split")
    max_docs: int | None = Field(None, ge=1, description="stop after this many documents; unset: all")
    shard_tokens: int = Field(100_000_000, ge=1, description="tokens per shard file")

    @model_validator(mode="after")
    def _has_input(self) -> TokenizeConfig:
        if self.out_dir is None:
            raise ValueError("out_dir is required (--out DIR)")
        if not self.paths and not self.hf_dataset:
            raise ValueError("nothing to tokenize: give --input FILES or --hf-dataset NAME")
        return self


def iter_docs(cfg: TokenizeConfig):
    if cfg.hf_dataset:
        from gasloc.peer.train.hfdata import _text_of, open_hf_stream
        for i, example in enumerate(open_hf_stream(cfg, cfg.hf_split)):
            yield _text_of(example, cfg.text_field, i)
        return
    from gasloc.peer.train.sources import TEXT_SUFFIXES, expand_paths, iter_file_docs
    for path in expand_paths(cfg.paths, TEXT_SUFFIXES, "text (.txt/.jsonl)"):
        yield from iter_file_docs(path, cfg.text_field)


def run(cfg: TokenizeConfig) -> tuple[list[Path], int, int]:
    """Tokenize; returns (shard paths, documents, tokens). Raises ValueError with one line on bad input."""
    from itertools import islice

    from gasloc.peer.train.data import tokenize_docs
    from gasloc.peer.train.sources import ShardWriter
    from gasloc.peer.train.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer)
    writer = ShardWriter(cfg.out_dir, tok.vocab_size, cfg.tokenizer, cfg.shard_tokens)
    docs = 0
    for ids in tokenize_docs(islice(iter_docs(cfg), cfg.max_docs), tok):
        writer.write(ids)
        docs += 1
    shards = writer.close()
    if not writer.total:
        raise ValueError("the input holds no text: nothing was written")
    return shards, docs, writer.total


@click.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML file with these fields")
@click.option("--print-config", is_flag=True, help="print the resolved config and exit")
@click.option("--input", "paths", multiple=True, help="text file or glob (.txt/.jsonl/.gz); repeatable")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="output directory for the shards")
@click.option("--tokenizer", help="'bytes' (default), a tokenizer.json, a directory holding one, or a hub name")
@click.option("--text-field", help="text field of .jsonl lines / dataset rows (default: text)")
@click.option("--hf-dataset", help="tokenize this Hugging Face dataset (streamed) instead of files")
@click.option("--hf-config", help="the dataset's configuration")
@click.option("--hf-split", help="the dataset's split (default: train)")
@click.option("--max-docs", type=int, help="stop after this many documents")
@click.option("--shard-tokens", type=int, help="tokens per shard file (default: 100M)")
def tokenize(config_file, print_config, **flags) -> None:
    """Tokenize text files or a Hugging Face dataset into memory-mappable token shards."""
    cfg = resolve_for_cli(TokenizeConfig, config_file, flags, print_config)
    try:
        shards, docs, total = run(cfg)
    except ValueError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(2)
    click.echo(f"wrote {total} tokens of {docs} documents in {len(shards)} shard(s) to {cfg.out_dir} "
               f"(tokenizer {cfg.tokenizer}); use: data.source = \"tokens\", data.paths = "
               f"[\"{cfg.out_dir}/*.bin\"], data.tokenizer = \"{cfg.tokenizer}\"")
