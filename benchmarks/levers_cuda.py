"""The activation levers on a real CUDA GPU: the estimate beside ``measure()`` of the step.

A GPT-2 small (SDPA) and a small grouped-query Llama, bf16, AdamW, at batch 4 x 512 tokens:
plain, the chunked output and loss (``loss_chunks=8``, torchtune's loss), the checkpoint
policies (``"full"``, torchtitan's ``"op"``, every 2nd block) and activation offloading
(``save_on_cpu`` and torchtune's ``OffloadActivations``), and offloading paired with the
chunked loss and with checkpointing. The estimate comes from one
``profile_model(device="cuda")`` of the plain model at the GPU's compute capability; the
measured figure is ``torch.cuda.max_memory_allocated()`` over the second of two steps.

    python3 benchmarks/levers_cuda.py --out benchmarks/results/levers_cuda.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vram_widget import profile_model
from vram_widget._profiling.measure import measure

LEVERS: dict[str, dict[str, Any]] = {
    "plain": {},
    "loss_chunks=8": {"loss_chunks": 8},
    "checkpoint full": {"checkpoint": "auto"},
    "checkpoint op": {"checkpoint": "auto", "checkpoint_policy": "op"},
    "checkpoint every 2": {"checkpoint": "auto", "checkpoint_policy": 2},
    "offload save_on_cpu": {"offload_activations": "save_on_cpu"},
    "offload torchtune": {"offload_activations": "torchtune"},
    # pairs: offloading with the other activation levers, checked only where CUDA runs it
    "offload torchtune + loss_chunks=8": {"offload_activations": "torchtune", "loss_chunks": 8},
    "offload torchtune + checkpoint op": {
        "offload_activations": "torchtune",
        "checkpoint": "auto",
        "checkpoint_policy": "op",
    },
    "offload save_on_cpu + checkpoint full": {
        "offload_activations": "save_on_cpu",
        "checkpoint": "auto",
    },
}


def _models() -> dict[str, torch.nn.Module]:
    import transformers

    gpt2 = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12)
    llama = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
    )  # fmt: skip
    models = {}
    for name, config, cls in (
        ("gpt2", gpt2, transformers.GPT2LMHeadModel),
        ("llama", llama, transformers.LlamaForCausalLM),
    ):
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        models[name] = cls(config)
    return models


def _tokens(batch: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32000, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "levers_cuda.json")
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(LEVERS),
        help="measure only this lever (repeatable); its rows replace those in --out",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda", 0)
    capability = torch.cuda.get_device_capability(device)
    info = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    rows: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    out = Path(args.out)
    if args.only and out.exists():  # keep the other levers' rows, measured before
        kept = [r for r in json.loads(out.read_text())["rows"] if r["lever"] not in args.only]
    batch = _tokens(4, 512)
    for name, model in _models().items():
        with torch.device("meta"):
            meta = type(model)(model.config)
        profile = profile_model(meta, inputs=_tokens(2, 128), device="cuda", precisions=())
        model.to(device)
        for lever, settings in LEVERS.items():
            if args.only and lever not in args.only:
                continue
            row: dict[str, Any] = {"model": name, "lever": lever}
            try:
                est = profile.estimate(
                    4, "bf16", "adamw", seq_len=512, compute_capability=capability, **settings
                )
                row["estimated_bytes"] = est.peak_bytes
                row["host_bytes"] = est.host_bytes
                real = measure(
                    model,
                    {k: v.to(device) for k, v in batch.items()},
                    optimizer="adamw",
                    precision="bf16",
                    **settings,
                )
                row["measured_bytes"] = real.peak_bytes
                row["ratio"] = est.peak_bytes / real.peak_bytes
                # the caching allocator's charge (whole blocks), what max_memory_allocated reads
                row["estimated_allocated_bytes"] = est.allocated_bytes
                if est.allocated_bytes is not None:
                    row["allocated_ratio"] = est.allocated_bytes / real.peak_bytes
            except Exception as exc:  # one lever's failure is recorded, the rest go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:600]
                row["traceback"] = traceback.format_exc()[-1500:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            _write(Path(args.out), info, rows, kept)  # kept as it goes
            torch.cuda.empty_cache()
        model.cpu()


def _write(
    out: Path, info: dict[str, Any], rows: list[dict[str, Any]], kept: list[dict[str, Any]]
) -> None:
    """The rows measured so far, with ``kept`` (the other levers' rows, measured before)."""
    order = list(LEVERS)
    every = sorted(kept + rows, key=lambda r: (r["model"], order.index(r["lever"])))
    out.write_text(json.dumps({**info, "rows": every}, indent=1))


if __name__ == "__main__":
    main()
