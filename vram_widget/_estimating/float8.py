"""Float8 training (torchao's ``Float8Linear``), numpy only: which steps are refused before
any profiling, and the shape rule of the layers it converts.

What a float8 training step keeps, per converted ``nn.Linear`` of an ``out x in`` weight
(torchao/float8/float8_linear.py, ``matmul_with_hp_or_float8_args``):

- the parameters, their gradients and the optimizer's state stay in the precision's dtype
  (``Float8Linear.from_float`` keeps the original ``mod.weight``): float8 saves nothing
  there;
- for the backward, autograd keeps the high-precision input and (a view of) the weight
  (``ctx.save_for_backward(input_hp, weight_hp_t)``), as a plain ``nn.Linear`` does;
- the forward casts the input and the weight to float8 (one byte a value, plus the
  float32 scales, and on the way a float32 copy of a half input: ``_ToFloat8ConstrFunc``,
  float8_training_tensor.py, ``tensor.to(torch.float32) * scale``), and the backward casts
  the output gradient twice, the weight again and the saved input again: temporaries that
  a plain layer does not make, so a float8 step can take more memory than the
  high-precision one (torchao issues #1102 and #2262).
"""

from __future__ import annotations

from collections.abc import Mapping

from .options import Mode, Precision
from .recipe.float8 import Float8
from .recipe.weights import Weights

# torch._scaled_mm's shape rule, which torchao's float8 matmul meets only where both dims
# of a weight are multiples of 16 (torchao/float8/config.py, ``pad_inner_dim``: "_scaled_mm
# ... has the strong constraint that for M,N,K N, K must be a multiple of 16";
# torchao/float8/float8_linear_utils.py, ``_auto_filter_for_tensorwise``: "All dims must be
# divisible by 16 due to float8 hardware requirements")
DIM_MULTIPLE = 16


def indivisible(shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The layers (name -> ``(out_features, in_features)``) whose dims are not multiples of
    16, which torchao's float8 matmul cannot run on a GPU.

    Examples
    --------
    >>> indivisible({"fc1": (512, 784), "fc2": (10, 512), "fc3": (64, 64)})
    {'fc2': (10, 512)}
    """
    return {
        name: shape for name, shape in shapes.items() if any(int(d) % DIM_MULTIPLE for d in shape)
    }


def check_float8(
    float8: Float8,
    mode: Mode,
    precision: Precision,
    weights: Weights,
    lora_rank: int | None,
    gpus: int,
    compile_scope: object = None,
) -> None:
    """Refuse, before any profiling, the float8 steps that are not estimated or measured:
    inference and generation, quantized base weights, autocast, LoRA, ``compile`` and
    ``float8_all_gather`` on one GPU (the layouts of more: :func:`check_float8_layout`).

    Examples
    --------
    >>> check_float8(Float8("rowwise"), Mode.TRAIN, Precision.BF16, Weights(), None, 1)
    >>> check_float8(Float8(True), Mode.INFERENCE, Precision.BF16, Weights(), None, 1)
    Traceback (most recent call last):
    ...
    ValueError: float8='tensorwise' is torchao's float8 training ...
    """
    asked = f"float8={float8.recipe.value if float8.recipe else None!r}"
    if mode is not Mode.TRAIN:
        raise ValueError(
            f"{asked} is torchao's float8 training (convert_to_float8_training): it "
            f"converts the Linear layers for a training step, and mode={mode.value!r} has "
            "no backward. For float8 inference torchao quantizes the weights instead "
            "(torchao.quantization.quantize_ with Float8DynamicActivationFloat8WeightConfig "
            "or Float8WeightOnlyConfig), a different storage that float8= does not "
            "estimate; use mode='train', or leave float8=None"
        )
    if weights.quantized:
        raise ValueError(
            f"{asked} with weights={weights.format.value if weights.format else None!r}: "
            "torchao's Float8Linear swaps nn.Linear layers that hold high-precision "
            "weights, and quantized weights (bitsandbytes' Linear4bit / Linear8bitLt) are "
            "no nn.Linear to convert; choose one of the two"
        )
    if precision in (Precision.AMP_BF16, Precision.AMP_FP16):
        raise ValueError(
            f"{asked} with precision={precision.value!r}: Float8Linear's forward under "
            "torch.autocast casts its input to CUDA autocast's dtype whatever the device "
            "(torchao/float8/float8_linear.py, Float8Linear.forward: 'hardcode to GPU's "
            "autocast dtype'), which is not estimated; use precision='bf16' or 'fp32' "
            "(torchtitan trains float8 on bf16 weights through FSDP's mixed precision)"
        )
    if lora_rank is not None:
        raise ValueError(
            f"{asked} with lora_rank={lora_rank}: float8 training of LoRA adapters is not "
            "estimated yet; choose one of the two"
        )
    if float8.all_gather and gpus == 1:
        raise ValueError(
            f"{asked} with float8_all_gather=True: that is FSDP2's all-gather of the "
            "weights in float8 (torchao's enable_fsdp_float8_all_gather), and gpus=1 "
            "gathers nothing; give gpus=N with strategy='zero2', 'zero3' or 'hsdp', or "
            "leave float8_all_gather=False"
        )
    if compile_scope not in (None, False):
        raise ValueError(
            f"{asked} with compile={compile_scope!r}: a compiled float8 step (Inductor "
            "fuses the casts) is not estimated yet; leave compile=None (the eager step)"
        )


# The strategies a float8 model is estimated and measured with on N ranks: the
# data-parallel wrappers, each checked against real gloo ranks (tests/test_float8.py)
FLOAT8_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
# FSDP2's strategies, whose all-gather torchao's float8 weights take part in
# (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, torchao/float8/fsdp_utils.py, are
# FSDP2's extension points: torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
FSDP2_STRATEGIES = ("zero2", "zero3", "hsdp")


def check_float8_layout(
    float8: Float8,
    gpus: int,
    strategy: str,
    layouts: Mapping[str, int | None],
    estimating: bool = True,
) -> None:
    """Refuse, before any profiling, a float8 model on ``gpus > 1`` ranks laid out in a way
    that is not estimated (``estimating``) or measured: a strategy other than the
    data-parallel ones, tensor / pipeline / expert / context parallelism (``layouts``:
    name -> degree) and ``float8_all_gather`` outside FSDP2 (the estimate's other limits
    on it: :func:`float8_all_gather_refusals`).

    Examples
    --------
    >>> check_float8_layout(Float8(True), 2, "zero3", {"tp": 1})
    >>> check_float8_layout(Float8(True, all_gather=True), 2, "zero3", {})
    >>> check_float8_layout(Float8(True, all_gather=True), 2, "ddp", {}, estimating=False)
    Traceback (most recent call last):
    ...
    ValueError: float8='tensorwise' with float8_all_gather=True and strategy='ddp': ...
    """
    if not float8.enabled or gpus == 1:
        return
    asked = f"float8={float8.recipe.value if float8.recipe else None!r}"
    other = [f"{k}={v}" for k, v in layouts.items() if v not in (None, 1)]
    if other or strategy not in FLOAT8_STRATEGIES:
        shown = ", ".join(other) or f"strategy={strategy!r}"
        raise ValueError(
            f"{asked} with {shown}: float8 on {gpus} GPUs is "
            f"{'estimated' if estimating else 'measured'} with the data-parallel strategies "
            f"{', '.join(map(repr, FLOAT8_STRATEGIES))} only, without tp, pp, ep or cp"
        )
    if float8.all_gather and strategy not in FSDP2_STRATEGIES:
        raise ValueError(
            f"{asked} with float8_all_gather=True and strategy={strategy!r}: the float8 "
            f"all-gather is FSDP2's; use strategy {', '.join(map(repr, FSDP2_STRATEGIES))}"
        )


# What a float8 all-gather estimate on device="cuda" says beside its float8 setting
# (``MemoryEstimate.float8``): the rank's run there is read from torchao's and PyTorch's
# sources, not checked on a GPU (_profiling/float8_fsdp.py)
FLOAT8_ALL_GATHER_CUDA_NOTE = (
    "; device='cuda' rank: torchao's torch._scaled_mm path, CUDA's kernel choices and the "
    "caching allocator's 512-byte blocks, UNCONFIRMED on a GPU (the kernel's workspace "
    "not seen; reserved_bytes not estimated)"
)


# The settings of a float8 all-gather rank's step its run (``_profiling/float8_fsdp.py``)
# takes: the batch, sequence length, precision, the optimizer and its implementation, the
# FSDP2 layout, activation checkpointing of whole modules (``checkpoint``, the policy left
# at its default, "full") and gradient accumulation, each checked against gloo ranks
# (tests/test_float8.py); any other setting at a value not its default is refused by name.
_ALL_GATHER_RUN = frozenset(
    {
        "batch_size",
        "seq_len",
        "precision",
        "mode",
        "name",
        "implementation",
        "checkpoint",
        "grad_accumulation",
    }
)


def float8_all_gather_refusals(recipe: object) -> list[str]:
    """The settings of ``recipe`` (a :class:`~vram_widget.Recipe` with
    ``float8_all_gather=True`` on FSDP2) that its estimate does not take yet, by name: each
    lever, step protocol or optimizer setting other than those the rank's run takes
    (``checkpoint``, ``grad_accumulation``) not at its default.

    Examples
    --------
    >>> from vram_widget._estimating.recipe import Recipe
    >>> asked = Recipe.from_keywords(gpus=2, strategy="zero3", float8=True,
    ...                              float8_all_gather=True, checkpoint="auto")
    >>> float8_all_gather_refusals(asked)
    []
    >>> float8_all_gather_refusals(asked.with_(checkpoint_policy="op", loss_chunks=4))
    ['loss_chunks', 'checkpoint_policy']
    """
    import dataclasses

    refused: list[str] = []
    for part in ("levers", "step", "optimizer"):
        value = getattr(recipe, part)
        unset = type(value)()
        refused.extend(
            f.name
            for f in dataclasses.fields(value)
            if f.name not in _ALL_GATHER_RUN and getattr(value, f.name) != getattr(unset, f.name)
        )
    return refused
