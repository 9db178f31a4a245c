"""Accuracy of ``estimate(mode="generate")`` against Hugging Face's own ``model.generate``.

The estimate comes from one profile per model (``device="cpu"``, 16-token prompts):
``profile.estimate(batch, mode="generate", seq_len=prompt, new_tokens=T)``, Hugging Face's
generate recorded on fake tensors for the prefill and 4 decode steps, the rest extrapolated
from the pattern they follow. The truth is ``measure(model, prompts, mode="generate",
new_tokens=T)``: ``model.generate(do_sample=False, max_new_tokens=T, min_new_tokens=T)`` run
for real on the CPU, its peak read from the CPU allocator's events.

Models (no download, random weights): GPT-2 small's own config (124M, learned positions),
and reduced configs of Llama (grouped-query attention, 4 query heads per key/value head),
Mistral (grouped-query, a sliding window of 128 tokens: prompts of 16 stay below it, prompts
of 200 start past it; and a window of 48, which 16 + 64 tokens cross), T5-small
(encoder-decoder, self- and cross-attention caches) and Mixtral (8 experts, 2 per token),
then GPT-2 and Llama generating with a StaticCache (``cache_implementation="static"``), each
at batch {1, 4} x prompt {16, 200} x T {8, 64}, fp32.

    python benchmarks/accuracy_generate.py      # about 4 minutes on 2 cores

Target: worst <= 2 %. Writes
results/accuracy_generate.json and prints a markdown table (docs/accuracy.md's
generation section is written from it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch
import transformers
from _results import write_results
from torch import nn

from vram_widget import measure, profile_model

VOCAB = 32000
BATCHES = (1, 4)
PROMPTS = (16, 200)
NEW_TOKENS = (8, 64)


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config())


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1376, vocab_size=VOCAB,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def mistral(window: int = 128) -> nn.Module:
    config = transformers.MistralConfig(
        num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1376, vocab_size=VOCAB, sliding_window=window,
    )  # fmt: skip
    return transformers.MistralForCausalLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
        decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=512, vocab_size=VOCAB, num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def static(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``make``'s model generating with a StaticCache (allocated whole before the first step)."""

    def build() -> nn.Module:
        model = make()
        model.generation_config.cache_implementation = "static"
        return model

    return build


MODELS: dict[str, Callable[[], nn.Module]] = {
    "GPT-2 small": gpt2,
    "Llama (GQA)": llama,
    "Mistral (window 128)": mistral,
    "Mistral (window 48)": lambda: mistral(48),
    "T5-small": t5,
    "Mixtral (8 experts)": mixtral,
    "GPT-2 small, StaticCache": static(gpt2),
    "Llama (GQA), StaticCache": static(llama),
}


def prompts(batch: int, length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 1000 + length)
    return {"input_ids": torch.randint(2, VOCAB, (batch, length), generator=gen)}


def main() -> None:
    torch.set_num_threads(1)  # CPU kernel scratch can depend on the thread count
    started = time.perf_counter()
    rows = []
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        t0 = time.perf_counter()
        example = {**prompts(2, 16), "labels": prompts(2, 16)["input_ids"]}  # T5 trains on them
        profile = profile_model(model, inputs=example, device="cpu")
        profile_s = time.perf_counter() - t0
        for batch in BATCHES:
            for prompt in PROMPTS:
                for tokens in NEW_TOKENS:
                    t0 = time.perf_counter()
                    est = profile.estimate(
                        batch, mode="generate", seq_len=prompt, new_tokens=tokens
                    )
                    estimate_s = time.perf_counter() - t0
                    got = measure(model, prompts(batch, prompt), mode="generate", new_tokens=tokens)
                    error = (est.peak_bytes - got.peak_bytes) / got.peak_bytes
                    rows.append(
                        {
                            "model": name,
                            "batch": batch,
                            "prompt": prompt,
                            "new_tokens": tokens,
                            "estimated": est.peak_bytes,
                            "measured": got.peak_bytes,
                            "error": error,
                            "peak": est.peak_location,
                            "kv_cache_bytes": est.kv_cache_bytes,
                            "kv_cache_bytes_per_token": est.kv_cache_bytes_per_token,
                            "profile_s": profile_s,
                            "estimate_s": estimate_s,
                        }
                    )
                    print(
                        f"{name:22s} b{batch} p{prompt:<3} T{tokens:<3} est {est.peak_bytes:>13,} "
                        f"real {got.peak_bytes:>13,} {error:+.4%}  {est.peak_location}",
                        flush=True,
                    )
    lines = [
        "| model | settings | worst error | median error | KV cache per token | peak at |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in MODELS:
        mine = [r for r in rows if r["model"] == name]
        errors = sorted(abs(r["error"]) for r in mine)
        per_token = sorted({r["kv_cache_bytes_per_token"] for r in mine})
        where = sorted({"prefill" if r["peak"].endswith("prefill") else "decode" for r in mine})
        lines.append(
            f"| {name} | {len(mine)} | {errors[-1]:.4%} | {errors[len(errors) // 2]:.4%} | "
            f"{' / '.join(f'{p:,} B' for p in per_token)} | {', '.join(where)} |"
        )
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"\nAll {len(rows)} settings: worst {worst:.4%} (target <= 2 %).")
    write_results("accuracy_generate", rows, "\n".join(lines), started)


if __name__ == "__main__":
    main()
