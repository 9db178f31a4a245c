"""The command line: ``vram-widget`` / ``python -m vram_widget``.

Profiles one model (a zoo name, a ``package.module:callable`` or a Hugging Face model type
built from a config) on fake tensors, then prints, per precision, the estimated memory of one
step and whether it fits on a GPU, with the largest batch that does. ``--json`` prints the
same as one JSON object, for scripts.

Every bad value is a usage error (exit code 2, the valid forms named on stderr); a model that
cannot be profiled is exit code 1, with ``vram-widget: error: <message>`` on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._estimating.options import (
    Device,
    Mode,
    OptimizerName,
    Precision,
    parse_optimizer,
    parse_option,
)

if TYPE_CHECKING:
    from torch import nn

    from .._estimating.estimator import MemoryEstimate
    from .._estimating.gpus import Gpu
    from .._estimating.profile import ModelProfile

__all__ = ["build_parser", "main"]

PROG = "vram-widget"
DEFAULT_MODEL = "resnet18"
DEFAULT_PRECISIONS: tuple[Precision, ...] = (Precision.FP32, Precision.BF16, Precision.AMP_BF16)
DEFAULT_GPU = "H100 SXM 80GB"
DEFAULT_SEQ_LEN = 128
# Rows of the per-layer table (--layers): enough for a ResNet's blocks, short enough to read.
_LAYER_ROWS = 40

_DESCRIPTION = """\
Estimate the GPU memory of one training step (or inference pass) of a PyTorch model, from a
profile on fake tensors (no GPU needed, nothing allocated), and say whether it fits on a GPU
and with what largest batch.

"peak" is allocated tensor bytes at the step's peak (torch.cuda.max_memory_allocated);
"extras" are the CUDA context, the cuBLAS workspace and allocator rounding (0 on --device cpu);
"total" = peak + extras is what is compared with the GPU's memory.

examples:
  vram-widget resnet18 --batch-size 64 --gpu "A100 80GB"
  vram-widget mypackage.models:build_model --input-size 3,224,224 --precision amp-bf16
  vram-widget --transformers llama \\
      --config num_hidden_layers=2,hidden_size=256,num_attention_heads=4,vocab_size=32000 \\
      --seq-len 512 --batch-size 8 --json
"""

_CALLABLE_FORM = "package.module:callable (a function that takes no arguments)"


# --------------------------------------------------------------------------------------------
# Models: how each kind of model argument is built, and its default example inputs.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model named on the command line, not yet built.

    Attributes
    ----------
    label
        How the user named it (zoo name, ``module:callable`` or transformers type).
    kind
        ``"zoo"``, ``"callable"`` or ``"transformers"``.
    build
        Returns the module (may raise: the caller turns that into a usage error).
    """

    label: str
    kind: str
    build: Callable[[], Any]


def _zoo_names() -> list[str]:
    from .. import zoo

    return list(zoo.ZOO)


def model_spec(value: str) -> ModelSpec:
    """Parse a model argument: a zoo name or ``package.module:callable``.

    Parameters
    ----------
    value
        The argument as typed.

    Returns
    -------
    ModelSpec

    Raises
    ------
    argparse.ArgumentTypeError
        Unknown zoo name, a module that cannot be imported (named in the message), or a
        missing or non-callable attribute; the message gives the valid forms.
    """
    if ":" not in value:
        from .. import zoo

        if value in zoo.ZOO:
            entry = zoo.ZOO[value]
            return ModelSpec(value, "zoo", entry.build)
        raise argparse.ArgumentTypeError(
            f"unknown model {value!r}: give a zoo name ({', '.join(zoo.ZOO)}) or {_CALLABLE_FORM}"
        )
    module_name, _, attr = value.partition(":")
    if not module_name or not attr:
        raise argparse.ArgumentTypeError(f"bad model {value!r}: the form is {_CALLABLE_FORM}")
    try:
        with _cwd_importable():
            module = importlib.import_module(module_name)
    except Exception as exc:  # any failure inside the user's module is theirs to see
        raise argparse.ArgumentTypeError(
            f"cannot import module {module_name!r} (from {value!r}): "
            f"{type(exc).__name__}: {exc}; the form is {_CALLABLE_FORM}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise argparse.ArgumentTypeError(
                f"module {module_name!r} has no attribute {attr!r} (from {value!r}); "
                f"the form is {_CALLABLE_FORM}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a {type(target).__name__}, not callable; the form is {_CALLABLE_FORM}"
        )
    return ModelSpec(value, "callable", target)


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    # ``python -m`` puts the current directory on sys.path but a console script does not, so
    # ``vram-widget mymodels:build`` would not find ./mymodels.py; add it for the import only,
    # leaving the caller's sys.path as it was (main() also runs in-process, e.g. in tests).
    cwd = os.getcwd()
    added = "" not in sys.path and cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise argparse.ArgumentTypeError(
            "--transformers needs the optional dependency transformers: pip install transformers"
        ) from None
    return transformers


def transformers_type(value: str) -> str:
    """Validate a Hugging Face model type (``gpt2``, ``llama``, ``bert``, ...).

    Raises
    ------
    argparse.ArgumentTypeError
        When transformers is not installed, or the type is not one of its model types (the
        message suggests close matches).
    """
    names = list(_transformers().CONFIG_MAPPING.keys())
    if value in names:
        return value
    close = difflib.get_close_matches(value, names, n=5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown transformers model type {value!r}: give a model type of "
        f"transformers.AutoConfig.for_model, e.g. gpt2, llama, bert, t5 "
        f"({len(names)} in all){hint}"
    )


def _config_value(text: str) -> Any:
    """int, float, bool (``true``/``false``) or str, in that order of preference."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def config_pairs(value: str) -> dict[str, Any]:
    """Parse ``--config k=v,k=v`` into a dict of int, float, bool or str values.

    Examples
    --------
    >>> config_pairs("n_layer=2,scale_attn_weights=false,layer_norm_epsilon=1e-5")
    {'n_layer': 2, 'scale_attn_weights': False, 'layer_norm_epsilon': 1e-05}
    """
    pairs: dict[str, Any] = {}
    for item in value.split(","):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise argparse.ArgumentTypeError(
                f"bad config pair {item!r} in {value!r}: the form is key=value,key=value "
                f"(e.g. n_layer=2,n_embd=64; values are int, float, true/false or str)"
            )
        pairs[key] = _config_value(text.strip())
    return pairs


def _transformers_spec(model_type: str, config: dict[str, Any]) -> ModelSpec:
    def build() -> Any:
        import torch

        transformers = _transformers()
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
        # The meta device: shapes only, so a 70B model "builds" in a second and the profile
        # (which runs on fake tensors anyway) never needs its weights.
        with torch.device("meta"):
            try:
                return transformers.AutoModelForCausalLM.from_config(hf_config)
            except ValueError:
                # No causal-LM head for this type (an encoder, a vision model): the bare model.
                return transformers.AutoModel.from_config(hf_config)

    label = model_type + "".join(f",{k}={v}" for k, v in config.items())
    return ModelSpec(label, "transformers", build)


# --------------------------------------------------------------------------------------------
# Option values: each type= function names the valid forms, so argparse says them on error.
# --------------------------------------------------------------------------------------------


def positive_int(value: str) -> int:
    """An int >= 1 (``--batch-size``, ``--seq-len``)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an integer: give a whole number >= 1"
        ) from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is below 1: give a whole number >= 1")
    return number


def input_size(value: str) -> tuple[int, ...]:
    """The shape of one sample, without the batch dimension: ``3,224,224``."""
    try:
        shape = tuple(int(part) for part in value.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(
            f"bad input size {value!r}: give the shape of one sample, without the batch "
            f"dimension, as comma-separated positive integers (e.g. 3,224,224 or 784)"
        )
    return shape


def precisions(value: str) -> list[Precision]:
    """One or more precisions, comma-separated (``fp32,bf16``)."""
    try:
        return [parse_option(Precision, part, "precision") for part in value.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def optimizer(value: str) -> OptimizerName | None:
    """An optimizer name, or ``none``."""
    try:
        return parse_optimizer(value)
    except ValueError:
        valid = ", ".join([*(m.value for m in OptimizerName), "none"])
        raise argparse.ArgumentTypeError(
            f"unknown optimizer {value!r}; valid values are {valid}"
        ) from None


def _option(enum_type: type[Any], what: str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        try:
            return parse_option(enum_type, value, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def gpu(value: str) -> Gpu:
    """A catalog GPU name or a capacity (``"A100 80GB"``, ``"80GiB"``, ``"24 GB"``, bytes)."""
    from .._estimating.gpus import resolve_gpu

    text = value.strip()
    try:
        # A bare number is bytes, as in the Python API: resolve_gpu then refuses ``80`` (below
        # 1 MiB) with a "did you mean 80 GiB" rather than accepting a GPU with no memory.
        return resolve_gpu(int(text) if text.isdigit() else text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``vram-widget --help``)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_argument_group("model")
    what.add_argument(
        "model",
        nargs="?",
        type=model_spec,
        help=f"a zoo name ({', '.join(_zoo_names())}) or {_CALLABLE_FORM} returning an "
        f"nn.Module (default: {DEFAULT_MODEL})",
    )
    what.add_argument(
        "--model", dest="model_option", type=model_spec, metavar="MODEL", help="same as MODEL"
    )
    what.add_argument(
        "--transformers",
        type=transformers_type,
        metavar="TYPE",
        help="a Hugging Face model type (gpt2, llama, bert, ...), built from --config on the "
        "meta device (no download, no weights allocated); a causal-LM head where the type has "
        "one, else the bare model",
    )
    what.add_argument(
        "--config",
        type=config_pairs,
        action="append",
        metavar="K=V,K=V",
        help="config of --transformers, e.g. n_layer=2,n_embd=64 (values: int, float, "
        "true/false, str); may be repeated",
    )
    inputs = parser.add_argument_group("inputs")
    inputs.add_argument(
        "--input-size",
        type=input_size,
        metavar="D,D,...",
        help="shape of ONE sample, no batch dimension (e.g. 3,224,224): a float tensor. "
        "Needed for a callable model; zoo models default to their own inputs, transformers "
        "models to input_ids and labels of --seq-len tokens",
    )
    inputs.add_argument(
        "--seq-len",
        type=positive_int,
        default=DEFAULT_SEQ_LEN,
        metavar="N",
        help=f"tokens per sample of a transformers model (default: {DEFAULT_SEQ_LEN})",
    )
    settings = parser.add_argument_group("settings")
    settings.add_argument(
        "--batch-size",
        type=positive_int,
        default=32,
        metavar="N",
        help="samples per step, >= 1 (default: 32)",
    )
    settings.add_argument(
        "--precision",
        type=precisions,
        action="append",
        metavar="P[,P...]",
        help=f"one of {', '.join(p.value for p in Precision)}; may be repeated or "
        f"comma-separated (default: {','.join(p.value for p in DEFAULT_PRECISIONS)})",
    )
    settings.add_argument(
        "--optimizer",
        type=optimizer,
        default=OptimizerName.ADAM,
        metavar="NAME",
        help=f"one of {', '.join(o.value for o in OptimizerName)}, none (default: adam; "
        "ignored in inference)",
    )
    settings.add_argument(
        "--mode",
        type=_option(Mode, "mode"),
        default=Mode.TRAIN,
        metavar="MODE",
        help="train (forward, backward, optimizer step) or inference (forward under no_grad) "
        "(default: train)",
    )
    settings.add_argument(
        "--device",
        type=_option(Device, "device"),
        default=Device.CUDA,
        metavar="DEVICE",
        help="cuda or cpu: whose kernels and extras the estimate is for; needs no GPU "
        "(default: cuda)",
    )
    settings.add_argument(
        "--gpu",
        type=gpu,
        default=DEFAULT_GPU,
        metavar="GPU",
        help="GPU to fit on: a catalog name (e.g. 'A100 80GB', 'RTX 4090 24GB') or a capacity "
        f"('80GiB', '24 GB', or bytes) (default: {DEFAULT_GPU!r})",
    )
    levers = parser.add_argument_group("memory levers (training)")
    levers.add_argument(
        "--checkpoint",
        metavar="WHAT",
        help="activation checkpointing: 'auto' (each repeated block; Hugging Face's own "
        "checkpointing on its models), a class name, or comma-separated module-name patterns",
    )
    levers.add_argument(
        "--trainable",
        metavar="PATTERNS",
        help="comma-separated parameter-name patterns that train (the rest frozen)",
    )
    levers.add_argument(
        "--grad-accumulation",
        type=positive_int,
        default=1,
        metavar="K",
        help="micro-batches of --batch-size per optimizer step (default: 1)",
    )
    levers.add_argument(
        "--lora-rank",
        type=positive_int,
        metavar="R",
        help="LoRA adapters of rank R by PEFT (its default targets; needs `pip install peft`)",
    )
    parallel = parser.add_argument_group("data parallel (training)")
    parallel.add_argument(
        "--gpus",
        type=positive_int,
        default=1,
        metavar="N",
        help="data-parallel ranks; the estimate is one rank's step at --batch-size per rank "
        "(default: 1, one device)",
    )
    parallel.add_argument(
        "--strategy",
        default="ddp",
        metavar="NAME",
        help="how the ranks share the step: 'ddp' (DistributedDataParallel), 'zero1' "
        "(DDP + ZeroRedundancyOptimizer), 'zero2' / 'zero3' (FSDP2 fully_shard without / "
        "with resharding after the forward) or 'hsdp' (zero3 in a node, replicated across "
        "nodes) (default: ddp)",
    )
    parallel.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=8,
        metavar="N",
        help="GPUs per node, for --strategy hsdp (default: 8)",
    )
    parallel.add_argument(
        "--fsdp-units",
        default=None,
        metavar="NAMES",
        help="FSDP2's units, comma-separated module or class names (default: each repeated block)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument(
        "--layers",
        action="store_true",
        help=f"also print the per-layer table of the first precision (up to {_LAYER_ROWS} "
        "rows with parameters or activations)",
    )
    return parser


# --------------------------------------------------------------------------------------------
# Running it.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Setting:
    precision: Precision
    estimate: MemoryEstimate
    max_batch_size: int


def _resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSpec:
    if args.model is not None and args.model_option is not None:
        parser.error("give the model once: as MODEL or as --model, not both")
    spec: ModelSpec | None = args.model or args.model_option
    if args.transformers is not None:
        if spec is not None:
            parser.error("give MODEL/--model or --transformers, not both")
        config: dict[str, Any] = {}
        for pairs in args.config or ():
            config.update(pairs)
        return _transformers_spec(args.transformers, config)
    if args.config:
        parser.error("--config is the config of --transformers TYPE; give --transformers too")
    return spec if spec is not None else model_spec(DEFAULT_MODEL)


def _build(parser: argparse.ArgumentParser, spec: ModelSpec) -> nn.Module:
    from torch import nn

    try:
        model = spec.build()
    except Exception as exc:  # the user's code or config: report it as a bad argument
        what = "--transformers/--config" if spec.kind == "transformers" else "MODEL"
        parser.error(f"{what}: building {spec.label!r} failed: {type(exc).__name__}: {exc}")
    if not isinstance(model, nn.Module):
        parser.error(
            f"MODEL: {spec.label!r} returned a {type(model).__name__}, not a torch.nn.Module; "
            f"the form is {_CALLABLE_FORM} returning an nn.Module"
        )
    return model


def _inputs(
    parser: argparse.ArgumentParser, args: argparse.Namespace, spec: ModelSpec, model: nn.Module
) -> dict[str, Any]:
    """Keyword arguments of profile_model: ``input_size=`` or ``inputs=``."""
    if args.input_size is not None:
        return {"input_size": args.input_size}
    if spec.kind == "zoo":
        from .. import zoo

        # Batch 2, not 1: the profile fits every allocation to a + b * batch and reads only
        # shapes, so the example's batch does not matter beyond having one.
        return {"inputs": zoo.ZOO[spec.label].make_inputs(2)}
    if spec.kind == "transformers":
        import torch

        ids = torch.zeros(1, args.seq_len, dtype=torch.long)
        # labels make the model compute its own loss, as in training; a bare model (no LM
        # head) takes no labels, and its loss is the mean of its first output.
        if _accepts_labels(model):
            return {"inputs": {"input_ids": ids, "labels": ids}}
        return {"inputs": {"input_ids": ids}}
    parser.error(
        f"--input-size is needed for {spec.label!r}: the shape of one sample without the "
        f"batch dimension, e.g. --input-size 3,224,224"
    )


def _accepts_labels(model: nn.Module) -> bool:
    import inspect

    return "labels" in inspect.signature(model.forward).parameters


def _profile(
    args: argparse.Namespace, model: nn.Module, inputs: dict[str, Any]
) -> tuple[ModelProfile, list[_Setting]]:
    from .. import profile_model

    profile = profile_model(model, device=args.device.value, **inputs)
    settings: list[_Setting] = []
    opt = args.optimizer if args.mode is Mode.TRAIN else None
    cc = args.gpu.compute_capability
    levers = _levers(args)
    for precision in args.precisions:
        est = profile.estimate(
            args.batch_size, precision, opt, args.mode, compute_capability=cc, **levers
        )
        largest = profile.max_batch_size(
            args.gpu.memory_bytes,
            precision=precision,
            optimizer=opt,
            mode=args.mode,
            compute_capability=cc,
            **levers,
        )
        settings.append(_Setting(precision, est, largest))
    return profile, settings


def _levers(args: argparse.Namespace) -> dict[str, Any]:
    """The lever keywords of ``estimate`` from the flags (the profile checks the names)."""

    def patterns(text: str | None) -> list[str] | None:
        return None if text is None else [p.strip() for p in text.split(",") if p.strip()]

    text: str | None = args.checkpoint
    checkpoint: object = text
    if text is not None and any(c in text for c in ",*."):  # patterns, not a class name
        checkpoint = patterns(text)
    return {
        "checkpoint": checkpoint,
        "trainable": patterns(args.trainable),
        "grad_accumulation": args.grad_accumulation,
        "lora_rank": args.lora_rank,
        "gpus": args.gpus,
        "strategy": args.strategy,
        "gpus_per_node": args.gpus_per_node,
        "fsdp_units": None if args.fsdp_units is None else patterns(args.fsdp_units),
    }


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
    args = parser.parse_args(argv)
    precisions = [p for group in (args.precision or [list(DEFAULT_PRECISIONS)]) for p in group]
    args.precisions = list(dict.fromkeys(precisions))  # repeated ones once, in order
    spec = _resolve_model(parser, args)
    model = _build(parser, spec)
    inputs = _inputs(parser, args, spec, model)

    from .._profiling.profiler import ProfilingError

    try:
        profile, settings = _profile(args, model, inputs)
    except (ProfilingError, ValueError, TypeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_as_json(spec, args, profile, settings), indent=2))
    else:
        _print_text(args, profile, settings)
    return 0


def _as_json(
    spec: ModelSpec, args: argparse.Namespace, profile: ModelProfile, settings: list[_Setting]
) -> dict[str, Any]:
    gpu: Gpu = args.gpu
    out: dict[str, Any] = {
        "model": spec.label,
        "model_class": profile.model_name,
        "param_count": profile.param_count,
        "input_shape": profile.input_shape,
        "device": args.device.value,
        "gpu": {"name": gpu.name, "memory_bytes": gpu.memory_bytes},
        "peak_bytes_means": "allocated tensor bytes",
        "fits_means": "on CUDA: the caching allocator, replayed under the GPU's memory less "
        "the CUDA context, never runs out (device_bytes is the least memory for which it "
        "does not; reserved_bytes its unconstrained peak); on the CPU: total_bytes fits",
        "total_bytes_means": "peak_bytes + extras_bytes (CUDA context, cuBLAS workspace, "
        "allocator rounding): what is compared with the GPU's memory",
        "settings": [
            {
                "batch_size": s.estimate.batch_size,
                "precision": s.precision.value,
                "optimizer": None if s.estimate.mode is Mode.INFERENCE else _name(args.optimizer),
                "mode": s.estimate.mode.value,
                "peak_bytes": s.estimate.peak_bytes,
                "extras_bytes": s.estimate.extras.total_bytes,
                "total_bytes": s.estimate.total_bytes,
                "peak_phase": s.estimate.peak_phase.value,
                "peak_module": s.estimate.peak_module,
                "peak_op": s.estimate.peak_op,
                "flops": s.estimate.flops,
                "levers": s.estimate.levers.describe(),
                "gpus": s.estimate.gpus,
                "strategy": None if s.estimate.strategy is None else s.estimate.strategy.value,
                "nccl_buffer_bytes": None if s.estimate.nccl is None else s.estimate.nccl.nbytes,
                "rank": s.estimate.rank,
                "communication_bytes": s.estimate.communication_bytes,
                "reserved_bytes": s.estimate.reserved_bytes,
                "device_bytes": s.estimate.device_bytes,
                "fits": s.estimate.fits(gpu.memory_bytes),
                "max_batch_size": s.max_batch_size,
            }
            for s in settings
        ],
    }
    if args.layers:
        out["layers"] = json.loads(_layer_frame(settings[0].estimate).to_json(orient="records"))
    return out


def _name(opt: OptimizerName | None) -> str | None:
    return None if opt is None else opt.value


def _layer_frame(est: MemoryEstimate) -> Any:
    frame = est.to_dataframe()
    return frame[frame.param_count.gt(0) | frame.activation_bytes.gt(0)]


def _print_text(args: argparse.Namespace, profile: ModelProfile, settings: list[_Setting]) -> None:
    gpu: Gpu = args.gpu
    print(profile)
    if settings and settings[0].estimate.levers.active:
        print(f"levers: {settings[0].estimate.levers.describe()}")
    if settings and settings[0].estimate.gpus > 1:
        first = settings[0].estimate
        which = f"rank {first.rank}, the worst" if first.rank is not None else "each rank"
        print(
            f"data parallel: {first.gpus} GPUs, {first.strategy}; every figure is one rank's "
            f"({which}) at batch {first.batch_size:,} per GPU, global batch "
            f"{first.gpus * first.batch_size:,}"
        )
        if first.nccl is not None:
            print(
                f"not in any total: NCCL's own buffers, ~{first.nccl.nbytes / 2**20:,.0f} MiB "
                f"per GPU outside the allocator ({first.nccl.describe()})"
            )
    print("peak = allocated tensor bytes at the step's peak (torch.cuda.max_memory_allocated);")
    print("extras = CUDA context + cuBLAS workspace + allocator rounding (0 on --device cpu);")
    print("total = peak + extras; fits: on CUDA, the caching allocator replayed under the")
    print("GPU's memory less the CUDA context never runs out (the figure below is the least")
    print("memory for which it does not); on the CPU, total fits")
    rows = [
        (
            f"{s.estimate.batch_size:,}",
            s.precision.value,
            "-" if s.estimate.mode is Mode.INFERENCE else str(_name(args.optimizer)),
            s.estimate.mode.value,
            _bytes(s.estimate.peak_bytes),
            _bytes(s.estimate.extras.total_bytes),
            _bytes(s.estimate.total_bytes),
            _flops(s.estimate.flops),
            s.estimate.peak_location,
        )
        for s in settings
    ]
    header = ("batch", "precision", "optimizer", "mode", "peak", "extras", "total", "FLOPs",
              "peak at (module[: op], phase)")  # fmt: skip
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    # Numbers right-aligned, names left-aligned, the (possibly long) module name last.
    right = {0, 4, 5, 6, 7}
    for row in (header, *rows):
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
    print()
    for s in settings:
        print(f"{s.precision.value + ':':<{widths[1] + 1}} {_fit_line(s, gpu)}")
    if args.device is Device.CPU:
        print("(--device cpu: no CUDA extras are counted in these totals)")
    if args.layers:
        est = settings[0].estimate
        print(f"\nper-layer table ({est.precision.value}, batch {est.batch_size:,}):")
        print(_layer_frame(est).to_string(max_rows=_LAYER_ROWS))


def _fit_line(s: _Setting, gpu: Gpu) -> str:
    est = s.estimate
    # GiB with one decimal reads best for real GPUs; a tiny custom capacity in its own unit.
    gib = gpu.memory_bytes / 2**30
    capacity = f"{gib:.1f} GiB" if gib >= 1 else _bytes(gpu.memory_bytes)
    # the device basis (the caching allocator replayed under the capacity less the CUDA
    # context) on CUDA, where device_bytes is what the device must have; the allocated
    # total on the CPU
    needed = est.device_bytes if est.device_bytes is not None else est.total_bytes
    share = needed / gpu.memory_bytes * 100
    fits = est.fits(gpu.memory_bytes)
    verdict = "yes," if fits else "no, needs"
    if s.max_batch_size == 0:
        largest = "not even batch 1 fits"
    else:
        largest = f"largest batch that fits: {s.max_batch_size:,}"
    return (
        f"fits on {gpu.name} ({capacity}) at batch {est.batch_size:,}: {verdict} "
        f"{_bytes(needed)} of {capacity} ({_percent(share)}); {largest}"
    )


def _percent(share: float) -> str:
    # "0 %" would read as "nothing"; a small model on a big GPU is "<1 %".
    return "<1 %" if 0 < share < 1 else f"{share:.0f} %"


def _bytes(nbytes: int) -> str:
    """Binary units, three significant figures or so: ``512 B``, ``12.3 MiB``, ``1.50 GiB``."""
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
