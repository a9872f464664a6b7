"""A Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) with named presets.

Parameter names follow Hugging Face's `LlamaForCausalLM` (model.layers.N.self_attn.q_proj.weight, ...) and RoPE uses
the same rotate-half convention, so `gasloc export` is a rename-free copy.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tie_embeddings: bool = False


# Sizes in the README come from `gasloc presets` (parameters with the byte vocab and with a 32k vocab).
PRESETS: dict[str, Preset] = {
    # micro: for simulating swarms of 1,000+ workers in one process (each copy with AdamW and outer state: ~0.7 MB)
    "micro": Preset(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=96, tie_embeddings=True),        # ~35k
    "tiny": Preset(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, tie_embeddings=True),       # ~0.9M
    "small": Preset(dim=256, n_layers=6, n_heads=8, n_kv_heads=8, ffn_dim=768, tie_embeddings=True),      # ~5M
    "medium": Preset(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1408),                         # ~25M
    "large": Preset(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048),                        # ~100M
    "xl": Preset(dim=1024, n_layers=20, n_heads=16, n_kv_heads=8, ffn_dim=2816),                          # ~300M
    "1b": Preset(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True),     # ~1.1B
}


class ModelConfig(BaseModel):
    """The model: a preset and the context length. The vocabulary size comes from the tokenizer."""
    model_config = ConfigDict(extra="forbid")

    preset: str = Field("tiny", description=f"one of {', '.join(PRESETS)}")
    seq_len: int = Field(128, ge=8, le=65536, description="context length in tokens")
    rope_theta: float = Field(10000.0, gt=0)
    compile: bool = Field(False, description="torch.compile the model (CUDA only; ignored on CPU)")

    @field_validator("preset")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {', '.join(PRESETS)}")
        return v


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cache(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout, as in HF Llama
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = p.n_heads, p.n_kv_heads, p.dim // p.n_heads
        self.q_proj = nn.Linear(p.dim, p.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(p.dim, p.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(p.dim, p.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(p.n_heads * self.head_dim, p.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_heads:  # grouped-query attention: share each K/V head among n_heads/n_kv queries
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.gate_proj = nn.Linear(p.dim, p.ffn_dim, bias=False)
        self.up_proj = nn.Linear(p.dim, p.ffn_dim, bias=False)
        self.down_proj = nn.Linear(p.ffn_dim, p.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.input_layernorm = RMSNorm(p.dim)
        self.self_attn = Attention(p)
        self.post_attention_layernorm = RMSNorm(p.dim)
        self.mlp = MLP(p)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, p: Preset):
        super().__init__()
        self.embed_tokens = nn.Embedding(0, 0)  # replaced in LlamaLM (needs the vocab size)
        self.layers = nn.ModuleList(Block(p) for _ in range(p.n_layers))
        self.norm = RMSNorm(p.dim)


class LlamaLM(nn.Module):
    """Decoder-only LM. `forward(idx)` returns logits; `loss(batch)` takes a [B, T+1] token batch."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.preset, self.vocab_size = cfg, PRESETS[cfg.preset], vocab_size
        p = self.preset
        self.model = Decoder(p)
        self.model.embed_tokens = nn.Embedding(vocab_size, p.dim)
        self.lm_head = nn.Linear(p.dim, vocab_size, bias=False)
        if p.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_cache(cfg.seq_len, p.dim // p.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)
        for name, prm in self.named_parameters():  # GPT-2 style: scale residual projections by depth
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(prm, std=0.02 / math.sqrt(2 * p.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.model.embed_tokens(idx)
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of a [B, T+1] batch."""
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, vocab_size: int, seed: int = 0) -> LlamaLM:
    """A freshly initialised model; the same seed gives the same weights on every machine."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaLM(cfg, vocab_size)


# What bench/host_memory.py measured for a live CPU peer's per-round peak with the defaults (small -> medium, int8
# codec, 2026-12-05: 8.8 copies, of which the exchange's buffers 2.5; 6.4 with run.compact_host_heap; docs/gpu.md):
# the README's preset table and `gasloc presets`.
MEASURED_ROUND_COPIES = 8.8


def preset_table(vocab_sizes: tuple[int, ...] = (256, 32000)) -> list[dict]:
    """Parameter counts and a CPU peer's per-round peak memory per preset: the measured parameter copies
    (MEASURED_ROUND_COPIES, bench/host_memory.py) x 4 bytes; the runtime's ~0.5 GB and activations come on
    top."""

    rows = []
    for name, p in PRESETS.items():
        row = {"preset": name, **asdict(p)}
        for v in vocab_sizes:
            per_layer = 2 * p.dim * p.dim + 2 * p.dim * (p.dim // p.n_heads) * p.n_kv_heads + 3 * p.dim * p.ffn_dim \
                + 2 * p.dim
            n = p.n_layers * per_layer + v * p.dim * (1 if p.tie_embeddings else 2) + p.dim
            row[f"params_vocab{v}"] = n
            row[f"train_mem_gb_vocab{v}"] = round(n * 4 * MEASURED_ROUND_COPIES / 1e9, 2)
        rows.append(row)
    return rows


def autocast_for(device: torch.device | str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (matmuls in bf16, reductions and the loss in fp32); plain fp32 elsewhere.

    A fresh context manager per call, so it can be entered by nested or repeated `with` blocks.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def maybe_compile(model: LlamaLM, cfg: ModelConfig, device: torch.device | str) -> LlamaLM:
    """`torch.compile` the model's forward in place when cfg.compile is set and the device is CUDA; else a no-op.

    Compiling in place (nn.Module.compile) keeps the module, its parameter names and its state_dict keys unchanged,
    so checkpoints, the outer update and `gasloc export` see the same model either way.
    """
    if not cfg.compile:
        return model
    if torch.device(device).type != "cuda":
        log.info("compile_skipped reason=not_cuda device=%s", device)
        return model
    model.compile()
    log.info("compile_enabled device=%s", device)
    return model
