"""The command line's parser and its checks (``vram-widget --help``).

Each ``type=`` function names the valid forms, so argparse says them on a bad value, and
:func:`validate` refuses every combination that cannot be estimated (a flag for another mode,
ranks that are not whole nodes, a capacity below the CUDA context) right after parsing, before
any model is built or profiled: a usage error, exit code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._estimating.accelerator import CUDA_CONTEXT_BYTES, cublas_workspace_bytes
from .._estimating.options import (
    Device,
    Mode,
    OptimizerName,
    Precision,
    Strategy,
    optimizer_names,
    parse_optimizer_choice,
    parse_option,
)
from .._estimating.sharding import DEFAULT_GPUS_PER_NODE, check_rank, resolve_parallel
from .cli_generation import check_kv_cache, kv_cache_flags
from .cli_models import (
    CALLABLE_FORM,
    DEFAULT_MODEL,
    DEFAULT_SEQ_LEN,
    config_pairs,
    hub_name,
    model_spec,
    transformers_type,
)

if TYPE_CHECKING:
    from .._estimating.gpus import Gpu

__all__ = ["build_parser", "validate"]

PROG = "vram-widget"
DEFAULT_PRECISIONS: tuple[Precision, ...] = (Precision.FP32, Precision.BF16, Precision.AMP_BF16)
DEFAULT_GPU = "H100 SXM 80GB"
# Rows of the per-layer table (--layers): enough for a ResNet's blocks, short enough to read.
LAYER_ROWS = 40

_DESCRIPTION = """\
Estimate the GPU memory of one training step (or inference pass, or generation) of a PyTorch
model, from a profile on fake tensors (no GPU needed, nothing allocated), and say whether it
fits on a GPU and with what largest batch.

Every figure says what it measures:
  allocated  live tensor bytes at the step's peak (torch.cuda.max_memory_allocated; on
             --device cpu the peak of allocated bytes on the CPU, as
             torch.profiler.profile(profile_memory=True) records it)
  reserved   the CUDA caching allocator's segments at their peak (max_memory_reserved)
  device     the least GPU memory the step runs in: the segments the allocator cannot
             release, the one it asks for, and the CUDA context outside it
On --device cuda (the default), "device" is the figure compared with the GPU's memory: it
decides "fits" and "largest batch that fits". On --device cpu there is no allocator and no
CUDA context: "allocated" is the figure, no GPU is assumed, and a --gpu (or any capacity,
e.g. your RAM) is compared with the allocated bytes alone, as the CPU step would hold them.

examples:
  vram-widget resnet18 --batch-size 64 --gpu "A100 80GB"
  vram-widget mypackage.models:build_model --input-size 3,224,224 --precision amp-bf16
  vram-widget --transformers llama \\
      --config num_hidden_layers=2,hidden_size=256,num_attention_heads=4,vocab_size=32000 \\
      --seq-len 512 --batch-size 8 --json
  vram-widget --hf Qwen/Qwen2.5-0.5B --seq-len 2048 --batch-size 4 --precision amp-bf16
"""

# Flags of training only: (dest, flag) — given with another --mode, a usage error.
_TRAIN_ONLY = (
    ("optimizer", "--optimizer"),
    ("optimizer_in_backward", "--optimizer-in-backward"),
    ("set_to_none", "--set-to-none"),
    ("lora_dtype", "--lora-dtype"),
    ("outputs", "--outputs"),
    ("loss_scaled", "--loss-scaled"),
    ("carried_scalars", "--carried-scalars"),
    ("clip_grad_norm", "--clip-grad-norm"),
    ("param_groups", "--param-groups"),
    ("training_args", "--training-args"),
    ("torchtune_config", "--torchtune-config"),
    ("torchtitan_config", "--torchtitan-config"),
    ("checkpoint", "--checkpoint"),
    ("pp", "--pp"),
    ("pp_schedule", "--pp-schedule"),
    ("microbatches", "--microbatches"),
    ("pp_split", "--pp-split"),
    ("stages_per_rank", "--stages-per-rank"),
    ("checkpoint_policy", "--checkpoint-policy"),
    ("trainable", "--trainable"),
    ("grad_accumulation", "--grad-accumulation"),
    ("loss_chunks", "--loss-chunks"),
    ("offload_activations", "--offload-activations"),
    ("compile", "--compile"),
    ("activation_memory_budget", "--activation-memory-budget"),
    ("lora_rank", "--lora-rank"),
    ("lora_targets", "--lora-targets"),
    ("gpus", "--gpus"),
    ("strategy", "--strategy"),
    ("gpus_per_node", "--gpus-per-node"),
    ("fsdp_units", "--fsdp-units"),
    ("rank", "--rank"),
)


# --------------------------------------------------------------------------------------------
# Option values: each type= function names the valid forms, so argparse says them on error.
# --------------------------------------------------------------------------------------------


def checkpoint_policy(value: str) -> str | int:
    """``--checkpoint-policy``: ``full``, ``op`` or an int K >= 1 (every K-th block).

    Examples
    --------
    >>> checkpoint_policy("op"), checkpoint_policy("2")
    ('op', 2)
    """
    if value in ("full", "op"):
        return value
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give 'full', 'op' or an integer K >= 1 (every K-th block)"
        ) from None


def _unit_fraction(value: str) -> float:
    """A number in [0, 1], or argparse's usage error naming the valid range."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number in [0, 1]") from None
    if not 0.0 <= number <= 1.0:
        raise argparse.ArgumentTypeError(f"{value!r} is outside [0, 1]")
    return number


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


def optimizer(value: str) -> str:
    """An optimizer name, with its implementation where given (``adamw-fused``), or
    ``"none"`` (kept as a string, so that :func:`validate` can tell ``--optimizer none`` from
    a flag left out)."""
    try:
        parsed, _ = parse_optimizer_choice(value)
    except ValueError:
        valid = ", ".join([*optimizer_names(), "none"])
        raise argparse.ArgumentTypeError(
            f"unknown optimizer {value!r}; valid values are {valid}"
        ) from None
    return "none" if parsed is None else value.strip().lower()


def true_false(value: str) -> bool:
    """``true`` or ``false`` (``--set-to-none``)."""
    key = value.strip().lower()
    if key not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{value!r}: give true or false")
    return key == "true"


def _option(enum_type: type[Any], what: str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        try:
            return parse_option(enum_type, value, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def non_negative_int(value: str) -> int:
    """An int >= 0 (``--rank``)."""
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 0")
    return number


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


# --------------------------------------------------------------------------------------------
# The parser: one helper per group of flags.
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (``vram-widget --help``); check its result with :func:`validate`.

    Examples
    --------
    >>> args = build_parser().parse_args(["mlp", "--batch-size", "8"])
    >>> args.batch_size, args.new_tokens
    (8, None)
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _model_flags(parser.add_argument_group("model"))
    _input_flags(parser.add_argument_group("inputs"))
    kv_cache_flags(parser.add_argument_group("KV cache (--mode generate)"), positive_int)
    _setting_flags(parser.add_argument_group("settings"))
    _recipe_flags(parser.add_argument_group("recipe (training)"))
    _lever_flags(parser.add_argument_group("memory levers (training)"))
    _parallel_flags(parser.add_argument_group("data parallel (training)"))
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument(
        "--layers",
        action="store_true",
        help=f"also print the per-layer table of the first precision (up to {LAYER_ROWS} "
        "rows with parameters or activations)",
    )
    return parser


def _model_flags(what: argparse._ArgumentGroup) -> None:
    zoo_names = ", ".join(_zoo_names())
    what.add_argument(
        "model",
        nargs="?",
        type=model_spec,
        help=f"a zoo name ({zoo_names}) or {CALLABLE_FORM} returning an nn.Module "
        f"(default: {DEFAULT_MODEL}, at its own example inputs)",
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
        "true/false, str; keys: the config class's own fields); may be repeated",
    )
    what.add_argument(
        "--hf",
        type=hub_name,
        metavar="ID",
        help="a Hugging Face Hub model id (org/name) or a local directory holding a "
        "config.json: only config.json is fetched (no weights), and the class its "
        "architectures names is built on the meta device (else a causal-LM head, else the "
        "bare model), fed input_ids (and labels) of --seq-len tokens",
    )
    what.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="with --hf: build an architecture that is the repository's own code "
        "(config.auto_map), which downloads and runs that code on this machine",
    )


def _zoo_names() -> list[str]:
    from .. import zoo

    return list(zoo.ZOO)


def _input_flags(inputs: argparse._ArgumentGroup) -> None:
    inputs.add_argument(
        "--input-size",
        type=input_size,
        metavar="D,D,...",
        help="shape of ONE sample, no batch dimension (e.g. 3,224,224): a float tensor. "
        "Needed for a callable model; zoo models default to their own inputs, transformers "
        "models to input_ids (and labels, in training) of --seq-len tokens",
    )
    inputs.add_argument(
        "--seq-len",
        type=positive_int,
        metavar="N",
        help="tokens per sample (the prompt, with --mode generate): a --transformers or --hf "
        f"model's example length (default: {DEFAULT_SEQ_LEN}, or the config's "
        "max_position_embeddings where less), at most its position table; for a zoo "
        "or callable model with a sequence axis, the length estimated (default: its example's)",
    )
    inputs.add_argument(
        "--new-tokens",
        type=positive_int,
        metavar="T",
        help="with --mode generate (needed there, refused elsewhere): tokens generated after "
        "the prompt of --seq-len tokens",
    )


def _setting_flags(settings: argparse._ArgumentGroup) -> None:
    settings.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="N",
        help="samples per step (sequences generated at once with --mode generate), >= 1 "
        "(default: 32, or the --training-args / --torchtune-config / --torchtitan-config file's)",
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
        metavar="NAME",
        help=f"one of {', '.join(optimizer_names())}, none (a -fused, -foreach or -forloop "
        "suffix picks torch.optim's implementation) (default: adam; training only)",
    )
    settings.add_argument(
        "--mode",
        type=_option(Mode, "mode"),
        default=Mode.TRAIN,
        metavar="MODE",
        help="train (forward, backward, optimizer step), inference (forward under no_grad) "
        "or generate (Hugging Face's greedy generate of --new-tokens tokens) (default: train)",
    )
    settings.add_argument(
        "--device",
        type=_option(Device, "device"),
        default=Device.CUDA,
        metavar="DEVICE",
        help="cuda or cpu: whose kernels and memory the estimate is for; needs no GPU "
        "(default: cuda)",
    )
    settings.add_argument(
        "--gpu",
        type=gpu,
        metavar="GPU",
        help="memory to fit in: a catalog name (e.g. 'A100 80GB', 'RTX 4090 24GB') or a "
        f"capacity ('80GiB', '24 GB', or bytes) (default on cuda: {DEFAULT_GPU!r}; on cpu "
        "none: no fit verdict unless one is given, then the allocated bytes are compared "
        "with it); its compute capability sizes the cuBLAS workspace",
    )
    settings.add_argument(
        "--weights",
        choices=("nf4", "fp4", "int8", "int8-torchao", "int4-torchao", "nf4-torchao"),
        help="the Linear weights stored by bitsandbytes as from_pretrained's "
        "BitsAndBytesConfig stores them: nf4 / fp4 (Linear4bit; training needs --lora-rank: "
        "QLoRA) or int8 (Linear8bitLt, inference); or by torchao's "
        "quantize_, inference: int8-torchao (Int8WeightOnlyConfig) or int4-torchao "
        "(Int4OpaqueTensor, --device cpu only); or nf4-torchao, torchao's NF4Tensor as "
        "torchtune's QLoRA applies it (LoRALinear(quantize_base=True) on the --lora-targets, "
        "FrozenNF4Linear elsewhere; training needs --lora-rank) (default: the precision's "
        "dtype; needs `pip install bitsandbytes transformers`, `pip install torchao` or "
        "`pip install torchao torchtune`)",
    )
    settings.add_argument(
        "--float8",
        choices=("tensorwise", "rowwise"),
        help="float8 training of the Linear layers by torchao's convert_to_float8_training "
        "with that recipe (training only; needs `pip install torchao`)",
    )
    settings.add_argument(
        "--float8-all-gather",
        action="store_true",
        help="with --float8 tensorwise and FSDP2 (--strategy zero2 / zero3 / hsdp): the "
        "weights all-gathered in float8 (torchao's enable_fsdp_float8_all_gather); "
        "estimated by running one rank's step on fake tensors (with --checkpoint and "
        "--grad-accumulation; --device cuda UNCONFIRMED on a GPU) and measured on gloo ranks",
    )
    settings.add_argument(
        "--int8-threshold",
        type=float,
        metavar="T",
        help="with --weights int8: LLM.int8's outlier threshold (llm_int8_threshold, "
        "default 6.0); above 0 the estimate is for inputs with no value at or above it (an "
        "outlier column's split depends on the activations' values), 0: no outlier split",
    )
    settings.add_argument(
        "--double-quant",
        action="store_true",
        help="with --weights nf4 / fp4: the block maxima quantized too (QLoRA's double "
        "quantization, bnb_4bit_use_double_quant)",
    )
    settings.add_argument(
        "--compute-dtype",
        choices=("fp32", "bf16", "fp16"),
        help="with --weights nf4 / fp4: Linear4bit's compute dtype (bnb_4bit_compute_dtype; "
        "default: fp32, BitsAndBytesConfig's)",
    )
    settings.add_argument(
        "--expandable-segments",
        action="store_true",
        help="the CUDA caching allocator with expandable_segments:True "
        "(PYTORCH_CUDA_ALLOC_CONF) for reserved and device (cuda only)",
    )


def _recipe_flags(recipe: argparse._ArgumentGroup) -> None:
    source = recipe.add_mutually_exclusive_group()
    source.add_argument(
        "--training-args",
        metavar="FILE.json",
        help="read the step from Hugging Face TrainingArguments (the JSON args.to_json_string() "
        "writes): batch, accumulation, bf16/fp16, optim, checkpointing, FSDP; a flag that asks "
        "for another value than the file's is refused",
    )
    source.add_argument(
        "--torchtune-config",
        metavar="FILE.yaml",
        help="read the step from a torchtune recipe config (batch_size, dtype, optimizer, "
        "optimizer_in_bwd, activation checkpointing, LoRA); a flag that asks for another "
        "value than the file's is refused",
    )
    source.add_argument(
        "--torchtitan-config",
        metavar="FILE.toml",
        help="read the step from a torchtitan job config (TOML: [training] local_batch_size, "
        "seq_len, dtype; [optimizer]; [activation_checkpoint]; [parallelism] data-parallel "
        "degrees, with --gpus the world size); a flag that asks for another value than the "
        "file's is refused",
    )
    recipe.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        default=None,
        help="step each parameter in its post-accumulate-grad hook during the backward "
        "(torchtune's optimizer_in_bwd)",
    )
    recipe.add_argument(
        "--set-to-none",
        type=true_false,
        metavar="{true,false}",
        help="optimizer.zero_grad(set_to_none=...) (default: true, torch's default)",
    )
    recipe.add_argument(
        "--outputs",
        choices=("kept", "freed"),
        help="how long the step holds the model's outputs: to its end ('kept', a plain loop) "
        "or only until the loss is computed ('freed': Hugging Face Trainer, torchtune)",
    )
    recipe.add_argument(
        "--loss-scaled",
        type=true_false,
        metavar="{true,false}",
        help="the backward runs on a scaled copy of the loss (accelerate's Accelerator.backward, "
        "as the Trainer steps)",
    )
    recipe.add_argument(
        "--carried-scalars",
        type=true_false,
        metavar="{true,false}",
        help="the training loop keeps the last loss and gradient norm into the next step "
        "(the Trainer's loop)",
    )
    recipe.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="MAX_NORM",
        help="torch.nn.utils.clip_grad_norm_ to this norm before the optimizer step",
    )
    recipe.add_argument(
        "--param-groups",
        choices=("one", "decay-split"),
        help="the optimizer's parameter groups: one, or the Trainer's two (weight decay on, "
        "then norms and biases)",
    )
    recipe.add_argument(
        "--lora-dtype",
        choices=("fp32", "bf16", "fp16", "base"),
        help="with --lora-rank: the adapters' dtype ('base': the base weights'; default: PEFT's)",
    )
    recipe.add_argument(
        "--context-bytes",
        type=positive_int,
        metavar="BYTES",
        help="the CUDA context's device memory, as measured (default: the estimate's figure "
        "for the GPU's generation and --lazy-loading)",
    )
    recipe.add_argument(
        "--lazy-loading",
        type=true_false,
        metavar="{true,false}",
        help="CUDA_MODULE_LOADING=LAZY, which sizes the CUDA context (default: true, torch's "
        "default since 1.13)",
    )


def _lever_flags(levers: argparse._ArgumentGroup) -> None:
    levers.add_argument(
        "--checkpoint",
        metavar="WHAT",
        help="activation checkpointing: 'auto' (each repeated block; Hugging Face's own "
        "checkpointing on its models), a class name, or comma-separated module-name patterns",
    )
    levers.add_argument(
        "--checkpoint-policy",
        type=checkpoint_policy,
        metavar="POLICY",
        help="how each checkpointed block is checkpointed: 'full' (default), 'op' "
        "(torchtitan's op-level selective checkpointing) or K (every K-th block); without "
        "--checkpoint, the repeated blocks ('auto')",
    )
    levers.add_argument(
        "--trainable",
        metavar="PATTERNS",
        help="comma-separated parameter-name patterns that train (the rest frozen)",
    )
    levers.add_argument(
        "--grad-accumulation",
        type=positive_int,
        metavar="K",
        help="micro-batches of --batch-size per optimizer step (default: 1)",
    )
    levers.add_argument(
        "--loss-chunks",
        type=positive_int,
        metavar="K",
        help="a Hugging Face causal LM's output projection and cross-entropy on K chunks of "
        "the sequence, torchtune's CEWithChunkedOutputLoss (needs labels; torchtune uses 8)",
    )
    levers.add_argument(
        "--compile",
        choices=("model", "blocks"),
        help="the step as torch.compile (default Inductor backend) runs it: 'model', the "
        "whole model compiled; 'blocks', each repeated block compiled on its own "
        "(torchtitan's and torchtune's per-block compile). The saved activations are the "
        "partitioner's; each compiled region's temporaries Inductor's CPU code's (training only)",
    )
    levers.add_argument(
        "--activation-memory-budget",
        type=_unit_fraction,
        metavar="F",
        help="with --compile: torch._functorch.config.activation_memory_budget in [0, 1], the "
        "share of the activations the partitioner may keep (1: its default)",
    )
    levers.add_argument(
        "--offload-activations",
        choices=("torchtune", "save_on_cpu"),
        help="the forward's saved activations offloaded to host memory: 'torchtune' "
        "(torchtune's OffloadActivations, the output projection kept on the device) or "
        "'save_on_cpu' (torch.autograd.graph.save_on_cpu); --device cuda only",
    )
    levers.add_argument(
        "--lora-rank",
        type=positive_int,
        metavar="R",
        help="LoRA adapters of rank R, applied by PEFT (needs `pip install peft`); not with "
        "--trainable",
    )
    levers.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="with --lora-rank: PEFT's target_modules, 'auto' (PEFT's defaults for a Hugging "
        "Face architecture), 'all-linear', or comma-separated module names (e.g. "
        "conv1,conv2); other models must name theirs (default: auto)",
    )


def _parallel_flags(parallel: argparse._ArgumentGroup) -> None:
    parallel.add_argument(
        "--gpus",
        type=positive_int,
        metavar="N",
        help="data-parallel ranks; the estimate is one rank's step at --batch-size per rank "
        "(default: 1, one device)",
    )
    parallel.add_argument(
        "--strategy",
        metavar="NAME",
        help="with --gpus N > 1, how the ranks share the step: 'ddp' (DistributedDataParallel),"
        " 'zero1' (DDP + ZeroRedundancyOptimizer), 'zero2' / 'zero3' (FSDP2 fully_shard "
        "without / with resharding after the forward) or 'hsdp' (zero3 in a node, replicated "
        "across nodes) (default: ddp)",
    )
    parallel.add_argument(
        "--gpus-per-node",
        type=positive_int,
        metavar="N",
        help=f"GPUs per node, for --strategy hsdp; --gpus must be whole nodes (default: "
        f"{DEFAULT_GPUS_PER_NODE})",
    )
    parallel.add_argument(
        "--fsdp-units",
        metavar="NAMES",
        help="with --strategy zero2, zero3 or hsdp: FSDP2's units, comma-separated module or "
        "class names (default: each repeated block)",
    )
    parallel.add_argument(
        "--tp",
        type=positive_int,
        metavar="K",
        help="tensor-parallel ranks among --gpus (--gpus K: tensor parallelism alone), by the "
        "model's own plan (a Hugging Face model's base_model_tp_plan); training or "
        "--mode inference (default: 1, none)",
    )
    parallel.add_argument(
        "--ep",
        type=positive_int,
        metavar="K",
        help="expert-parallel ranks (--gpus K) of a mixture-of-experts model, by its own "
        "expert plan (a Hugging Face model's base_model_ep_plan), with the tokens routed "
        "evenly; the estimate also gives the bound where every token goes to one rank's "
        "experts; training or --mode inference (default: 1, none)",
    )
    parallel.add_argument(
        "--cp",
        type=positive_int,
        metavar="K",
        help="context-parallel ranks (--gpus K) that each hold --seq-len / K tokens of every "
        "sequence, with torch's ring attention in place of SDPA (context_parallel); --device "
        "cuda, an SDPA model without an attention mask; UNCONFIRMED against a real CUDA run; "
        "training or --mode inference (default: 1, none)",
    )
    parallel.add_argument(
        "--pp",
        type=positive_int,
        metavar="K",
        help="pipeline stages among --gpus (--gpus K), one a rank, of a Hugging Face decoder "
        "(--device cpu, fp32 / bf16 training): each stage's step as "
        "torch.distributed.pipelining schedules it; --batch-size is the whole step's batch "
        "(default: 1, none)",
    )
    parallel.add_argument(
        "--pp-schedule",
        choices=["gpipe", "1f1b", "interleaved-1f1b"],
        help="with --pp: ScheduleGPipe ('gpipe'), Schedule1F1B ('1f1b') or "
        "ScheduleInterleaved1F1B ('interleaved-1f1b': --stages-per-rank stages a rank) "
        "(default: gpipe)",
    )
    parallel.add_argument(
        "--stages-per-rank",
        type=positive_int,
        metavar="V",
        help="with --pp-schedule interleaved-1f1b: the stages each rank holds, rank r "
        "holding stages r, r + --pp, ... (default: 2, torchtitan's)",
    )
    parallel.add_argument(
        "--pp-split",
        metavar="NAMES",
        help="with --pp: the first decoder layer of each stage after the first, comma-"
        "separated, e.g. layers.3 (torchtitan's pipeline_parallel_split_points; --pp x "
        "--stages-per-rank - 1 names; default: the layers evenly)",
    )
    parallel.add_argument(
        "--microbatches",
        type=positive_int,
        metavar="M",
        help="with --pp: the micro-batches --batch-size is split into (default: --pp)",
    )
    parallel.add_argument(
        "--plan-layouts",
        type=positive_int,
        metavar="N",
        help="print every layout of N GPUs (data-parallel strategies x --tp x --pp ranks) the "
        "estimate answers against --gpu, best first, and those it refuses with the reason "
        "(ModelProfile.plan_layouts); --batch-size is then the whole step's batch, of the "
        "first --precision; each tensor or pipeline layout is a profiling run of its own",
    )
    parallel.add_argument(
        "--rank",
        type=non_negative_int,
        metavar="R",
        help="with --gpus N > 1: the rank to estimate, 0 <= R < N (default: the worst rank)",
    )


# --------------------------------------------------------------------------------------------
# The checks: every combination refused here, before a model is built or profiled.
# --------------------------------------------------------------------------------------------


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Check the parsed flags together and fill in the defaults of those left out.

    Each refusal is ``parser.error`` (exit code 2) naming the flags and the valid forms; it
    comes before any model is built, so nothing is profiled for a request that cannot be
    answered. Sets ``args.precisions`` (the asked ones, in order, once each),
    ``args.gpu_assumed`` (True where the default GPU was taken) and the defaults of the
    lever and data-parallel flags.

    Examples
    --------
    >>> parser = build_parser()
    >>> args = validate(parser, parser.parse_args(["mlp", "--gpus", "4", "--strategy", "zero1"]))
    >>> args.gpus, args.strategy, args.grad_accumulation, args.gpu.name
    (4, 'zero1', 1, 'H100 SXM 80GB')
    """
    _read_recipe_file(parser, args)
    args.batch_size = 32 if args.batch_size is None else args.batch_size
    chosen = [p for group in (args.precision or [list(DEFAULT_PRECISIONS)]) for p in group]
    args.precisions = list(dict.fromkeys(chosen))  # repeated ones once, in order
    _check_mode(parser, args)
    check_kv_cache(parser, args)
    _check_levers(parser, args)
    _check_parallel(parser, args)
    _check_gpu(parser, args)
    return args


# flag dest -> the Recipe's flat setting a --training-args / --torchtune-config /
# --torchtitan-config file sets
_FILE_SETTINGS = (
    "batch_size", "seq_len", "optimizer", "grad_accumulation", "checkpoint",
    "checkpoint_policy", "lora_rank", "lora_targets", "lora_dtype", "optimizer_in_backward",
    "gpus", "strategy", "gpus_per_node", "fsdp_units", "outputs", "loss_scaled",
    "carried_scalars", "clip_grad_norm", "param_groups", "loss_chunks", "offload_activations",
)  # fmt: skip
# each recipe file's flag, and the Recipe reader that reads it (its gpus: the --gpus flag;
# None for torchtitan: the product of the file's parallelism degrees)
_RECIPE_FILES = (
    ("training_args", "--training-args", "from_training_arguments"),
    ("torchtune_config", "--torchtune-config", "from_torchtune"),
    ("torchtitan_config", "--torchtitan-config", "from_torchtitan"),
)


def _read_recipe_file(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the flags left out from a --training-args, --torchtune-config or
    --torchtitan-config file; a flag given with another value than the file's is refused
    (one place per setting)."""
    from .._estimating.recipe import Recipe

    args.recipe_ignored = ()
    given_files = [(getattr(args, d), f, r) for d, f, r in _RECIPE_FILES if getattr(args, d)]
    if not given_files:
        return
    ((path, flag, reader),) = given_files  # the flags are mutually exclusive
    gpus = args.gpus
    if gpus is None and flag != "--torchtitan-config":
        gpus = 1
    try:
        recipe = getattr(Recipe, reader)(path, gpus=gpus)
    except (OSError, ValueError, TypeError) as exc:
        parser.error(f"{flag} {path}: {exc}")
    given = {k: getattr(args, k) for k in _FILE_SETTINGS if getattr(args, k) is not None}
    asked = {p for group in args.precision or [] for p in group}
    conflicts = [f"--{k.replace('_', '-')}" for k in given if not _agrees(recipe, k, given[k])]
    if asked and asked != {recipe.step.precision}:
        conflicts.append("--precision")
    if conflicts:
        parser.error(
            f"{', '.join(conflicts)}: another value than {flag} {path} sets (it sets "
            f"precision {recipe.step.precision.value}, optimizer {_shown(recipe.optimizer)}, "
            f"batch size {recipe.step.batch_size}): set each in one place"
        )
    args.precision = [[recipe.step.precision]]
    default = Recipe()
    for key in _FILE_SETTINGS:  # the file's settings, where they are not the defaults
        if getattr(args, key) is None and recipe.get(key) != default.get(key):
            setattr(args, key, _flag_value(key, recipe.get(key)))
    args.recipe_ignored = recipe.ignored


def _agrees(recipe: Any, key: str, value: Any) -> bool:
    from .._estimating.recipe import Recipe

    if key in ("lora_targets", "fsdp_units", "checkpoint") and isinstance(value, str):
        value = value if value in ("auto", "all-linear") else value.split(",")
    try:
        return Recipe.from_keywords(recipe, **{key: value}) is recipe
    except (ValueError, TypeError):
        return False


def _shown(value: Any) -> str:
    name = getattr(value, "name", None)
    if hasattr(value, "implementation"):  # an Optimizer record
        suffix = "" if value.implementation is None else f"-{value.implementation.value}"
        return "none" if name is None else f"{name.value}{suffix}"
    return str(getattr(value, "value", value))


def _flag_value(key: str, value: Any) -> Any:
    """A Recipe setting as its flag's parsed value."""
    if key == "optimizer":
        return _shown(value)
    if key in ("lora_targets", "fsdp_units", "checkpoint") and isinstance(value, tuple):
        return ",".join(value)
    if key == "optimizer_in_backward":
        return value or None
    if key in ("strategy", "outputs", "param_groups"):
        return value.value
    return value


def _check_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    mode: Mode = args.mode
    four_bit = args.weights in ("nf4", "fp4")
    if args.int8_threshold is not None and args.weights != "int8":
        parser.error("--int8-threshold is a setting of --weights int8: give it too")
    if (args.double_quant or args.compute_dtype is not None) and not four_bit:
        parser.error(
            "--double-quant and --compute-dtype are settings of 4-bit weights: give "
            "--weights nf4 or --weights fp4 too"
        )
    if mode is Mode.GENERATE and args.new_tokens is None:
        parser.error(
            "--mode generate needs --new-tokens T (the tokens generated after the prompt of "
            "--seq-len tokens), e.g. --mode generate --new-tokens 64"
        )
    if mode is not Mode.GENERATE and args.new_tokens is not None:
        parser.error(f"--new-tokens is for --mode generate; got --mode {mode.value}")
    if mode is not Mode.TRAIN:
        given = [flag for dest, flag in _TRAIN_ONLY if getattr(args, dest) is not None]
        if (args.tp, args.ep, args.cp) != (None, None, None) and mode is Mode.INFERENCE:
            # tensor- or expert-parallel inference runs on --gpus ranks
            given = [flag for flag in given if flag != "--gpus"]
        if given:
            parser.error(
                f"{', '.join(given)}: training only (--mode train); --mode {mode.value} runs "
                "no optimizer, no levers and one device. Drop them or use --mode train"
            )
    args.optimizer = OptimizerName.ADAM if args.optimizer is None else args.optimizer
    if args.optimizer == "none":  # parse_optimizer's None is kept as None
        args.optimizer = None


def _check_levers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.lora_targets is not None and args.lora_rank is None:
        parser.error("--lora-targets is for --lora-rank R (LoRA adapters); give --lora-rank too")
    if args.lora_rank is not None and args.trainable is not None:
        parser.error(
            "--lora-rank and --trainable both choose what trains: give one (LoRA freezes the "
            "base model and trains its adapters)"
        )
    if args.grad_accumulation is None:
        args.grad_accumulation = 1
    if args.expandable_segments and args.device is Device.CPU:
        parser.error(
            "--expandable-segments is a setting of the CUDA caching allocator; --device cpu "
            "has none: drop it or use --device cuda"
        )
    for dest, flag in (("context_bytes", "--context-bytes"), ("lazy_loading", "--lazy-loading")):
        if getattr(args, dest) is not None and args.device is Device.CPU:
            parser.error(
                f"{flag} sizes the CUDA context; --device cpu has none: drop it or use "
                "--device cuda"
            )


def _check_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.plan_layouts is not None:
        _check_plan(parser, args)
        return
    gpus = 1 if args.gpus is None else args.gpus
    if gpus == 1:
        given = [
            flag
            for dest, flag in _TRAIN_ONLY[-4:]  # --strategy, --gpus-per-node, ...
            if getattr(args, dest) is not None
        ]
        if given:
            parser.error(
                f"{', '.join(given)}: data-parallel settings, for --gpus N with N > 1; "
                "give --gpus too (one device has no strategy)"
            )
    strategy = "ddp" if args.strategy is None else args.strategy
    per_node = DEFAULT_GPUS_PER_NODE if args.gpus_per_node is None else args.gpus_per_node
    try:
        parallel = resolve_parallel(gpus, strategy, gpus_per_node=per_node)
        check_rank(args.rank, gpus)
    except ValueError as exc:
        parser.error(f"--gpus/--strategy/--gpus-per-node/--rank: {exc}")
    if args.gpus_per_node is not None and parallel.strategy is not Strategy.HSDP:
        parser.error(f"--gpus-per-node is for --strategy hsdp; got --strategy {strategy}")
    sharded = (Strategy.ZERO2, Strategy.ZERO3, Strategy.HSDP)
    if args.fsdp_units is not None and parallel.strategy not in sharded:
        parser.error(
            f"--fsdp-units is for --strategy zero2, zero3 or hsdp (FSDP2); got --strategy "
            f"{strategy}"
        )
    if args.tp is not None and args.pp in (None, 1):  # with --pp: the pipeline's check
        from .._estimating.recipe.parallel import ParallelSettings, check_tensor_parallel

        try:
            check_tensor_parallel(
                ParallelSettings(gpus, Strategy(strategy), tp=args.tp, gpus_per_node=per_node)
            )
        except ValueError as exc:
            parser.error(f"--tp: {exc}")
    if args.ep is not None:
        from .._estimating.recipe.parallel import ParallelSettings, check_expert_parallel

        try:
            check_expert_parallel(
                ParallelSettings(gpus, Strategy(strategy), tp=args.tp or 1, ep=args.ep)
            )
        except ValueError as exc:
            parser.error(f"--ep: {exc}")
    if args.cp is not None:
        from .._estimating.recipe.parallel import ParallelSettings, check_context_parallel

        try:
            check_context_parallel(
                ParallelSettings(
                    gpus, Strategy(strategy), tp=args.tp or 1, pp=args.pp or 1,
                    ep=args.ep or 1, cp=args.cp,
                ),
                args.seq_len,
            )  # fmt: skip
        except ValueError as exc:
            parser.error(f"--cp: {exc}")
    pipeline = (args.pp_schedule, args.microbatches, args.pp_split, args.stages_per_rank)
    if args.pp is not None or any(x is not None for x in pipeline):
        from .._estimating.options import PipelineSchedule
        from .._estimating.recipe.parallel import ParallelSettings
        from .._estimating.recipe.pipeline import check_pipeline_parallel

        if args.pp is None:
            parser.error(
                "--pp-schedule, --pp-split, --stages-per-rank and --microbatches are settings "
                "of --pp K: give it too"
            )
        try:
            check_pipeline_parallel(
                ParallelSettings(
                    gpus, Strategy(strategy), gpus_per_node=per_node, tp=args.tp or 1,
                    pp=args.pp, pp_schedule=PipelineSchedule(args.pp_schedule or "gpipe"),
                    microbatches=args.microbatches, stages_per_rank=args.stages_per_rank,
                ),
                args.batch_size,
            )  # fmt: skip
        except ValueError as exc:
            parser.error(f"--pp: {exc}")
    args.gpus, args.strategy, args.gpus_per_node = gpus, strategy, per_node


def _check_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--plan-layouts N`` chooses the layout: the flags that name one are refused; the
    micro-batches, the GPUs per node and FSDP2's units stay settings of the plan."""
    chosen = [
        flag
        for dest, flag in (
            ("gpus", "--gpus"), ("strategy", "--strategy"), ("tp", "--tp"), ("pp", "--pp"),
            ("pp_schedule", "--pp-schedule"), ("pp_split", "--pp-split"), ("rank", "--rank"),
            ("ep", "--ep"), ("stages_per_rank", "--stages-per-rank"), ("cp", "--cp"),
        )
        if getattr(args, dest) is not None
    ]  # fmt: skip
    if chosen:
        parser.error(
            f"--plan-layouts N tries every layout of N GPUs; {', '.join(chosen)} cannot be "
            "given with it (it keeps --microbatches, --gpus-per-node and --fsdp-units)"
        )
    if args.mode is not Mode.TRAIN:
        parser.error(f"--plan-layouts plans a training step; got --mode {args.mode.value}")
    if args.device is Device.CPU and args.gpu is None:
        parser.error("--plan-layouts needs a capacity on --device cpu: give --gpu (e.g. '16GiB')")
    args.gpus, args.strategy = 1, "ddp"
    args.gpus_per_node = DEFAULT_GPUS_PER_NODE if args.gpus_per_node is None else args.gpus_per_node


def _check_gpu(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.gpu_assumed = args.gpu is None and args.device is Device.CUDA
    if args.gpu_assumed:
        args.gpu = gpu(DEFAULT_GPU)
    chosen: Gpu | None = args.gpu
    if chosen is None or args.device is not Device.CUDA:
        return
    major, minor = chosen.compute_capability or (9, 0)  # the estimate's own default: H100
    # What a CUDA device holds before the step's first tensor: the context (an assumption,
    # accelerator.CUDA_CONTEXT_BYTES) and one cuBLAS workspace (accelerator's sources).
    floor = CUDA_CONTEXT_BYTES + cublas_workspace_bytes(10 * major + minor)
    if chosen.memory_bytes <= floor:
        parser.error(
            f"--gpu {chosen.name}: {chosen.memory_bytes:,} bytes is not more than the "
            f"{floor:,} bytes a CUDA device holds before any tensor of the step (CUDA context "
            f"{CUDA_CONTEXT_BYTES // 2**20} MiB + cuBLAS workspace); give a larger capacity "
            "(e.g. '24GiB', 'A100 80GB') or --device cpu to compare allocated bytes alone"
        )
