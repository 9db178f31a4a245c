"""Small Hugging Face models and their batches, shared by the accuracy sweeps (no download:
each is built from a config; 16 tokens of a 1,000-word vocabulary)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB = 1000


def tokens(batch: int) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` of 16 tokens (causal LMs, and T5's encoder/decoder)."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, VOCAB, (batch, 16), generator=gen)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, 16), generator=gen)}


def classify(batch: int) -> dict[str, torch.Tensor]:
    """16 tokens and one of 3 labels per sample (sequence classification)."""
    gen = torch.Generator().manual_seed(batch)
    return {
        "input_ids": torch.randint(0, VOCAB, (batch, 16), generator=gen),
        "labels": torch.randint(0, 3, (batch,), generator=gen),
    }


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=VOCAB, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=128,
        vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def qwen2() -> nn.Module:
    config = transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def mistral(window: int = 24) -> nn.Module:
    """Mistral: :func:`llama`'s shape with a sliding window of ``window`` tokens on every
    layer."""
    config = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        sliding_window=window,
    )  # fmt: skip
    return transformers.MistralForCausalLM(config)


def llama_mha() -> nn.Module:
    """:func:`llama` with as many key/value heads as heads (4), so 4 tensor-parallel ranks
    divide them."""
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def mixtral() -> nn.Module:
    """:func:`llama`'s shape with a mixture of 4 experts, 2 per token."""
    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def mixtral_balanced() -> nn.Module:
    """:func:`mixtral` with each router's weight rows ``[w, -w, u, -u]``: a token's logits
    ``a, -a, b, -b`` have the positive one of each pair on top, one of experts 0-1 and one of
    experts 2-3, so 2 expert-parallel ranks receive the same number of tokens."""
    model = mixtral()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                w, u = torch.randn(2, module.weight.shape[1])
                module.weight.copy_(torch.stack([w, -w, u, -u]))
    return model


def bert_encoder() -> nn.Module:
    """:func:`bert`'s encoder alone (``BertModel``: embeddings, layers, pooler; no head)."""
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=VOCAB,
    )  # fmt: skip
    return transformers.BertModel(config)
