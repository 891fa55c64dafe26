"""Llama-style GPT: token embedding, pre-norm blocks (rotary GQA attention, SwiGLU), untied head.

Parameter names are fixed because optimizer routing, checkpoints and the pipeline split rely on
them: ``embed.weight``, ``layers.<global index>.<...>``, ``norm.weight``, ``head.weight``. No
biases; only the RMSNorm gains are 1-D. Rotary angles are recomputed in fp32 on every forward
(a few hundred kilo-FLOPs, nothing next to the matmuls), so the model holds no buffers: nothing
to re-initialize after ``to_empty``, nothing a ``.to(bfloat16)`` can degrade.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nobubble.model.config import ModelConfig

# Output projections that write into the residual stream; see init_weights().
RESIDUAL_PROJECTIONS = ("attn.wo.weight", "mlp.w2.weight")


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim // 2), fp32."""
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x (B, T, H, head_dim) by position, in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)  # each (B, T, H, head_dim/2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, head_dim/2)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary positions; n_kv_heads < n_heads shares k/v (GQA)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        # enable_gqa: query head h reads kv head h // (n_heads // n_kv_heads), without copies.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, D))  # heads back into (B, T, D)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), Llama's gated MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # down, into the residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


def check_token_ids(idx: torch.Tensor, cfg: ModelConfig, what: str) -> None:
    """ValueError unless idx is a (B, T) int64 tensor with 1 <= T <= cfg.max_seq_len."""
    if idx.dtype != torch.int64 or idx.dim() != 2:
        raise ValueError(
            f"{what} must be a (batch, seq) int64 tensor of token ids, got dtype {idx.dtype} "
            f"and shape {tuple(idx.shape)}"
        )
    check_seq_len(idx.shape[1], cfg)


def check_seq_len(seq_len: int, cfg: ModelConfig) -> None:
    if not 1 <= seq_len <= cfg.max_seq_len:
        raise ValueError(
            f"sequence length {seq_len} is outside 1..max_seq_len={cfg.max_seq_len}; "
            f"shorten the input or build the model with a larger max_seq_len"
        )


def run_layers(layers: nn.ModuleDict, h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Apply the blocks of ``layers`` in order to hidden states h (B, T, D)."""
    cos, sin = rotary_cos_sin(h.shape[1], cfg.head_dim, cfg.rope_theta, h.device)
    for layer in layers.values():
        h = layer(h, cos, sin)
    return h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B*T positions, computed in fp32."""
    if targets.shape != logits.shape[:-1] or targets.dtype != torch.int64:
        raise ValueError(
            f"targets must be int64 with shape {tuple(logits.shape[:-1])} (batch, seq), got "
            f"dtype {targets.dtype} and shape {tuple(targets.shape)}"
        )
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # (B*T, V) vs (B*T,)


class GPT(nn.Module):
    """The whole model on one device. Build with build_model(); split with split_model()."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Keyed by the global layer index so that names survive a pipeline split unchanged.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) for token ids idx (B, T), or the scalar mean loss given targets."""
        check_token_ids(idx, self.cfg, "GPT.forward idx")
        h = run_layers(self.layers, self.embed(idx), self.cfg)  # (B, T, D)
        logits = self.head(self.norm(h))  # (B, T, V)
        return logits if targets is None else lm_loss(logits, targets)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Normal(0, 0.02) matrices, ones for norm gains, drawn from a local generator.

    Parameters are drawn in ``named_parameters`` order. The residual output projections get
    std 0.02 / sqrt(2 * n_layers): each block adds two of them to the residual stream, so
    without the scaling its variance at init grows with depth (GPT-2, Radford et al. 2019).
    """
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            std = residual_std if name.endswith(RESIDUAL_PROJECTIONS) else 0.02
            param.normal_(mean=0.0, std=std, generator=generator)


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """A GPT on the CPU in fp32, initialized from ``seed`` only; the global RNG is not touched."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"build_model seed must be an int, got {seed!r}")
    with torch.device("meta"):  # skip nn.Linear's default init, which draws from the global RNG
        model = GPT(cfg)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    return model
