"""Accuracy across the sequence length: one profile per model at 16 tokens, estimated
(``device="cpu"``) at other batch sizes and lengths and measured on a real CPU step.

Hugging Face GPT-2, BERT, Llama (grouped-query attention) and T5 from small configs (no
download), each with eager and SDPA attention, and a torch ``nn.TransformerEncoder`` behind a
token embedding. Each model is profiled once at batch 2 x 16 tokens; every (batch, length)
below is ``profile.estimate(batch, seq_len=length)``: numpy over the fit in the length where
memory is a polynomial in it, a profile at that length where it is not (CPU kernel
workspaces, which the probes measure per shape).

    python benchmarks/accuracy_seq.py            # about 5 minutes on 2 cores

Targets: train median <= 0.1 %, worst <= 2 %; inference worst
<= 5 %. Writes results/accuracy_seq.json and prints a markdown
summary (benchmarks/report.py writes it into docs/).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch
import transformers
from _results import write_results
from torch import nn

from vram_widget import profile_model
from vram_widget._profiling.measure import measure

BATCHES = (1, 3, 8)
LENGTHS = (17, 64, 200, 512)
VOCAB = 1000
POSITIONS = 1024  # learned position tables longer than the longest length


def _tokens(batch: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, seq), generator=gen)}


def _classify(batch: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 1000 + seq)
    return {
        "input_ids": torch.randint(0, VOCAB, (batch, seq), generator=gen),
        "labels": torch.randint(0, 3, (batch,), generator=gen),
    }


def _hf(kind: str, attention: str) -> nn.Module:
    small = {"vocab_size": VOCAB, "attn_implementation": attention}
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=POSITIONS, bos_token_id=0,
            eos_token_id=0, **small,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if kind == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=POSITIONS, num_labels=3, **small,
        )  # fmt: skip
        return transformers.BertForSequenceClassification(config)
    if kind == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, bos_token_id=0, eos_token_id=0, **small,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.T5Config(
        num_layers=2, d_model=64, num_heads=4, d_ff=128, d_kv=16,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **small,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


class TokenEncoder(nn.Module):
    """A torch ``nn.TransformerEncoder`` behind a token embedding, mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(input_ids)).mean(dim=1))


def _ids(batch: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 1000 + seq)
    return {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=gen)}


Case = tuple[str, Callable[[], nn.Module], Callable[[int, int], dict[str, torch.Tensor]]]


def cases() -> list[Case]:
    out: list[Case] = []
    for kind, make in (("gpt2", _tokens), ("bert", _classify), ("llama", _tokens),
                       ("t5", _tokens)):  # fmt: skip
        for attention in ("eager", "sdpa"):
            out.append((f"{kind}-{attention}", lambda k=kind, a=attention: _hf(k, a), make))
    out.append(("transformer_encoder", TokenEncoder, _ids))
    return out


def run() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, build, make in cases():
        torch.manual_seed(0)
        model = build()
        t0 = time.perf_counter()
        profile = profile_model(model, inputs=make(2, 16), device="cpu")
        profile_s = time.perf_counter() - t0
        assert profile.has_seq_axis, name
        for seq in LENGTHS:
            for batch in BATCHES:
                inputs = make(batch, seq)
                for optimizer, mode in (("adam", "train"), (None, "inference")):
                    t1 = time.perf_counter()
                    est = profile.estimate(batch, "fp32", optimizer, mode, seq_len=seq)
                    estimate_ms = (time.perf_counter() - t1) * 1e3
                    real = measure(model, inputs, optimizer=optimizer, mode=mode)
                    err = (est.peak_bytes - real.peak_bytes) / real.peak_bytes * 100
                    rows.append(
                        {
                            "model": name,
                            "batch": batch,
                            "seq_len": seq,
                            "mode": mode,
                            "estimated": est.peak_bytes,
                            "measured": real.peak_bytes,
                            "error_pct": err,
                            "profile_s": profile_s,
                            "estimate_ms": estimate_ms,
                        }
                    )
                    print(
                        f"{name:20s} B={batch} S={seq:<4d} {mode:9s} est={est.peak_bytes:>13,} "
                        f"meas={real.peak_bytes:>13,} err={err:+7.3f}% ({estimate_ms:.1f} ms)",
                        flush=True,
                    )
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | train median | train worst | inference worst |",
        "|---|---:|---:|---:|",
    ]
    for name in dict.fromkeys(r["model"] for r in rows):
        train = [abs(r["error_pct"]) for r in rows if r["model"] == name and r["mode"] == "train"]
        infer = [abs(r["error_pct"]) for r in rows if r["model"] == name and r["mode"] != "train"]
        lines.append(
            f"| {name} | {statistics.median(train):.3f} % | {max(train):.3f} % | "
            f"{max(infer):.3f} % |"
        )
    train = [abs(r["error_pct"]) for r in rows if r["mode"] == "train"]
    infer = [abs(r["error_pct"]) for r in rows if r["mode"] != "train"]
    lines.append(
        f"| **all** ({len(rows)} configurations) | {statistics.median(train):.3f} % | "
        f"{max(train):.3f} % | {max(infer):.3f} % |"
    )
    return "\n".join(lines)


def main() -> None:
    started = time.perf_counter()
    rows = run()
    write_results("accuracy_seq", rows, summarize(rows), started)
    sys.exit(0)


if __name__ == "__main__":
    main()
