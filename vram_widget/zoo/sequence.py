"""The zoo's small non-vision models: an MLP, a Transformer encoder, a GPT-style decoder, an
LSTM, an embedding-dominated model, a tied autoencoder and a model taking a dict of inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SequenceClassifierOutput",
    "causal_decoder",
    "dict_input_classifier",
    "embedding_heavy",
    "lstm_classifier",
    "mlp",
    "tied_autoencoder",
    "transformer_encoder",
]


# --------------------------------------------------------------------------------------------
# Small non-vision models.
# --------------------------------------------------------------------------------------------


def mlp(
    in_features: int = 784,
    hidden: Sequence[int] = (512, 512),
    num_classes: int = 10,
    dropout: float = 0.1,
) -> nn.Module:
    """A multi-layer perceptron: (Linear, ReLU, Dropout) per hidden width, then a Linear.

    Parameters
    ----------
    in_features
        Width of the input vectors (784 = a flattened 28x28 image).
    hidden
        Widths of the hidden layers.
    num_classes
        Output width.
    dropout
        Dropout probability after each hidden activation.

    Returns
    -------
    nn.Sequential
        Takes ``(batch, in_features)`` floats, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import mlp
    >>> mlp(hidden=(16,))(torch.zeros(3, 784)).shape
    torch.Size([3, 10])
    """
    layers: list[nn.Module] = []
    width = in_features
    for hidden_width in hidden:
        layers += [nn.Linear(width, hidden_width), nn.ReLU(), nn.Dropout(dropout)]
        width = hidden_width
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class TransformerEncoderClassifier(nn.Module):
    """Token + learned position embeddings, ``nn.TransformerEncoder``, mean-pool, Linear."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        nhead: int,
        num_layers: int,
        dim_feedforward: int,
        max_len: int,
        dropout: float,
        num_classes: int,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=dim_feedforward, dropout=dropout, batch_first=True
        )
        # No padding mask is ever passed, so the nested-tensor path could never engage; turning
        # it off keeps PyTorch from warning about it and from probing the layer at build time.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.dropout(self.tok_emb(input_ids) + self.pos_emb(positions))
        x = self.encoder(x)
        return self.head(x.mean(dim=1))


def transformer_encoder(
    vocab_size: int = 1000,
    d_model: int = 128,
    nhead: int = 4,
    num_layers: int = 2,
    dim_feedforward: int = 512,
    max_len: int = 128,
    dropout: float = 0.1,
    num_classes: int = 10,
) -> nn.Module:
    """A small BERT-like sequence classifier built on ``nn.TransformerEncoder``.

    Parameters
    ----------
    vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout
        As in ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` (post-norm, ReLU).
    max_len
        Number of learned positions; inputs may be at most this long.
    num_classes
        Output width of the head applied to the mean of the token states.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import transformer_encoder
    >>> transformer_encoder()(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 10])
    """
    return TransformerEncoderClassifier(
        vocab_size, d_model, nhead, num_layers, dim_feedforward, max_len, dropout, num_classes
    )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (GPT-2 layout)."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        q, k, v = self.c_attn(x).split(d_model, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout SDPA expects.
        q, k, v = (
            t.view(batch, seq_len, self.n_head, d_model // self.n_head).transpose(1, 2)
            for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq_len, d_model)
        return self.resid_dropout(self.c_proj(y))


class DecoderBlock(nn.Module):
    """Pre-norm GPT block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CausalDecoder(nn.Module):
    """A GPT-2-style language model (token + learned position embeddings, pre-norm blocks)."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_head: int,
        n_layer: int,
        max_len: int,
        dropout: float,
        tie_weights: bool,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(DecoderBlock(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            # The same Parameter object under two modules: model.parameters() yields it once,
            # and its gradient accumulates from both uses (the GPT-2 convention).
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def causal_decoder(
    vocab_size: int = 1000,
    d_model: int = 128,
    n_head: int = 4,
    n_layer: int = 2,
    max_len: int = 128,
    dropout: float = 0.1,
    tie_weights: bool = True,
) -> nn.Module:
    """A small GPT-style decoder using ``F.scaled_dot_product_attention(is_causal=True)``.

    Parameters
    ----------
    vocab_size, d_model, n_head, n_layer
        Vocabulary, width, heads and depth; the MLP is ``4 * d_model`` wide with GELU.
    max_len
        Number of learned positions; inputs may be at most this long.
    dropout
        Embedding, attention and residual dropout (attention dropout only in training mode).
    tie_weights
        Share one Parameter between the token embedding and the LM head.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns logits ``(batch, seq_len, vocab)``.

    Examples
    --------
    >>> from vram_widget.zoo import causal_decoder
    >>> model = causal_decoder()
    >>> model.lm_head.weight is model.tok_emb.weight
    True
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 1000])
    """
    return CausalDecoder(vocab_size, d_model, n_head, n_layer, max_len, dropout, tie_weights)


class LSTMClassifier(nn.Module):
    """Embedding, multi-layer ``nn.LSTM``, Linear on the last layer's final hidden state."""

    def __init__(
        self, vocab_size: int, embed_dim: int, hidden: int, num_layers: int, num_classes: int
    ):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        _, (h_n, _) = self.lstm(self.embedding(input_ids))
        return self.head(h_n[-1])


def lstm_classifier(
    vocab_size: int = 1000,
    embed_dim: int = 64,
    hidden: int = 128,
    num_layers: int = 2,
    num_classes: int = 10,
) -> nn.Module:
    """A recurrent sequence classifier on ``nn.LSTM(batch_first=True)``.

    Parameters
    ----------
    vocab_size, embed_dim
        Token embedding table shape.
    hidden, num_layers
        LSTM hidden width and depth.
    num_classes
        Output width.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import lstm_classifier
    >>> lstm_classifier()(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 10])
    """
    return LSTMClassifier(vocab_size, embed_dim, hidden, num_layers, num_classes)


class EmbeddingHeavy(nn.Module):
    """A big ``nn.Embedding`` (dense gradient), mean over tokens, Linear."""

    def __init__(self, vocab_size: int, embed_dim: int, num_classes: int):
        super().__init__()
        # sparse=False (the default): the gradient is a dense (vocab, dim) tensor however few
        # rows a batch touches, which is what makes this model's memory table-dominated.
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(input_ids).mean(dim=1))


def embedding_heavy(
    vocab_size: int = 50_000, embed_dim: int = 64, num_classes: int = 10
) -> nn.Module:
    """A bag-of-tokens classifier whose memory is dominated by its embedding table.

    Parameters
    ----------
    vocab_size, embed_dim
        Table shape: 3.2M parameters (12.8 MB in fp32) at the defaults, against 650 in the head.
    num_classes
        Output width.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import embedding_heavy
    >>> sum(p.numel() for p in embedding_heavy().parameters())
    3200650
    """
    return EmbeddingHeavy(vocab_size, embed_dim, num_classes)


class TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder reuses the encoder's weight, transposed."""

    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        # Only the decoder's bias is its own; its weight is encoder.weight.t() (a view, so no
        # second copy), and the encoder weight's gradient sums the contributions of both uses.
        self.decoder_bias = nn.Parameter(torch.zeros(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.encoder(x))
        return F.linear(h, self.encoder.weight.t(), self.decoder_bias)


def tied_autoencoder(in_features: int = 784, hidden: int = 128) -> nn.Module:
    """A one-hidden-layer autoencoder with tied encoder/decoder weights.

    Parameters
    ----------
    in_features
        Input (and reconstruction) width.
    hidden
        Code width.

    Returns
    -------
    nn.Module
        Takes ``(batch, in_features)`` floats and returns their reconstruction. Parameters:
        ``in_features * hidden + hidden + in_features`` (the shared weight counted once).

    Examples
    --------
    >>> from vram_widget.zoo import tied_autoencoder
    >>> sum(p.numel() for p in tied_autoencoder().parameters())
    101264
    """
    return TiedAutoencoder(in_features, hidden)


@dataclasses.dataclass
class SequenceClassifierOutput:
    """A Hugging Face-style model output: ``loss`` is None unless labels were given."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class DictInputClassifier(nn.Module):
    """A keyword-input classifier with a Hugging Face-style output (for testing plumbing)."""

    def __init__(self, vocab_size: int, d_model: int, num_classes: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> SequenceClassifierOutput:
        mask = attention_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        x = torch.tanh(self.proj(self.embedding(input_ids)))
        # Masked mean: padding positions contribute nothing (clamp guards an all-pad row).
        pooled = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        logits = self.head(pooled)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(logits=logits, loss=loss)


def dict_input_classifier(
    vocab_size: int = 1000, d_model: int = 64, num_classes: int = 4
) -> nn.Module:
    """A model called as ``model(input_ids=..., attention_mask=..., labels=...)``.

    Parameters
    ----------
    vocab_size, d_model
        Embedding table shape.
    num_classes
        Output width.

    Returns
    -------
    nn.Module
        Returns a :class:`SequenceClassifierOutput` with ``logits`` ``(batch, num_classes)``
        and, when ``labels`` (int64, ``(batch,)``) is given, a scalar cross-entropy ``loss``.

    Examples
    --------
    >>> from vram_widget.zoo import zoo_model
    >>> entry = zoo_model("dict_input")
    >>> out = entry.build()(**entry.make_inputs(3))
    >>> out.logits.shape, out.loss.shape
    (torch.Size([3, 4]), torch.Size([]))
    """
    return DictInputClassifier(vocab_size, d_model, num_classes)
