"""Activation offloading on a GPU: ``measure()`` of the real hooks (torchtune's
``OffloadActivations`` with its ``NoOpManager`` on the output projection, torch's
``save_on_cpu``) beside the estimate, on a small MLP and a small Hugging Face Llama.

Run on a CUDA machine: ``python3 benchmarks/offload_cuda.py``; prints one line per setting:
estimated and measured allocated peaks, and the estimate's host bytes."""

from __future__ import annotations

import sys

import torch
from torch import nn

from vram_widget import profile_model
from vram_widget._profiling.measure import measure


def _mlp() -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(4):
        blocks += [nn.Linear(64, 64, bias=False), nn.ReLU()]
    return nn.Sequential(*blocks)


def _sum(y: torch.Tensor) -> torch.Tensor:
    return y.sum()


def _llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=256, intermediate_size=688, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
    )  # fmt: skip
    ids = torch.randint(0, 1000, (8, 256), generator=torch.Generator().manual_seed(0))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def main() -> int:
    print(torch.__version__, torch.cuda.get_device_name(0))
    torch.manual_seed(0)
    cases = [("mlp", _mlp(), torch.randn(256, 64), _sum, "fp32", None)]
    model, batch = _llama()
    cases.append(("llama", model, batch, None, "amp-bf16", "adamw"))
    for name, model, inputs, loss_fn, precision, optimizer in cases:
        profile = profile_model(model, inputs=inputs, loss_fn=loss_fn, device="cuda")
        size = next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else 256
        for offload in (None, "save_on_cpu", "torchtune"):
            est = profile.estimate(
                size, precision=precision, optimizer=optimizer, offload_activations=offload
            )
            got = measure(
                model.cuda(),
                {k: v.cuda() for k, v in inputs.items()} if isinstance(inputs, dict)
                else inputs.cuda(),
                loss_fn=loss_fn, precision=precision, optimizer=optimizer,
                offload_activations=offload,
            )  # fmt: skip
            print(
                f"{name:6} {offload or 'none':12} estimated {est.peak_bytes:>12,} "
                f"measured {got.peak_bytes:>12,} diff {est.peak_bytes - got.peak_bytes:>+10,} "
                f"host {est.host_bytes:>12,}",
                flush=True,
            )
            model.cpu()
    return 0


if __name__ == "__main__":
    sys.exit(main())
