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
    estimating: bool = True,
) -> None:
    """Refuse, before any profiling, the float8 steps that are not estimated or measured:
    inference and generation, quantized base weights, autocast, LoRA, ``compile``,
    ``float8_all_gather`` on one GPU, and (``estimating``) more than one GPU, which
    ``measure`` runs on gloo ranks but the estimate does not model yet.

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
    if gpus > 1 and estimating:
        raise ValueError(
            f"{asked} is estimated on one GPU (gpus=1) for now: the data-parallel "
            "estimate does not model torchao's float8 layers under a data-parallel "
            "wrapper, nor FSDP2's float8 all-gather (float8_all_gather=True); "
            f"measure(model, inputs, gpus={gpus}, strategy=..., float8=...) runs it on "
            "real gloo ranks"
        )
    if compile_scope not in (None, False):
        raise ValueError(
            f"{asked} with compile={compile_scope!r}: a compiled float8 step (Inductor "
            "fuses the casts) is not estimated yet; leave compile=None (the eager step)"
        )
