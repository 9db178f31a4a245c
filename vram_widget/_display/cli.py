"""The command line: ``vram-widget`` / ``python -m vram_widget``.

Profiles one model (a zoo name, a ``package.module:callable`` or a Hugging Face model type
built from a config) on fake tensors, then prints, per precision, the estimated memory of one
step and whether it fits on a GPU, with the largest batch that does. ``--json`` prints the
same as one JSON object, for scripts.

Every bad value is a usage error (exit code 2, the valid forms named on stderr), found before
any profiling (``cli_args.validate``, ``cli_models``); a model that cannot be profiled is exit
code 1, with ``vram-widget: error: <message>`` on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._estimating.loading import LoadEstimate
from .._estimating.options import Device, Mode, OptimizerChoice
from .._estimating.recipe.weights import Weights, parse_weights, weight_format
from .cli_args import DEFAULT_GPU, LAYER_ROWS, PROG, build_parser, validate
from .cli_generation import kv_cache_config, kv_cache_keywords, kv_cache_line
from .cli_models import (
    DEFAULT_MODEL,
    ModelSpec,
    build_model,
    check_positions,
    describe_inputs,
    model_inputs,
    resolve_model,
)

if TYPE_CHECKING:
    from torch import nn

    from .._estimating.estimator import MemoryEstimate
    from .._estimating.gpus import Gpu
    from .._estimating.profile import ModelProfile

__all__ = ["build_parser", "main"]

# What each figure measures, in the words of --help, the text legend and the JSON.
ALLOCATED_MEANS = {
    Device.CUDA: "live tensor bytes at the step's peak (torch.cuda.max_memory_allocated)",
    Device.CPU: "the peak of allocated bytes on the CPU, as "
    "torch.profiler.profile(profile_memory=True) records it",
}
RESERVED_MEANS = "the CUDA caching allocator's segments at their peak (max_memory_reserved)"
DEVICE_MEANS = (
    "the least GPU memory the step runs in: the segments the allocator cannot release, the "
    "one it asks for, and the CUDA context outside it"
)
FIT_MEANS = {
    Device.CUDA: "the figure compared with the GPU's memory: device_bytes (total_bytes "
    "where device_bytes is null: the allocator is not replayed for mode generate)",
    Device.CPU: "the figure compared with the --gpu capacity, when one is given: peak_bytes "
    "(allocated on the CPU; no allocator, no CUDA context, extras 0)",
}


@dataclasses.dataclass(frozen=True)
class _Setting:
    precision: Any
    estimate: MemoryEstimate
    max_batch_size: int | None
    # the weights and buffers once loaded, before any step (ModelProfile.load_bytes)
    loaded: LoadEstimate | None = None

    @property
    def fit_bytes(self) -> int:
        """The one figure compared with the capacity: device on CUDA, allocated on the CPU
        (and, where the CUDA allocator is not replayed, as for a generation, allocated plus
        the CUDA extras: ``total_bytes``)."""
        device = self.estimate.device_bytes
        return self.estimate.total_bytes if device is None else device

    @property
    def fit_label(self) -> str:
        """What :attr:`fit_bytes` is, in the words of the table's columns."""
        if self.estimate.device_bytes is not None:
            return "device"
        return "allocated" if self.estimate.extras.total_bytes == 0 else "allocated + extras"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Parameters
    ----------
    argv
        The arguments, without the program name (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success, 1 when the model cannot be profiled. Bad arguments raise
        ``SystemExit(2)`` (argparse's usage error) after naming the valid forms on stderr.
    """
    parser = build_parser()
    args = validate(parser, parser.parse_args(argv))
    spec = resolve_model(parser, args)
    model = build_model(parser, spec)
    check_positions(parser, args, model)
    inputs = model_inputs(parser, args, spec, model)
    assumed = _assumptions(args, spec, inputs, model)
    if assumed and not args.json:
        for line in assumed:
            print(line)
        sys.stdout.flush()  # said before the seconds of profiling, not after

    from .._estimating.profile_source import ProfilingError

    if args.plan_layouts is not None:
        from .cli_layouts import print_plan

        try:
            return print_plan(args, model, inputs, _estimate_keywords(args))
        except (ProfilingError, ValueError, TypeError) as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 1
    try:
        profile, settings = _profile(args, model, inputs)
    except (ProfilingError, ValueError, TypeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_as_json(spec, args, profile, settings, assumed), indent=2))
    else:
        _print_text(args, profile, settings)
    return 0


def _assumptions(
    args: argparse.Namespace, spec: ModelSpec, inputs: dict[str, Any], model: nn.Module
) -> list[str]:
    """One line per default the user did not choose: the model and its inputs, the GPU."""
    lines = []
    if spec.kind == "hub":
        lines.append(
            f"built from the config.json of {spec.label} (no weights): {type(model).__name__}, "
            f"one sample {describe_inputs(inputs)}"
        )
    if args.model_assumed:
        lines.append(
            f"assumed model: {DEFAULT_MODEL} (zoo), one sample {describe_inputs(inputs)}; "
            "choose with MODEL (a zoo name or package.module:callable), --transformers TYPE, "
            "--input-size"
        )
    for ignored in getattr(args, "recipe_ignored", ()):
        lines.append(f"not estimated (set in the recipe file): {ignored}")
    if args.gpu_assumed:
        lines.append(f"assumed GPU: {DEFAULT_GPU}; choose another with --gpu (e.g. 'A100 40GB')")
    return lines


def _profile(
    args: argparse.Namespace, model: nn.Module, inputs: dict[str, Any]
) -> tuple[ModelProfile, list[_Setting]]:
    from .. import profile_model

    # profile only the precisions asked (profile_model would otherwise run fp32 up front)
    profile = profile_model(
        model, device=args.device.value, precisions=tuple(args.precisions), **inputs
    )
    settings: list[_Setting] = []
    gpu: Gpu | None = args.gpu
    keywords = _estimate_keywords(args)
    for precision in args.precisions:
        est = profile.estimate(args.batch_size, precision, **keywords)
        largest = None
        if gpu is not None:
            largest = profile.max_batch_size(gpu.memory_bytes, precision=precision, **keywords)
        loaded = None  # load_bytes follows bitsandbytes' loading, not torchao's (yet)
        if not parse_weights(keywords.get("weights")).torchao:
            loaded = profile.load_bytes(precision=precision, weights=keywords.get("weights"))
        settings.append(_Setting(precision, est, largest, loaded))
    return profile, settings


def _estimate_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The keywords of ``estimate`` (and ``max_batch_size``) from the flags, past the batch
    and the precision; the profile checks the names they give."""
    train = args.mode is Mode.TRAIN
    keywords: dict[str, Any] = {
        "optimizer": args.optimizer if train else None,
        "mode": args.mode,
        "compute_capability": None if args.gpu is None else args.gpu.compute_capability,
    }
    if args.transformers is None and args.hf is None and args.seq_len is not None:
        keywords["seq_len"] = args.seq_len  # a --transformers model is profiled at its length
    if args.new_tokens is not None:
        keywords["new_tokens"] = args.new_tokens
    keywords.update(kv_cache_keywords(args))
    if args.weights is not None:
        keywords["weights"] = Weights(
            weight_format(args.weights),
            compute_dtype=args.compute_dtype or "fp32",
            double_quant=args.double_quant,
            int8_threshold=6.0 if args.int8_threshold is None else args.int8_threshold,
        )
    if args.float8 is not None:
        keywords["float8"] = args.float8
    if args.float8_all_gather:
        keywords["float8_all_gather"] = True
    if args.expandable_segments:
        keywords["expandable_segments"] = True
    if args.context_bytes is not None:
        keywords["context_bytes"] = args.context_bytes
    if args.lazy_loading is not None:
        keywords["lazy_loading"] = args.lazy_loading
    if args.tp is not None and args.tp > 1:  # one tensor-parallel rank, training or not
        keywords.update(gpus=args.gpus, tp=args.tp)
    if args.ep is not None and args.ep > 1:  # one expert-parallel rank, training or not
        keywords.update(gpus=args.gpus, ep=args.ep)
    if args.cp is not None and args.cp > 1:  # one context-parallel rank, training or not
        keywords.update(gpus=args.gpus, cp=args.cp)
    if args.pp is not None and args.pp > 1:  # each pipeline stage (training only)
        keywords.update(gpus=args.gpus, pp=args.pp, pp_schedule=args.pp_schedule or "gpipe")
        keywords["microbatches"] = args.microbatches
        keywords["pp_split"] = _patterns(args.pp_split)
        keywords["stages_per_rank"] = args.stages_per_rank
    if not train:
        return keywords
    return {**keywords, **_training_keywords(args)}


def _patterns(text: str | None) -> list[str] | None:
    return None if text is None else [p.strip() for p in text.split(",") if p.strip()]


def _training_keywords(args: argparse.Namespace) -> dict[str, Any]:
    text: str | None = args.checkpoint
    checkpoint: object = text
    if text is not None and any(c in text for c in ",*."):  # patterns, not a class name
        checkpoint = _patterns(text)
    keywords: dict[str, Any] = {
        "checkpoint": checkpoint,
        "checkpoint_policy": args.checkpoint_policy,
        "trainable": _patterns(args.trainable),
        "grad_accumulation": args.grad_accumulation,
        "lora_rank": args.lora_rank,
        "gpus": args.gpus,
        "strategy": args.strategy,
        "gpus_per_node": args.gpus_per_node,
        "fsdp_units": _patterns(args.fsdp_units),
        "rank": args.rank,
    }
    targets: str | None = args.lora_targets
    if targets is not None:
        keywords["lora_targets"] = (
            targets if targets in ("auto", "all-linear") else (_patterns(targets))
        )
    for name in (
        "optimizer_in_backward", "set_to_none", "lora_dtype", "outputs", "loss_scaled",
        "carried_scalars", "clip_grad_norm", "param_groups", "loss_chunks",
        "offload_activations", "compile", "activation_memory_budget",
    ):  # fmt: skip
        if getattr(args, name) is not None:
            keywords[name] = getattr(args, name)
    return keywords


# --------------------------------------------------------------------------------------------
# Output: JSON and text name the same figures the same way.
# --------------------------------------------------------------------------------------------


def _as_json(
    spec: ModelSpec,
    args: argparse.Namespace,
    profile: ModelProfile,
    settings: list[_Setting],
    assumed: list[str],
) -> dict[str, Any]:
    gpu: Gpu | None = args.gpu
    device: Device = args.device
    out: dict[str, Any] = {
        "model": spec.label,
        "model_class": profile.model_name,
        "param_count": profile.param_count,
        "input_shape": profile.input_shape,
        "device": device.value,
        "gpu": None if gpu is None else {"name": gpu.name, "memory_bytes": gpu.memory_bytes},
        # the quantized KV cache's cache_config (transformers' names); null: the model's own
        "kv_cache": kv_cache_config(args),
        "assumed": assumed,
        "peak_bytes_means": f"allocated: {ALLOCATED_MEANS[device]}",
        "reserved_bytes_means": f"reserved: {RESERVED_MEANS}; null on --device cpu",
        "device_bytes_means": f"device: {DEVICE_MEANS}; null on --device cpu",
        "extras_bytes_means": "CUDA context, cuBLAS workspace and allocator rounding "
        "(0 on --device cpu)",
        "total_bytes_means": "peak_bytes + extras_bytes: the allocated basis "
        "(MemoryEstimate.fits(basis='allocated')); on cuda not the figure compared with "
        "the GPU's memory (fit_bytes is)",
        "fit_bytes_means": FIT_MEANS[device],
        "fits_means": "fit_bytes <= gpu.memory_bytes (null without a gpu); max_batch_size: "
        "the largest batch for which it holds",
        "load_bytes_means": "allocated once the model is loaded at the precision's dtype "
        "(and --weights), before any step (ModelProfile.load_bytes); load_reserved_bytes: "
        "its reserved bytes on cuda",
        "settings": [_setting_json(s, gpu) for s in settings],
    }
    if args.layers:
        out["layers"] = json.loads(_layer_frame(settings[0].estimate).to_json(orient="records"))
    return out


def _setting_json(s: _Setting, gpu: Gpu | None) -> dict[str, Any]:
    est = s.estimate
    return {
        "batch_size": est.batch_size,
        "precision": s.precision.value,
        "optimizer": _name(est.optimizer) if est.mode is Mode.TRAIN else None,
        "mode": est.mode.value,
        "peak_bytes": est.peak_bytes,
        "reserved_bytes": est.reserved_bytes,
        "device_bytes": est.device_bytes,
        "extras_bytes": est.extras.total_bytes,
        "cuda_context_bytes": est.extras.cuda_context_bytes,
        "cuda_context_source": est.extras.cuda_context_source or None,
        "total_bytes": est.total_bytes,
        "fit_bytes": s.fit_bytes,
        "fits": None if gpu is None else s.fit_bytes <= gpu.memory_bytes,
        "max_batch_size": s.max_batch_size,
        "peak_phase": est.peak_phase.value,
        "peak_module": est.peak_module,
        "peak_op": est.peak_op,
        "peak_step": est.peak_step,
        "kv_cache_bytes": est.kv_cache_bytes,
        "kv_cache_bytes_per_token": est.kv_cache_bytes_per_token,
        "flops": est.flops,
        "levers": est.levers.describe(),
        "weights": est.weights or None,
        "float8": est.float8 or None,
        "gpus": est.gpus,
        "tp": est.tp,
        "ep": est.ep,
        "cp": est.cp,
        "ep_worst_case_bytes": est.ep_worst_case_bytes,
        "pp": est.pp,
        "pp_schedule": est.pp_schedule,
        "microbatches": est.microbatches,
        "stages_per_rank": est.stages_per_rank,
        "stage_peak_bytes": list(est.stage_peak_bytes) or None,
        "strategy": None if est.strategy is None else est.strategy.value,
        "nccl_buffer_bytes": None if est.nccl is None else est.nccl.nbytes,
        "rank": est.rank,
        "communication_bytes": est.communication_bytes,
        "host_bytes": est.host_bytes,
        "load_bytes": None if s.loaded is None else s.loaded.allocated_bytes,
        "load_reserved_bytes": None if s.loaded is None else s.loaded.reserved_bytes,
    }


def _name(opt: OptimizerChoice | None) -> str | None:
    return None if opt is None else opt.value


def _layer_frame(est: MemoryEstimate) -> Any:
    frame = est.to_dataframe()
    return frame[frame.param_count.gt(0) | frame.activation_bytes.gt(0)]


def _print_text(args: argparse.Namespace, profile: ModelProfile, settings: list[_Setting]) -> None:
    print(profile)
    first = settings[0].estimate
    kv_line = kv_cache_line(args)
    if kv_line:
        print(kv_line)
    if first.weights:
        print(f"weights: {first.weights}")
    if first.float8:
        print(f"float8: {first.float8}")
    if first.levers.active:
        print(f"levers: {first.levers.describe()}")
    if first.host_bytes:
        print(
            f"not in any figure: host memory of the offloaded activations, "
            f"{first.host_bytes / 2**20:,.1f} MiB at batch {first.batch_size:,}"
        )
    if first.gpus > 1:
        which = f"rank {first.rank}, the worst" if first.rank is not None else "each rank"
        print(
            f"data parallel: {first.gpus} GPUs, {first.strategy}; every figure is one rank's "
            f"({which}) at batch {first.batch_size:,} per GPU, global batch "
            f"{first.gpus * first.batch_size:,}"
        )
        if first.nccl is not None:
            print(
                f"not in any figure: NCCL's own buffers, ~{first.nccl.nbytes / 2**20:,.0f} MiB "
                f"per GPU outside the allocator ({first.nccl.describe()})"
            )
    cuda = args.device is Device.CUDA
    print(f"allocated = {ALLOCATED_MEANS[args.device]}")
    if cuda:
        print(f"reserved  = {RESERVED_MEANS}")
        print("device    = the least GPU memory the step runs in (the segments the allocator")
        print("            cannot release, the one it asks for, the CUDA context outside it):")
        print("            the figure compared with the GPU's memory (fits, largest batch)")
        extras = first.extras
        print(
            f"CUDA context: {_bytes(extras.cuda_context_bytes)} in device "
            f"({extras.cuda_context_source})"
        )
    else:
        print("            (--device cpu: no caching allocator, no CUDA context; the figure")
        print("            compared with a --gpu capacity, when one is given)")
    _print_table(args, settings, cuda)
    for s in settings:
        if s.loaded is not None:
            print(s.loaded.summary())
    print()
    gpu: Gpu | None = args.gpu
    if gpu is None:
        print("no fit verdict: --device cpu assumes no GPU; give --gpu CAPACITY (e.g. '16GiB', "
              "'A100 80GB') to compare the allocated bytes with it")  # fmt: skip
    else:
        width = max(len(s.precision.value) for s in settings) + 1
        for s in settings:
            print(f"{s.precision.value + ':':<{width}} {_fit_line(s, gpu)}")
    if args.layers:
        print(f"\nper-layer table ({first.precision.value}, batch {first.batch_size:,}):")
        print(_layer_frame(first).to_string(max_rows=LAYER_ROWS))


def _print_table(args: argparse.Namespace, settings: list[_Setting], cuda: bool) -> None:
    header = ["batch", "precision", "optimizer", "mode", "allocated"]
    header += ["reserved", "device"] if cuda else []
    header += ["FLOPs", "peak at (module[: op], phase)"]
    rows = []
    for s in settings:
        est = s.estimate
        row = [f"{est.batch_size:,}", s.precision.value,
               "-" if est.mode is not Mode.TRAIN else (_name(est.optimizer) or "none"),
               est.mode.value, _bytes(est.peak_bytes)]  # fmt: skip
        if cuda:
            row += [_maybe_bytes(est.reserved_bytes), _maybe_bytes(est.device_bytes)]
        rows.append([*row, _flops(est.flops), est.peak_location])
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    # Numbers right-aligned, names left-aligned, the (possibly long) module name last.
    left = {1, 2, 3, len(header) - 1}
    for row in (header, *rows):
        cells = [
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def _fit_line(s: _Setting, gpu: Gpu) -> str:
    est = s.estimate
    # GiB with one decimal reads best for real GPUs; a tiny custom capacity in its own unit.
    gib = gpu.memory_bytes / 2**30
    capacity = f"{gib:.1f} GiB" if gib >= 1 else _bytes(gpu.memory_bytes)
    share = s.fit_bytes / gpu.memory_bytes * 100
    figure = s.fit_label
    verdict = "yes," if s.fit_bytes <= gpu.memory_bytes else "no,"
    if s.max_batch_size == 0:
        largest = "not even batch 1 fits"
    else:
        largest = f"largest batch that fits: {s.max_batch_size:,}"
    return (
        f"fits on {gpu.name} ({capacity}) at batch {est.batch_size:,}: {verdict} "
        f"{figure} {_bytes(s.fit_bytes)} of {capacity} ({_percent(share)}); {largest}"
    )


def _maybe_bytes(nbytes: int | None) -> str:
    # None: not modelled for this step (the CUDA allocator is not replayed for a generation)
    return "-" if nbytes is None else _bytes(nbytes)


def _percent(share: float) -> str:
    # "0 %" would read as "nothing"; a small model on a big GPU is "<1 %".
    return "<1 %" if 0 < share < 1 else f"{share:.0f} %"


def _bytes(nbytes: int) -> str:
    """Binary units, three significant figures or so: ``512 B``, ``12.3 MiB``, ``1.50 GiB``.

    Examples
    --------
    >>> _bytes(512), _bytes(12_900_000), _bytes(3 * 2**30 // 2)
    ('512 B', '12.3 MiB', '1.5 GiB')
    """
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"


def _flops(flops: int) -> str:
    """SI prefixes, as FLOP counts are usually quoted: ``4.11 GFLOP``."""
    value = float(flops)
    for prefix in ("", "k", "M", "G", "T", "P", "E"):
        if value < 1000 or prefix == "E":
            break
        value /= 1000
    return f"{value:.3g} {prefix}FLOP"
