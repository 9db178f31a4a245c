"""Per-GPU memory under ZeRO-2 / ZeRO-3: DeepSpeed's own estimator functions beside ours.

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs`` (``deepspeed/runtime/zero/stage_1_and_2.py``,
``stage3.py``; pure Python, no GPU) count model states only, for DeepSpeed's own recipe:
fp16 parameters (2 bytes each, whole on every GPU under ZeRO-2), and per GPU 18 bytes per
parameter over the GPUs (fp16 and fp32 gradients, fp32 master weights, Adam's two states),
plus under ZeRO-3 4 bytes per parameter of the largest layer. Ours is one rank's step of
FSDP2 (``estimate(..., gpus=N, strategy="zero2"|"zero3")``) for the recipe it models:
fp32 parameters, gradients and AdamW state sharded over the ranks, bf16 autocast compute
(``precision="amp-bf16"``) with FSDP2's ``MixedPrecisionPolicy`` (units gathered in bf16,
gradients reduced in fp32), from one profile of the model on the meta device.

Model: Hugging Face ``LlamaForCausalLM`` with Llama-2-7B's config on the meta device,
batch 1 per GPU x 512 tokens, on 8 and 64 GPUs (8 per node). Nothing here is measured on a
GPU: both sides are estimates; where they differ, the rows say why.

    pip install -e ".[bench]"            # DeepSpeed and what its estimators import
    python benchmarks/deepspeed_states.py

Writes results/deepspeed_states.json and prints the markdown table
(benchmarks/report.py writes it into docs/guides/multi-gpu.md).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

os.environ.setdefault("DS_BUILD_OPS", "0")

import torch
import transformers
from _results import write_results

from vram_widget import profile_model

GPUS = (8, 64)
PER_NODE = 8
BATCH, TOKENS = 1, 512
GIB = 2**30


def deepspeed_gpu_bytes(strategy: str, total: int, largest: int, gpus: int) -> int:
    """DeepSpeed's per-GPU bytes, from its own functions (no CPU offload)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes = max(1, gpus // PER_NODE)
    per_node = min(gpus, PER_NODE)
    if strategy == "zero2":
        _cpu, gpu = estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=False
        )
        return int(gpu)
    _cpu, gpu, _largest = estimate_zero3_model_states_mem_needs(
        total, largest, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=False,
        cpu_offload_params=False,
    )  # fmt: skip
    return int(gpu)


def run() -> list[dict[str, Any]]:
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(BATCH, TOKENS, dtype=torch.long, device="meta")
    profile = profile_model(model, inputs={"input_ids": ids, "labels": ids})
    total = sum(p.numel() for p in model.parameters())
    # DeepSpeed's "largest layer": the most parameters any one module holds itself
    # (estimate_zero3_model_states_mem_needs_all_live)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    rows = []
    for strategy in ("zero2", "zero3"):
        for gpus in GPUS:
            est = profile.estimate(BATCH, "amp-bf16", "adamw", gpus=gpus, strategy=strategy)
            states = est.parameter_bytes + est.gradient_bytes + est.optimizer_state_bytes
            rows.append(
                {
                    "strategy": strategy,
                    "gpus": gpus,
                    "params": total,
                    "largest_layer_params": largest,
                    "deepspeed_gpu_bytes": deepspeed_gpu_bytes(strategy, total, largest, gpus),
                    "model_states_bytes": states,
                    "peak_bytes": est.peak_bytes,
                    "total_bytes": est.total_bytes,
                    "peak_phase": est.peak_phase.value,
                    "activation_bytes": est.activation_bytes,
                }
            )
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | GPUs | DeepSpeed's estimator (model states, its fp16 recipe) | ours: "
        "model states (fp32 shards) | ours: the rank's peak | ours: + CUDA context, cuBLAS, "
        "rounding |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['gpus']} | {r['deepspeed_gpu_bytes'] / GIB:.2f} GiB | "
            f"{r['model_states_bytes'] / GIB:.2f} GiB | {r['peak_bytes'] / GIB:.2f} GiB "
            f"({r['peak_phase']}) | {r['total_bytes'] / GIB:.2f} GiB |"
        )
    return "\n".join(lines)


def main() -> None:
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    rows = run()
    write_results("deepspeed_states", rows, summarize(rows), started)


if __name__ == "__main__":
    main()
