"""Quantized weights, float8 training and the quantized KV cache: the estimate from the
*plain* model's profile (``device="cpu"``) against ``measure()`` of the real libraries' step
on the CPU.

Truth, per format (``measure(weights=...)`` / ``measure(float8=...)`` applies each by the
library that implements it, on a copy of the model):

* bitsandbytes, as ``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` applies
  it: ``nf4`` (bf16 compute), ``nf4-dq`` (with double quantization: QLoRA's settings),
  ``fp4`` (``BitsAndBytesConfig``'s defaults), ``int8`` at outlier threshold 0 and
  ``int8-t6`` at its default 6.0 (the estimate assumes that no input column reaches the
  threshold, and says so on the estimate: those rows are summed apart);
* torchao's ``quantize_``: ``int8-torchao`` (``Int8WeightOnlyConfig``) and ``int4-torchao``
  (int4 weight-only, ``Int4OpaqueTensor`` on the CPU);
* ``nf4-torchao``: torchao's ``NF4Tensor`` in torchtune's ``LoRALinear`` /
  ``FrozenNF4Linear`` (torchtune's QLoRA);
* torchao's float8 training with emulation on the CPU (``convert_to_float8_training``,
  ``float8-tensorwise`` / ``float8-rowwise``);
* transformers' quantized KV cache in generation (``QuantizedCache``, optimum-quanto's
  backend, the flat keywords ``kv_cache="quantized"``, ``kv_bits``, ``residual_length``):
  ``kv-quanto-4`` (4 bits, transformers' default residual of 128 tokens) and ``kv-quanto-2``
  (2 bits, a residual of 8 tokens that the 8 new tokens fill to its last one before the
  flush), the model's weights in the precision's dtype; ``measure`` generates with the same
  ``cache_config``;
* training with a quantized base is PEFT's QLoRA (``prepare_model_for_kbit_training``,
  ``get_peft_model``, LoRA rank 8) for bitsandbytes' formats and torchtune's ``LoRALinear``
  for ``nf4-torchao``; AdamW over the adapters (float8: over every parameter).

Models: the Hugging Face GPT-2, Llama and Mistral (sliding window of 24) tiny configs of
``_hf.py`` (16-token profile; prompts of 16 and 40 tokens, 8 new tokens) and the zoo MLP;
each format with the settings its tests use where the defaults do not apply (torchao's int4
in groups of 32, torchao's NF4 with scaler blocks of 32 on the Llama shape, the MLP's layers
that its block rule or float8's multiples of 16 refuse kept in high precision). Settings:
training (LoRA or float8), inference and generation, batch 1 and 4, bf16. A pair the
estimate refuses (GPT-2's Conv1D is no ``nn.Linear`` for torchao, int8 training, torchao's
weights in generation, float8 inference, ...) is listed with the refusal's message.

Each measured row: the estimated and measured peak (allocated bytes on the CPU), their
ratio; the resident bytes (weights with their quant state, buffers, inputs, optimizer
state) estimated and measured; and the quantized layers' storage: ``quantized_bytes`` (the
stored layout the estimate assumes) over the layers the profile quantizes, against the
tensors of a copy quantized by the real library, layer by layer.

    python benchmarks/accuracy_quantized.py                 # the full grid
    python benchmarks/accuracy_quantized.py --quick         # Llama, batch 1, 16 tokens
    python benchmarks/accuracy_quantized.py --only int8 --only nf4-torchao

Targets: median |ratio - 1| <= 0.1 %, worst <= 1 %; storage to the byte. Writes
results/accuracy_quantized.json (``--only``: those formats' rows replaced, the others kept)
and prints a markdown summary (benchmarks/report.py writes it into docs/accuracy.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import _hf
import torch
from _results import RESULTS, write_results
from torch import nn

from vram_widget import Float8, ModelProfile, Recipe, Weights, profile_model, zoo
from vram_widget._estimating.quantized import quantized_bytes
from vram_widget._profiling.measure import measure
from vram_widget._profiling.nf4_torchao import nf4_layers, real_nf4
from vram_widget._profiling.quantized import (
    is_quantized_param,
    quantized_modules,
    real_quantized,
    state_tensors,
)
from vram_widget._profiling.torchao_weights import real_torchao, torchao_inner, torchao_modules

NAME = "accuracy_quantized"
BATCHES = (1, 4)
LENGTHS = (16, 40)  # prompt / sequence tokens: the profile's 16, and 40 through the length axis
NEW_TOKENS = 8
LORA_RANK = 8
PRECISIONS = ("bf16",)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _hf.gpt2,
    "llama": _hf.llama,
    "mistral": _hf.mistral,
    "mlp": zoo.mlp,
}
SETTINGS = ("train", "inference", "generate")
# what a format's estimate assumes beyond the library's own step
NO_OUTLIERS = "assumes no outlier column (llm_int8_threshold=6.0)"


def _nf4_torchao(model: str) -> Weights:
    if model == "mlp":  # 784 x 512 and 10 x 512 are no multiple of 64 x 256 (to_nf4's rule)
        return Weights("nf4-torchao", skip_modules=("0", "6"))
    # the tiny Llama shape's k_proj is 32 x 64 = 2,048 weights: scaler blocks of 32
    return Weights("nf4-torchao", scaler_blocksize=32)


def _int4_torchao(model: str) -> Weights:
    if model == "mlp":  # layer 6's 10 outputs: torch's CPU int4 packing needs N % 16 == 0
        return Weights("int4-torchao", skip_modules=("6",))
    return Weights("int4-torchao", group_size=32)  # 64 inputs: groups of 128 divide none


def _float8(recipe: str) -> Callable[[str], Float8]:
    def make(model: str) -> Float8:
        # layers with a dimension that is no multiple of 16 kept in high precision, as
        # torchtitan's filter_fqns does: the MLP's 10 outputs, the 1,000-word output layer.
        # GPT-2's one nn.Linear is its output layer: left to the refusal
        kept = {"mlp": ("6",), "llama": ("lm_head",), "mistral": ("lm_head",)}
        return Float8(recipe, filter_fqns=kept.get(model, ()))

    return make


# the quantized KV cache's rows (generation only): estimate's flat keywords, which measure
# takes as a Recipe's Generation
KV_CACHES: dict[str, dict[str, Any]] = {
    "kv-quanto-4": {"kv_cache": "quantized", "kv_bits": 4},
    "kv-quanto-2": {"kv_cache": "quantized", "kv_bits": 2, "residual_length": NEW_TOKENS},
}

# format -> its setting on each model
FORMATS: dict[str, Callable[[str], Weights | Float8]] = {
    "nf4": lambda m: Weights("nf4", compute_dtype="bf16"),
    "nf4-dq": lambda m: Weights("nf4", double_quant=True, compute_dtype="bf16"),
    "fp4": lambda m: Weights("fp4"),
    "int8": lambda m: Weights("int8", int8_threshold=0.0),
    "int8-t6": lambda m: Weights("int8"),
    "int8-torchao": lambda m: Weights("int8-torchao"),
    "int4-torchao": _int4_torchao,
    "nf4-torchao": _nf4_torchao,
    "float8-tensorwise": _float8("tensorwise"),
    "float8-rowwise": _float8("rowwise"),
}

ALL_FORMATS: list[str] = [*FORMATS, *KV_CACHES]


def _inputs(model: str, setting: str, batch: int, tokens: int | None) -> Any:
    if model == "mlp":
        return torch.randn(batch, 784, generator=torch.Generator().manual_seed(batch))
    assert tokens is not None
    gen = torch.Generator().manual_seed(batch * 1000 + tokens)
    ids = torch.randint(0, _hf.VOCAB, (batch, tokens), generator=gen)
    if setting == "train":
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids}


def _lora_targets(model: str, fmt: str) -> object:
    if model != "mlp":
        return "auto"  # PEFT's (torchtune's for nf4-torchao) defaults: q_proj, v_proj / c_attn
    # torchtune's LoRALinear takes the unquantized layers too; PEFT's on the quantized ones
    return ["0", "3", "6"] if fmt == "nf4-torchao" else ["0", "3"]


def _keywords(model: str, fmt: str, setting: str) -> dict[str, Any]:
    """The keywords ``estimate`` and ``measure`` share for one format and setting."""
    if fmt in KV_CACHES:
        return {"mode": setting, "new_tokens": NEW_TOKENS, **KV_CACHES[fmt]}
    obj = FORMATS[fmt](model)
    kw: dict[str, Any] = {"float8": obj} if isinstance(obj, Float8) else {"weights": obj}
    if setting == "train":
        kw["optimizer"] = "adamw"
        if "weights" in kw:
            kw.update(lora_rank=LORA_RANK, lora_targets=_lora_targets(model, fmt))
    else:
        kw["mode"] = setting
        if setting == "generate":
            kw["new_tokens"] = NEW_TOKENS
    return kw


def _storages(tensors: list[torch.Tensor]) -> int:
    """The bytes of the distinct storages under ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def real_storage(model: nn.Module, weights: Weights, precision: str) -> dict[str, int]:
    """Each quantized layer's weight storage, by name, in a copy of ``model`` in the
    precision's dtype quantized by the real library (bitsandbytes' ``Params4bit`` /
    ``Int8Params`` with their quant state, torchao's tensor subclasses' inner tensors)."""
    clone = copy.deepcopy(model).to(DTYPES[precision]).eval()
    if weights.format is not None and weights.format.value == "nf4-torchao":
        clone = real_nf4(clone, weights, None, None, None)
    elif weights.torchao:
        clone = real_torchao(clone, weights)
    else:
        clone = real_quantized(clone, weights)
    found: dict[str, int] = {}
    for name, module in clone.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if is_quantized_param(weight):
            found[name] = _storages([weight, *state_tensors(weight)])
        elif (inner := torchao_inner(weight)) is not None:
            found[name] = _storages(inner)
    return found


def estimated_storage(model: nn.Module, weights: Weights, precision: str) -> dict[str, int]:
    """Each quantized layer's storage as the estimate lays it out: ``quantized_bytes`` of its
    weight's shape over the layers the profiling stage quantizes (the names the estimate and
    ``measure`` both take)."""
    fmt = weights.format.value if weights.format is not None else ""
    if fmt == "nf4-torchao":
        names = [n for n, (_lora, nf4) in nf4_layers(model, weights, None, None).items() if nf4]
    elif weights.torchao:
        names = torchao_modules(model, weights)
    else:
        names = quantized_modules(model, weights)
    itemsize = torch.empty((), dtype=DTYPES[precision]).element_size()
    found = {}
    for name in names:
        module = model.get_submodule(name)
        shape = tuple(module.get_parameter("weight").shape)
        if type(module).__name__ == "Conv1D":  # transformers' Conv1D holds (in, out)
            shape = shape[::-1]
        found[name] = quantized_bytes(shape, weights, itemsize).total_bytes
    return found


def _profiles(name: str, model: nn.Module) -> dict[str, ModelProfile]:
    """The plain model's profiles: with labels (the model's own loss) for training, the
    prompt alone for inference and generation (the zoo MLP: one profile)."""
    if name == "mlp":
        p = profile_model(model, input_size=(784,), device="cpu")
        return {"train": p, "prompt": p}
    return {
        "train": profile_model(model, inputs=_inputs(name, "train", 2, 16), device="cpu"),
        "prompt": profile_model(model, inputs=_inputs(name, "inference", 2, 16), device="cpu"),
    }


def run(models: list[str], formats: list[str], batches: tuple[int, ...],
        lengths: tuple[int, ...], precisions: tuple[str, ...]) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    refused: set[tuple[str, str, str, str]] = set()
    for name in models:
        torch.manual_seed(0)
        model = MODELS[name]()
        profiles = _profiles(name, model)
        settings = SETTINGS if name != "mlp" else ("train", "inference")
        storage_cache: dict[tuple[str, str], tuple[dict[str, int], dict[str, int]] | str] = {}
        for fmt in formats:
            if fmt in KV_CACHES and name == "mlp":  # a KV cache needs a model that generates
                continue
            for setting in ("generate",) if fmt in KV_CACHES else settings:
                kw = _keywords(name, fmt, setting)
                profile = profiles["train" if setting == "train" else "prompt"]
                for precision in precisions:
                    for batch in batches:
                        for tokens in lengths if name != "mlp" else (None,):
                            row = _row(name, model, profile, fmt, setting, precision, batch,
                                       tokens, kw, storage_cache)  # fmt: skip
                            if "refused" in row:
                                key = (name, fmt, setting, row["refused"])
                                if key not in refused:
                                    refused.add(key)
                                    rows.append(row)
                                    print(f"{name:8s} {fmt:18s} {setting:9s} refused: "
                                          f"{row['refused'][:100]}", flush=True)  # fmt: skip
                                continue
                            rows.append(row)
    return rows


def _row(name: str, model: nn.Module, profile: ModelProfile, fmt: str, setting: str,
         precision: str, batch: int, tokens: int | None, kw: dict[str, Any],
         storage_cache: dict[tuple[str, str], Any]) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"model": name, "format": fmt, "setting": setting}
    length: dict[str, Any] = {} if tokens is None else {"seq_len": tokens}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-outlier assumption: in est.ignored
            est = profile.estimate(batch, precision, **length, **kw)
    except (ValueError, TypeError, ImportError) as exc:
        row["refused"] = f"{type(exc).__name__}: {exc}"
        return row
    row.update(precision=precision, batch=batch, tokens=tokens)
    if setting == "generate":
        row["new_tokens"] = NEW_TOKENS
    try:
        real = _measure(model, _inputs(name, setting, batch, tokens), precision, batch, kw)
    except Exception as exc:  # one row's failure is recorded, the rest go on
        row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        row["traceback"] = traceback.format_exc()[-1500:]
        print(f"{name:8s} {fmt:18s} {setting:9s} error: {row['error'][:100]}", flush=True)
        return row
    resident = est.parameter_bytes + est.buffer_bytes + est.input_bytes
    resident += est.optimizer_state_bytes
    row.update(
        estimated_peak_bytes=est.peak_bytes,
        measured_peak_bytes=real.peak_bytes,
        ratio=est.peak_bytes / real.peak_bytes,
        error_pct=(est.peak_bytes - real.peak_bytes) / real.peak_bytes * 100,
        estimated_resident_bytes=resident,
        measured_resident_bytes=real.resident_bytes,
        resident_exact=resident == real.resident_bytes,
        peak_module=est.peak_module,
        ignored=list(est.ignored),
    )
    if any("no outlier column" in i for i in est.ignored):
        row["note"] = NO_OUTLIERS
    weights = kw.get("weights")
    if isinstance(weights, Weights):
        key = (fmt, precision)
        if key not in storage_cache:
            try:
                storage_cache[key] = (
                    estimated_storage(model, weights, precision),
                    real_storage(model, weights, precision),
                )
            except Exception as exc:  # the storage check's failure, said in the row
                storage_cache[key] = f"{type(exc).__name__}: {exc}"[:600]
        cached = storage_cache[key]
        if isinstance(cached, str):
            row["storage_error"] = cached
        else:
            by_estimate, by_library = cached
            row.update(
                estimated_storage_bytes=sum(by_estimate.values()),
                measured_storage_bytes=sum(by_library.values()),
                quantized_layers=len(by_library),
                storage_exact=by_estimate == by_library,
            )
    row["seconds"] = time.perf_counter() - start
    shape = f"B={batch}" + (f" T={tokens}" if tokens else "")
    print(
        f"{name:8s} {fmt:18s} {setting:9s} {shape:9s} est={est.peak_bytes:>12,} "
        f"meas={real.peak_bytes:>12,} err={row['error_pct']:+8.4f}% "
        f"storage={'exact' if row.get('storage_exact') else row.get('storage_exact', '-')}",
        flush=True,
    )
    return row


def _measure(model: nn.Module, inputs: Any, precision: str, batch: int,
             kw: dict[str, Any]) -> Any:  # fmt: skip
    """``measure`` of one row: the KV cache's settings as a Recipe (measure's way to them)."""
    if "kv_cache" not in kw:
        return measure(model, inputs, precision=precision, **kw)
    recipe = Recipe.from_keywords(batch_size=batch, precision=precision, **kw)
    return measure(model, inputs, recipe=recipe)


def _pct(values: list[float]) -> tuple[str, str]:
    if not values:
        return "", ""
    return f"{statistics.median(values):.4f} %", f"{max(values):.4f} %"


def summarize(rows: list[dict[str, Any]]) -> str:
    measured = [r for r in rows if "ratio" in r]
    lines = [
        "| format | settings measured | median abs(ratio - 1) | worst | resident to the byte "
        "| storage to the byte |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fmt in ALL_FORMATS:
        these = [r for r in measured if r["format"] == fmt]
        errors = [r for r in rows if r["format"] == fmt and "error" in r]
        if not these and not errors:
            continue
        median, worst = _pct([abs(r["ratio"] - 1) * 100 for r in these])
        resident = sum(r["resident_exact"] for r in these)
        stored = [r for r in these if "storage_exact" in r]
        storage = f"{sum(r['storage_exact'] for r in stored)} / {len(stored)}" if stored else "-"
        label = {"int8-t6": f"{fmt} (no outlier column assumed)"}.get(fmt, fmt)
        if fmt in KV_CACHES:
            label = f"{fmt} (KV cache, generation)"
        failed = f" (+{len(errors)} failed)" if errors else ""
        lines.append(
            f"| {label} | {len(these)}{failed} | {median} | {worst} | {resident} / "
            f"{len(these)} | {storage} |"
        )
    counted = [r for r in measured if r["format"] != "int8-t6"]
    errs = [abs(r["ratio"] - 1) * 100 for r in counted]
    median, worst = _pct(errs)
    stored = [r for r in counted if "storage_exact" in r]
    lines.append(
        f"| **all** but int8-t6 | {len(counted)} | {median} | {worst} | "
        f"{sum(r['resident_exact'] for r in counted)} / {len(counted)} | "
        f"{sum(r['storage_exact'] for r in stored)} / {len(stored)} |"
    )
    if errs:
        met = statistics.median(errs) <= 0.1 and max(errs) <= 1.0
        lines += ["", f"Targets (median <= 0.1 %, worst <= 1 %): {'met' if met else 'not met'}."]
    refusals = [r for r in rows if "refused" in r]
    if refusals:
        lines += [
            "",
            "Not estimated (refused by the estimate; its message):",
            "",
        ]
        by_message: dict[str, list[str]] = {}
        for r in refusals:
            message = r["refused"].removeprefix("ValueError: ")
            short = message if len(message) <= 200 else message[:200].rsplit(" ", 1)[0] + " ..."
            by_message.setdefault(short, []).append(f"{r['model']} {r['format']} {r['setting']}")
        for message, pairs in by_message.items():
            lines.append(f"- {', '.join(pairs)}: {message}")
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    found = {}
    for package in ("bitsandbytes", "torchao", "peft"):
        try:
            found[package] = __import__(package).__version__
        except ImportError as exc:
            found[package] = f"not importable: {exc}"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the Llama alone, batch 1, 16 tokens, per format"
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=ALL_FORMATS,
        help="run only this format (repeatable); its rows of the models run replace those in "
        "the results, the other rows are kept",
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="bf16 and/or fp32")
    args = parser.parse_args()
    models = ["llama"] if args.quick else args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    precisions = tuple(args.precisions.split(","))
    if unknown or any(p not in DTYPES for p in precisions):
        parser.error(f"--models from {', '.join(MODELS)}; --precisions from bf16, fp32")
    batches, lengths = ((1,), (16,)) if args.quick else (BATCHES, LENGTHS)
    formats = args.only or ALL_FORMATS
    started = time.perf_counter()
    rows = run(models, formats, batches, lengths, precisions)
    grid = "quick" if args.quick else "full"
    out = RESULTS / f"{NAME}.json"
    extra: dict[str, Any] = {}
    if args.only and out.exists():  # the other formats' rows, measured before, are kept
        before = json.loads(out.read_text())
        # the file's seconds are this run's: the run of the kept rows is said beside them
        extra = {
            "rerun": args.only,
            "seconds_before": before.get("seconds_before", before["seconds"]),
        }
        kept = [
            r for r in before["rows"] if r["format"] not in args.only or r["model"] not in models
        ]
        model_order, format_order = list(MODELS), ALL_FORMATS
        rows = sorted(
            kept + rows,
            key=lambda r: (model_order.index(r["model"]), format_order.index(r["format"])),
        )
        grid = before.get("grid", grid) if before.get("grid") == grid else "mixed"
    extra.update(grid=grid, **_versions())
    write_results(NAME, rows, summarize(rows), started, extra=extra)


if __name__ == "__main__":
    main()
