"""Quantized weights and float8 training on a real CUDA GPU: ``measure()`` beside the estimate.

The GPT-2 small (SDPA) and the small grouped-query Llama of ``levers_cuda.py``, bf16:

* bitsandbytes' weights, applied as ``from_pretrained(quantization_config=
  BitsAndBytesConfig(...))`` applies them (``weights=``): inference of 4 x 512 and of
  1 x 512 tokens with nf4 and double quantization (QLoRA's settings), fp4, and int8 at
  outlier threshold 0; greedy generation of 32 tokens after a 4 x 128 prompt, nf4 (each
  decoding step's matmul has one row per sequence); QLoRA training (PEFT, rank 16, AdamW
  over the adapters) of 4 x 512 tokens;
* torchao's float8 training (``measure(float8=...)``: ``convert_to_float8_training``,
  tensorwise scaling, its default, and rowwise; every ``nn.Linear``, or only those whose
  dimensions are multiples of 16), AdamW, 4 x 512 tokens, eager.

Two halves, so that the GPU only measures:

* ``--measure`` (needs a GPU): the allocated peak, ``torch.cuda.max_memory_allocated()``
  over the second of two steps (for generation, over the whole ``generate`` call);
* ``--estimate`` (any machine): the estimate of each measured row from one
  ``profile_model(device="cuda")`` of the plain model built on the meta device, at the
  measured GPU's compute capability, written beside it with the ratio.

    python3 benchmarks/quantized_cuda.py --measure    # on the GPU
    python3 benchmarks/quantized_cuda.py --estimate   # anywhere, after
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from levers_cuda import _models, _tokens

from vram_widget import Float8, Weights, profile_model
from vram_widget._profiling.measure import measure

NF4 = Weights("nf4", double_quant=True, compute_dtype="bf16")  # QLoRA's settings
FP4 = Weights("fp4", compute_dtype="bf16")
INT8 = Weights("int8", int8_threshold=0.0)

# name: (the keywords of estimate and measure, batch, tokens)
SETTINGS: dict[str, tuple[dict[str, Any], int, int]] = {
    # the same step with the precision's own weights, to compare the quantized rows with
    "bf16 inference 4x512": ({"mode": "inference"}, 4, 512),
    "nf4 inference 4x512": ({"mode": "inference", "weights": NF4}, 4, 512),
    "nf4 inference 1x512": ({"mode": "inference", "weights": NF4}, 1, 512),
    "fp4 inference 4x512": ({"mode": "inference", "weights": FP4}, 4, 512),
    "int8 inference 4x512": ({"mode": "inference", "weights": INT8}, 4, 512),
    "nf4 generate 4x128+32": ({"mode": "generate", "weights": NF4, "new_tokens": 32}, 4, 128),
    "nf4 generate 1x128+32": ({"mode": "generate", "weights": NF4, "new_tokens": 32}, 1, 128),
    "int8 threshold 6.0 inference 4x512": (
        {"mode": "inference", "weights": Weights("int8", int8_threshold=6.0)},
        4,
        512,
    ),
    "qlora train 4x512": ({"optimizer": "adamw", "weights": NF4, "lora_rank": 16}, 4, 512),
    "float8 tensorwise train 4x512": ({"optimizer": "adamw", "float8": "tensorwise"}, 4, 512),
    "float8 rowwise train 4x512": ({"optimizer": "adamw", "float8": "rowwise"}, 4, 512),
    "float8 tensorwise, dims of 16, train 4x512": (
        {"optimizer": "adamw", "float8": "tensorwise"},
        4,
        512,
    ),
}
# float8 settings whose copy skips the Linear layers with a dimension not divisible by 16, as
# torchtitan's float8 converter filters them (torchao's default filter converts every
# nn.Linear, and torch._scaled_mm refuses such a layer on the GPU)
DIMS_OF_16 = {"float8 tensorwise, dims of 16, train 4x512"}


def _inputs(kwargs: dict[str, Any], batch: int, tokens: int) -> dict[str, torch.Tensor]:
    inputs = _tokens(batch, tokens)
    if kwargs.get("mode") in ("inference", "generate"):
        return {"input_ids": inputs["input_ids"]}
    return inputs


def _settings(setting: str, model: torch.nn.Module) -> dict[str, Any]:
    """The keywords of ``estimate`` and ``measure`` for ``setting`` on ``model``: the
    float8 settings in :data:`DIMS_OF_16` keep in high precision the ``nn.Linear`` layers
    with a dimension that is not a multiple of 16 (by name: ``Float8.filter_fqns``)."""
    kwargs = dict(SETTINGS[setting][0])
    if setting in DIMS_OF_16:
        kept = tuple(
            name
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and any(d % 16 for d in module.weight.shape)
        )
        kwargs["float8"] = Float8(kwargs["float8"], filter_fqns=kept)
    return kwargs


def _measure(out: Path, only: list[str] | None) -> None:
    device = torch.device("cuda", 0)
    import bitsandbytes

    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "compute_capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except ImportError as exc:
        info["torchao"] = f"not importable: {exc}"
    rows: list[dict[str, Any]] = []
    if only and out.exists():  # the other settings' rows, measured before, are kept
        rows = [r for r in json.loads(out.read_text())["rows"] if r["setting"] not in only]
    for name, model in _models().items():
        model.to(device)
        for setting, (kwargs, batch, tokens) in SETTINGS.items():
            if only and setting not in only:
                continue
            row: dict[str, Any] = {"model": name, "setting": setting}
            inputs = {k: v.to(device) for k, v in _inputs(kwargs, batch, tokens).items()}
            try:
                real = measure(model, inputs, precision="bf16", **_settings(setting, model))
                row["measured_bytes"] = real.peak_bytes
            except Exception as exc:  # one setting's failure is recorded, the rest go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:600]
                row["traceback"] = traceback.format_exc()[-1500:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
            order = list(SETTINGS)
            rows.sort(key=lambda r: (r["model"], order.index(r["setting"])))
            out.write_text(json.dumps({**info, "rows": rows}, indent=1))  # kept as it goes
            torch.cuda.empty_cache()
        model.cpu()


def _estimate(out: Path) -> None:
    data = json.loads(out.read_text())
    capability = tuple(data["compute_capability"])
    for name, model in _models().items():
        with torch.device("meta"):
            meta = type(model)(model.config)
        # profiled with the inputs the measured step had: the prompt alone for inference
        # and generation, with labels (the model's own loss) for training
        profiles = {
            labels: profile_model(
                meta, inputs=_inputs({} if labels else {"mode": "inference"}, 2, 128),
                device="cuda", precisions=(),
            )
            for labels in (False, True)
        }  # fmt: skip
        for row in data["rows"]:
            if row["model"] != name or "measured_bytes" not in row:
                continue
            kwargs, batch, tokens = SETTINGS[row["setting"]]
            kwargs = _settings(row["setting"], meta)
            profile = profiles[kwargs.get("mode") not in ("inference", "generate")]
            for key in (
                "estimated_bytes",
                "ratio",
                "estimate_error",
                "estimated_allocated_bytes",
                "allocated_ratio",
            ):
                row.pop(key, None)
            try:
                est = profile.estimate(
                    batch, "bf16", seq_len=tokens, compute_capability=capability, **kwargs
                )
                row["estimated_bytes"] = est.peak_bytes
                row["ratio"] = est.peak_bytes / row["measured_bytes"]
                # the caching allocator's charge (whole blocks), what max_memory_allocated reads
                row["estimated_allocated_bytes"] = est.allocated_bytes
                if est.allocated_bytes is not None:
                    row["allocated_ratio"] = est.allocated_bytes / row["measured_bytes"]
            except Exception as exc:  # not estimated (yet): said in the row
                row["estimate_error"] = f"{type(exc).__name__}: {exc}"[:600]
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    out.write_text(json.dumps(data, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "quantized_cuda.json")
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--measure", action="store_true", help="measure on the GPU")
    which.add_argument("--estimate", action="store_true", help="estimate the measured rows")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SETTINGS),
        help="measure only this setting (repeatable); its rows replace those in --out",
    )
    args = parser.parse_args()
    out = Path(args.out)
    if args.measure:
        if not torch.cuda.is_available():
            parser.error("--measure needs a CUDA device")
        _measure(out, args.only)
    else:
        if not out.exists():
            parser.error(f"--estimate reads the measured rows of {out}: run --measure first")
        _estimate(out)


if __name__ == "__main__":
    main()
