"""On a real CUDA GPU: the estimate's allocated, reserved and device figures against the step.

For each setting the plain model is profiled (``profile_model(device="cuda")``) and estimated
at the GPU's compute capability; the same step then runs for real on the GPU, as a training
loop writes it (the model moved to the device, the batch, the optimizer, two iterations of
forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``, the peaks of
the second), from an empty caching allocator (cuBLAS workspaces cleared). Recorded:

* allocated: ``torch.cuda.max_memory_allocated()`` against ``est.peak_bytes`` plus the cuBLAS
  workspace of the extras (the estimate keeps the workspace apart from the step's peak);
* reserved: ``torch.cuda.max_memory_reserved()`` against the replayed allocator's
  ``est.allocator.peak_reserved_bytes`` (which includes the workspace);
* the CUDA context: ``cudaMemGetInfo``'s used memory less ``memory_reserved()`` after the
  step, against ``est.extras.cuda_context_bytes``;
* the out-of-memory line, for some settings: the least cap on what the allocator may reserve
  (``torch.cuda.set_per_process_memory_fraction``) under which the real loop runs, found by
  bisection in 2 MiB steps, against ``est.device_bytes`` less the estimated context;
* ``measure()``'s own figures of the same setting.

    python benchmarks/accuracy_cuda.py --out benchmarks/results/accuracy_cuda.json

Needs a CUDA device; prints one line per setting and writes every figure to the JSON.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VRAM_WIDGET_CACHE", "0")  # every profile made here, in this process

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vram_widget import profile_model, zoo
from vram_widget._profiling.measure import measure

MIB = 1 << 20
STEP = 2 * MIB  # the allocator's large-segment rounding (kRoundLarge), the cap's step


def _gpt2(n_layer: int = 12) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(n_layer=n_layer, n_embd=768, n_head=12)
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config)


def _llama() -> torch.nn.Module:
    import transformers

    # about 1.2 B parameters with grouped-query attention (4 key/value heads for 16)
    config = transformers.LlamaConfig(
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def _tokens(batch: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32000, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))


# name, builder, example batch for the profile (batch 2), the setting's batch maker, batch,
# precision, optimizer, mode, bisect the out-of-memory line
SETTINGS: list[tuple[str, Callable[[], torch.nn.Module], Any, Callable[[int], Any], int, str,
                     str | None, str, bool]] = [
    ("resnet50", zoo.resnet50, _images(2), _images, 32, "fp32", "adam", "train", True),
    ("resnet50", zoo.resnet50, _images(2), _images, 64, "amp-bf16", "adamw", "train", False),
    ("resnet50", zoo.resnet50, _images(2), _images, 128, "bf16", None, "inference", False),
    ("gpt2", _gpt2, _tokens(2, 128), lambda b: _tokens(b, 512), 8, "bf16", "adamw", "train",
     True),
    ("gpt2", _gpt2, _tokens(2, 128), lambda b: _tokens(b, 1024), 4, "fp32", "adamw", "train",
     False),
    ("gpt2", _gpt2, _tokens(2, 128), lambda b: _tokens(b, 1024), 16, "bf16", None, "inference",
     False),
    ("llama-1.2b", _llama, _tokens(2, 128), lambda b: _tokens(b, 2048), 2, "bf16", "adamw",
     "train", True),
]  # fmt: skip


def _clear(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def _to(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    if isinstance(batch, dict):
        return {k: one(v) for k, v in batch.items()}
    return one(batch)


def _optimizer(name: str | None, params: Any) -> torch.optim.Optimizer | None:
    if name is None:
        return None
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name](
        params, lr=1e-4
    )


def real_loop(
    model: torch.nn.Module,
    batch: Any,
    precision: str,
    optimizer: str | None,
    mode: str,
    device: torch.device,
    cap_bytes: int | None = None,
) -> dict[str, int]:
    """The step as a training loop writes it, twice, from an empty allocator; the peaks of
    the second iteration. ``model`` is on the CPU in the precision's storage dtype: it is
    moved to the device (``model.to``), and back afterwards. Raises torch.OutOfMemoryError
    under a cap it does not fit."""
    _clear(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_bytes is not None:
        # CUDACachingAllocator's setMemoryFraction: allowed = size_t(fraction * total)
        torch.cuda.set_per_process_memory_fraction((cap_bytes + 0.5) / total, device)
    storage = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = precision.startswith("amp-")
    opt = inputs = None
    try:
        model.to(device)
        model.train(mode == "train")
        inputs = _to(batch, device, storage)
        opt = _optimizer(optimizer, model.parameters()) if mode == "train" else None
        for iteration in range(2):
            if iteration == 1:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                if mode == "train":
                    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
                    loss = getattr(out, "loss", None)
                    if loss is None:
                        loss = (out if isinstance(out, torch.Tensor) else out[0]).float().mean()
                else:
                    with torch.no_grad():
                        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            if mode == "train":
                assert loss is not None
                loss.backward()
                del loss
                assert opt is not None
                opt.step()
                opt.zero_grad(set_to_none=True)
            del out
        torch.cuda.synchronize(device)
        free, total_now = torch.cuda.mem_get_info(device)
        return {
            "allocated_peak_bytes": torch.cuda.max_memory_allocated(device),
            "reserved_peak_bytes": torch.cuda.max_memory_reserved(device),
            "reserved_now_bytes": torch.cuda.memory_reserved(device),
            "device_used_now_bytes": total_now - free,
            "context_bytes": total_now - free - torch.cuda.memory_reserved(device),
        }
    finally:
        del opt, inputs
        model.zero_grad(set_to_none=True)
        model.to("cpu")
        if cap_bytes is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        _clear(device)


def least_cap(run: Callable[[int | None], Any], low: int, high: int) -> tuple[int, int]:
    """The least cap, in STEP units between low and high, under which ``run`` does not run
    out of memory (bisection); and how many runs it took."""
    lo, hi = low // STEP, -(-high // STEP)
    runs = 0
    while True:  # widen the top until it runs
        runs += 1
        try:
            run(hi * STEP)
            break
        except torch.OutOfMemoryError:
            hi += max(1, hi // 8)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        runs += 1
        try:
            run(mid * STEP)
            hi = mid
        except torch.OutOfMemoryError:
            lo = mid
    return hi * STEP, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "accuracy_cuda.json")
    )
    parser.add_argument("--only", default="", help="comma-separated model names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda", 0)
    torch.ones(1, device=device)
    props = torch.cuda.get_device_properties(device)
    capability = torch.cuda.get_device_capability(device)
    info = {
        "gpu": props.name,
        "total_memory_bytes": props.total_memory,
        "compute_capability": list(capability),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "machine": platform.machine(),
        "lazy_loading": os.environ.get("CUDA_MODULE_LOADING", "(default)"),
    }
    print(json.dumps(info), flush=True)
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    profiles: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, build, example, make, batch_size, precision, optimizer, mode, bisect in SETTINGS:
        if only and name not in only:
            continue
        row: dict[str, Any] = {
            "model": name,
            "batch_size": batch_size,
            "precision": precision,
            "optimizer": optimizer,
            "mode": mode,
        }
        try:
            batch = make(batch_size)
            seq_len = batch["input_ids"].shape[1] if isinstance(batch, dict) else None
            if name not in profiles:
                with torch.device("meta"):
                    meta_model = build()
                started = time.perf_counter()
                profiles[name] = profile_model(
                    meta_model, inputs=example, device="cuda", precisions=()
                )
                row["profile_s"] = time.perf_counter() - started
            est = profiles[name].estimate(
                batch_size,
                precision=precision,
                optimizer=optimizer,
                mode=mode,
                seq_len=seq_len,
                compute_capability=tuple(capability),
            )
            row["estimate"] = {
                "peak_bytes": est.peak_bytes,
                "cublas_workspace_bytes": est.extras.cublas_workspace_bytes,
                "reserved_peak_bytes": est.allocator.peak_reserved_bytes,
                "replay_allocated_peak_bytes": est.allocator.peak_allocated_bytes,
                "context_bytes": est.extras.cuda_context_bytes,
                "context_source": est.extras.cuda_context_source,
                "device_bytes": est.device_bytes,
                "total_bytes": est.total_bytes,
            }
            torch.manual_seed(0)
            cpu_model = build()
            storage = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
            if storage is not None:
                cpu_model.to(storage)
            real = real_loop(cpu_model, batch, precision, optimizer, mode, device)
            row["real"] = real
            e = row["estimate"]
            row["ratio_allocated"] = (e["peak_bytes"] + e["cublas_workspace_bytes"]) / real[
                "allocated_peak_bytes"
            ]
            row["ratio_reserved"] = e["reserved_peak_bytes"] / real["reserved_peak_bytes"]
            row["ratio_context"] = e["context_bytes"] / real["context_bytes"]
            if bisect:
                estimated_cap = e["device_bytes"] - e["context_bytes"]
                cap, runs = least_cap(
                    functools.partial(
                        real_loop, cpu_model, batch, precision, optimizer, mode, device
                    ),
                    min(estimated_cap, real["allocated_peak_bytes"]) - 8 * STEP,
                    real["reserved_peak_bytes"] + STEP,
                )
                row["least_cap_bytes"] = cap
                row["estimated_cap_bytes"] = estimated_cap
                row["bisection_runs"] = runs
                row["ratio_cap"] = estimated_cap / cap
            model = cpu_model.to(device)  # measure() runs a copy of it on its device
            _clear(device)
            m = measure(
                model, _to(batch, device, None), optimizer=optimizer, precision=precision, mode=mode
            )
            row["measure"] = {
                "peak_bytes": m.peak_bytes,
                "max_reserved_bytes": m.max_reserved_bytes,
                "resident_bytes": m.resident_bytes,
            }
            row["ratio_measure_peak"] = e["peak_bytes"] / m.peak_bytes
            del model, cpu_model
            _clear(device)
        except Exception as exc:  # one setting's failure is recorded, the rest go on
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()[-3000:]
        rows.append(row)
        print(
            json.dumps({k: v for k, v in row.items() if k != "traceback"}, default=str),
            flush=True,
        )
        out.write_text(json.dumps({**info, "rows": rows}, indent=1, default=str))
    print(f"{len(rows)} settings in {time.perf_counter() - t0:.0f} s; rows in {out}")


if __name__ == "__main__":
    main()
