"""The zoo's Llama-style decoder (grouped-query attention, RMSNorm, rotary positions, SwiGLU),
its shapes (:class:`LlamaConfig`: a tiny one and Llama 2 7B and 70B) and their parameter
counts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LLAMA_7B",
    "LLAMA_70B",
    "LLAMA_TINY",
    "LlamaConfig",
    "llama_decoder",
    "llama_param_count",
]


# --------------------------------------------------------------------------------------------
# Llama-style decoder.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-style decoder.

    Attributes
    ----------
    vocab_size, d_model, n_layer
        Vocabulary, residual width, number of blocks.
    n_head, n_kv_head
        Query heads and key/value heads; ``n_kv_head < n_head`` is grouped-query attention.
    ffn_hidden
        Width of the SwiGLU MLP's gate and up projections.
    max_len
        Longest supported sequence (rotary embeddings have no table, so this only validates).
    tie_weights
        Share the token embedding with the LM head.
    norm_eps, rope_theta
        RMSNorm epsilon and the rotary base.
    """

    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    max_len: int
    tie_weights: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# Llama-2-7B and Llama-2-70B: Touvron et al. 2023, "Llama 2" (arXiv:2307.09288), Table 1 and
# section 2.2 (GQA for the 34B/70B models), with the exact sizes from Meta's released configs
# (meta-llama/Llama-2-7b-hf and -70b-hf config.json: hidden_size, intermediate_size,
# num_attention_heads, num_key_value_heads, num_hidden_layers, vocab_size,
# max_position_embeddings, rms_norm_eps=1e-5; untied embeddings).
LLAMA_7B = LlamaConfig(32000, 4096, 32, 32, 32, 11008, 4096)
LLAMA_70B = LlamaConfig(32000, 8192, 80, 64, 8, 28672, 4096)
# Same structure (GQA with 2 query heads per KV head), small enough for CPU tests.
LLAMA_TINY = LlamaConfig(
    vocab_size=1000, d_model=128, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=344, max_len=128
)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), with a learned scale, no bias."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions ``0..seq_len-1`` (Su et al. 2021, arXiv:2104.09864).

    Computed per forward rather than cached in buffers, so the model's state is exactly its
    parameters (what the closed-form count describes) and meta/fake builds stay trivial. The
    half-split ("rotate_half") convention is Hugging Face's Llama implementation's.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class LlamaAttention(nn.Module):
    """Bias-free grouped-query attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        group = self.n_head // self.n_kv_head
        if group > 1:
            # Explicit repeat rather than SDPA's enable_gqa (torch>=2.5 only): works on every
            # supported torch, at the cost of materialising the repeated K/V, as many
            # implementations do.
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq_len, d_model))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaDecoder(nn.Module):
    """A Llama-2-architecture language model (module names follow Hugging Face's)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_len {self.config.max_len}")
        x = self.embed_tokens(input_ids)
        cos, sin = _rotary_cos_sin(
            seq_len, self.config.head_dim, self.config.rope_theta, x.device, x.dtype
        )
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def llama_decoder(config: LlamaConfig = LLAMA_TINY) -> nn.Module:
    """A Llama-2-style decoder: RMSNorm, SwiGLU, bias-free GQA attention, rotary positions.

    Builds on whatever device is current, so ``with torch.device("meta"):`` gives a
    shape-only model instantly, even for :data:`LLAMA_70B`. Weights keep PyTorch's default
    initialisation (a memory reference, not a training recipe); there is no dropout and no
    KV cache.

    Parameters
    ----------
    config
        The model's shape; :data:`LLAMA_TINY` by default.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns logits ``(batch, seq_len, vocab)``.
        Its parameter count is :func:`llama_param_count` of ``config``.

    Examples
    --------
    >>> from vram_widget.zoo import LLAMA_7B, llama_decoder
    >>> with torch.device("meta"):
    ...     model = llama_decoder(LLAMA_7B)
    >>> sum(p.numel() for p in model.parameters())
    6738415616
    """
    return LlamaDecoder(config)


def llama_param_count(config: LlamaConfig) -> int:
    """The parameter count of :func:`llama_decoder` of ``config``, in closed form.

    Per block: Q and O projections ``d^2`` each, K and V ``d * n_kv_head * head_dim`` each,
    SwiGLU ``3 * d * ffn_hidden``, two RMSNorm scales ``2 * d``. Plus the embedding
    ``vocab * d``, the final norm ``d`` and, unless tied, the LM head ``vocab * d``.

    Parameters
    ----------
    config
        The model's shape.

    Returns
    -------
    int

    Examples
    --------
    >>> from vram_widget.zoo import LLAMA_7B, LLAMA_70B, llama_param_count
    >>> llama_param_count(LLAMA_7B)  # Llama-2-7B
    6738415616
    >>> llama_param_count(LLAMA_70B)  # Llama-2-70B
    68976648192
    """
    d = config.d_model
    kv_dim = config.n_kv_head * config.head_dim
    per_block = 2 * d * d + 2 * d * kv_dim + 3 * d * config.ffn_hidden + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_weights else 2)
    return embeddings + config.n_layer * per_block + d
