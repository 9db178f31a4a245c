"""Base weights quantized by bitsandbytes, applied as transformers' ``from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))`` applies them, on a copy of the model.

- Which modules: transformers' own ``replace_with_bnb_linear``
  (transformers/integrations/bitsandbytes.py: every ``nn.Linear`` of exactly that class, and
  ``Conv1D``, becomes a ``bnb.nn.Linear4bit`` or ``bnb.nn.Linear8bitLt`` on the meta device,
  frozen), with the modules it keeps (``HfQuantizer.get_modules_to_not_convert``,
  transformers/quantizers/base.py: ``llm_int8_skip_modules`` if given, else
  ``get_keys_to_not_convert``: tied weights, the output embeddings and the module of the last
  parameter). A module that is not a transformers ``PreTrainedModel`` gets the same rule
  (its last parameter's module kept).
- The stored layout: bitsandbytes' own ``quantize_4bit`` (``Params4bit._quantize``,
  bitsandbytes/nn/modules.py) run under the fake mode, whose ops have fake kernels
  (bitsandbytes/_ops.py, ``register_fake``): the packed codes ``((n + 1) // 2, 1)`` in the
  storage dtype, the block maxima (float32, or uint8 with double quantization plus a float32
  offset and the nested maxima and 256-entry code), the 16-entry code per layer. The tests
  check it byte for byte against a real ``Params4bit`` quantized on the CPU.
- The kernels: ``bitsandbytes::gemm_4bit`` has a fake kernel that makes its output only; its
  CPU kernel (bitsandbytes/backends/default/ops.py, ``_gemm_4bit_default_impl``) dequantizes
  the nested maxima (float32, plus the offset: a second tensor), then the whole weight to
  the input's dtype, then calls ``F.linear``. :class:`DequantizingKernels` runs that same
  decomposition on the fake tensors during a profiling run, so each temporary is recorded.
  The backward (``MatMul4Bit.backward``, bitsandbytes/autograd/_functions.py) dequantizes
  the weight with ``dequantize_4bit`` and calls ``torch.matmul``: traced as it is.
  On CUDA, ``gemm_4bit`` dispatches to its own kernel (bitsandbytes/backends/cuda/ops.py):
  its temporaries are taken to be the CPU decomposition's (UNCONFIRMED on a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._estimating.recipe.weights import WeightFormat, Weights
from .flops import count_bitsandbytes_matmuls


def require_bitsandbytes() -> ModuleType:
    """bitsandbytes, or an ImportError naming the ``pip install`` that provides it."""
    try:
        import bitsandbytes
    except ImportError:
        raise ImportError(
            "quantized weights (weights='nf4', 'fp4' or 'int8') are applied by bitsandbytes "
            "itself, which is not installed: pip install bitsandbytes"
        ) from None
    return bitsandbytes


def _require_transformers() -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "quantized weights are applied by transformers' replace_with_bnb_linear, as "
            "from_pretrained(quantization_config=BitsAndBytesConfig(...)) applies them; "
            "transformers is not installed: pip install transformers"
        ) from None
    return transformers


def bnb_config(weights: Weights) -> Any:
    """The ``transformers.BitsAndBytesConfig`` of ``weights``."""
    transformers = _require_transformers()
    if weights.format is WeightFormat.INT8:
        return transformers.BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=weights.int8_threshold,
            llm_int8_skip_modules=list(weights.skip_modules or []) or None,
        )
    assert weights.format is not None
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=weights.format.value,
        bnb_4bit_compute_dtype=getattr(torch, weights.compute_dtype),
        bnb_4bit_use_double_quant=weights.double_quant,
        bnb_4bit_quant_storage=getattr(torch, weights.quant_storage),
        llm_int8_skip_modules=list(weights.skip_modules or []) or None,
    )


def modules_kept(model: torch.nn.Module, weights: Weights) -> list[str]:
    """The modules transformers leaves unquantized (``get_modules_to_not_convert``)."""
    from transformers.quantizers.base import HfQuantizer

    skip = None if weights.skip_modules is None else list(weights.skip_modules)
    if hasattr(model, "all_tied_weights_keys") and hasattr(model, "get_output_embeddings"):
        keep_fp32 = getattr(model, "_keep_in_fp32_modules", None)
        return list(HfQuantizer.get_modules_to_not_convert(model, skip, keep_fp32))  # type: ignore[arg-type]
    if skip is not None:
        return skip
    # get_keys_to_not_convert's "remove last module" rule, for a model it cannot read
    params = list(model.named_parameters())
    return [params[-1][0].removesuffix(".weight")] if params else []


def quantized_modules(model: torch.nn.Module, weights: Weights) -> list[str]:
    """The names of the modules ``replace_with_bnb_linear`` would replace: a ValueError
    naming the problem where there are none (before any profiling)."""
    _require_transformers()
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.quantizers_utils import should_convert_module

    kept = modules_kept(model, weights)
    names = [
        name
        for name, m in model.named_modules()
        if (type(m) is torch.nn.Linear or isinstance(m, Conv1D))
        and should_convert_module(name, kept)
    ]
    if not names:
        raise ValueError(
            f"weights={weights.format.value if weights.format else None!r} quantizes the "
            f"nn.Linear (and transformers Conv1D) layers, and {type(model).__name__} has none "
            f"to quantize (kept unquantized: {sorted(kept) or 'none'}); leave weights=None"
        )
    return names


def quantized_copy(model: torch.nn.Module, weights: Weights) -> torch.nn.Module:
    """A copy of ``model`` (meta tensors) whose Linear layers transformers'
    ``replace_with_bnb_linear`` replaced by bitsandbytes' (their weights not quantized yet:
    meta ``Params4bit`` / ``Int8Params`` of the original shape)."""
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    from .step import meta_copy

    require_bitsandbytes()
    quantized_modules(model, weights)
    copy_ = meta_copy(model)
    replace_with_bnb_linear(
        copy_,
        modules_to_not_convert=modules_kept(copy_, weights),
        quantization_config=bnb_config(weights),
    )
    for module in copy_.modules():
        _no_cpu_repacking(module)
    return copy_


def is_quantized_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is a bitsandbytes weight (``Params4bit`` / ``Int8Params``)."""
    return type(p).__name__ in ("Params4bit", "Int8Params")


def fake_quantized(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored form of bitsandbytes weight ``p`` (of the original shape, loaded in
    ``dtype``) as bitsandbytes' own quantization makes it, run in the active fake mode: the
    packed codes with their ``quant_state`` attribute (4-bit) or the int8 codes with their
    ``SCB`` (int8). Not a ``Params4bit``: a fake tensor cannot be wrapped in one; the
    Linear4bit's forward reads ``weight.quant_state`` from the plain tensor alike."""
    import bitsandbytes.functional as F

    _prime_dynamic_map()
    source = torch.empty(tuple(p.shape), dtype=dtype)
    if type(p).__name__ == "Params4bit":
        # Params4bit._quantize (bitsandbytes/nn/modules.py)
        packed, state = F.quantize_4bit(
            source,
            blocksize=p.blocksize,  # type: ignore[attr-defined]
            compress_statistics=p.compress_statistics,  # type: ignore[attr-defined]
            quant_type=p.quant_type,  # type: ignore[attr-defined]
            quant_storage=p.quant_storage,  # type: ignore[attr-defined]
        )
        packed.quant_state = state  # type: ignore[attr-defined]
        return packed
    # Int8Params._quantize: the weight in fp16, then int8_vectorwise_quant
    codes, scales, _ = F.int8_vectorwise_quant(source.to(torch.float16))
    codes.CB, codes.SCB = codes, scales
    codes.row_scales = scales
    return codes


def fresh_int8_state(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Each profiling run starts as the first forward of a loaded model: ``Linear8bitLt``
    moves its weight's codes and scales into its ``MatmulLtState`` on its first call
    (``init_8bit_state``, bitsandbytes/nn/modules.py), so the state is emptied and the fake
    weights given their codes and scales back."""
    for t in params.values():
        scales = getattr(t, "row_scales", None)
        if scales is not None:
            t.CB, t.SCB = t, scales  # type: ignore[attr-defined]
    for m in model.modules():
        state = getattr(m, "state", None)
        if type(state).__name__ == "MatmulLtState":
            state.CB = state.SCB = None  # type: ignore[union-attr]


def _prime_dynamic_map() -> None:
    """bitsandbytes builds its 8-bit dynamic map on first use with ``.tolist()``, which a
    fake tensor cannot give: build it outside the fake mode first (functional.py,
    ``quantize_blockwise``: ``name2qmap["dynamic"] = create_dynamic_map()``)."""
    import bitsandbytes.functional as F

    if "dynamic" not in F.name2qmap:
        with torch._C._DisableTorchDispatch(), _no_fake_mode():
            F.name2qmap["dynamic"] = F.create_dynamic_map().to("cpu")


@contextlib.contextmanager
def _no_fake_mode() -> Iterator[None]:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def state_tensors(weight: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a quantized weight keeps beside its codes: the 4-bit quant state's
    maxima, code, offset and nested maxima and code; int8's row scales."""
    state = getattr(weight, "quant_state", None)
    if state is not None:
        found = [state.absmax, state.code]
        if state.nested:
            found += [state.offset, state.state2.absmax, state.state2.code]
        return [t for t in found if isinstance(t, torch.Tensor)]
    scales = getattr(weight, "row_scales", getattr(weight, "SCB", None))
    return [scales] if isinstance(scales, torch.Tensor) else []


def module_state_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every quantized weight's state tensors in ``model`` (for a real copy's resident
    bytes)."""
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if isinstance(weight, torch.Tensor):
            yield from state_tensors(weight)
        # Linear8bitLt moves the codes and scales from the weight to its MatmulLtState on
        # its first forward (init_8bit_state, bitsandbytes/nn/modules.py)
        state = getattr(m, "state", None)
        for name in ("CB", "SCB"):
            value = getattr(state, name, None)
            if isinstance(value, torch.Tensor):
                yield value


class DequantizingKernels(TorchDispatchMode):
    """During a profiling run, ``bitsandbytes::gemm_4bit`` as its CPU kernel computes it
    (``_gemm_4bit_default_impl``, bitsandbytes/backends/default/ops.py): the nested maxima
    dequantized and offset, the weight dequantized to the input's dtype, ``F.linear``; each
    op then reaches the recorder below this mode. LLM.int8's ops run as their kernels
    run them (:func:`_int8_kernels`): on the CPU each in torch ops; on CUDA, where
    ``int8_vectorwise_quant``, ``int8_linear_matmul`` and ``int8_mm_dequant`` have kernels of
    their own (bitsandbytes/backends/cuda/ops.py) that make their outputs (UNCONFIRMED on
    a GPU), only ``int8_scaled_mm``'s composition of them. Every other op passes through."""

    def __init__(self, cpu: bool = True) -> None:
        super().__init__()
        self._cpu = cpu
        self._kernels = _int8_kernels(cpu)
        count_bitsandbytes_matmuls()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.bitsandbytes.gemm_4bit.default:
            with self:  # its F.linear's matmul is decomposed too (below)
                return _gemm_4bit_cpu(*args, **kwargs)
        if func is _vectorwise_quant() and _threshold(args, kwargs) > 0:
            with self:  # the kernel's torch ops, recorded one by one
                return _int8_quant_no_outliers(args[0], _threshold(args, kwargs), self._cpu)
        if func is torch.ops.aten.matmul.default:
            # gemm_4bit's F.linear calls matmul below autograd, where its CompositeImplicit
            # kernel would pass the recorder whole and be decomposed by the fake mode
            # under it. Decomposed here, as the real kernel runs it (at::matmul folds the
            # rows into one mm: aten/src/ATen/native/LinearAlgebra.cpp, _matmul_impl), the
            # mm reaches the recorder, whose CPU probe measures the scratch the real bf16
            # mm allocates (oneDNN packing, not affine in the rows: 42,624 B for
            # 16 x 128 @ 128 x 64, the same up to 32 rows). A CPU kernel's effect:
            # device="cuda" probes nothing and counts the mm's output only (cuBLAS's
            # workspace is the extras' own line).
            return func.decompose(*args, **kwargs)
        key = self._kernels.get(func)
        if key is not None:  # the kernel the CPU runs, in torch ops (recorded one by one)
            with self:  # the bitsandbytes ops it calls are run as their kernels too
                return func._op_dk(key, *args, **kwargs)
        return func(*args, **kwargs)


def _vectorwise_quant() -> Any:
    try:
        return torch.ops.bitsandbytes.int8_vectorwise_quant.default
    except (AttributeError, RuntimeError):  # bitsandbytes' ops not registered
        return None


def _threshold(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    return float(kwargs.get("threshold", args[1] if len(args) > 1 else 0.0))


def _int8_quant_no_outliers(
    A: torch.Tensor, threshold: float, cpu: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``int8_vectorwise_quant`` with an outlier threshold, op for op, where no value of
    ``A`` reaches it (``outliers.any()`` False): the mask of the values at or above the
    threshold, held to the end as the kernel holds it, and an empty ``outlier_cols``.
    The CPU's kernel (bitsandbytes/backends/default/ops.py) computes the row maxima and
    codes in torch ops; CUDA's (backends/cuda/ops.py) makes them with
    ``cint8_vector_quant`` into ``torch.empty`` outputs. With ``outlier_cols`` empty,
    ``int8_mixed_scaled_mm`` is ``int8_scaled_mm`` and an empty ``subA``."""
    rows = A.numel() // A.shape[-1]
    if not cpu:
        row_stats = torch.empty(rows, device=A.device, dtype=torch.float32)
        out_row = torch.empty(A.shape, device=A.device, dtype=torch.int8)
    outliers = A.abs() >= threshold
    outliers.any()  # False where there are no outliers (the data-dependent branch)
    outlier_cols = torch.empty(0, device=A.device, dtype=torch.int64)
    if cpu:
        row_stats = torch.max(A.abs(), dim=1).values.float()
        out_row = torch.round(A * (127.0 / row_stats.unsqueeze(-1))).to(torch.int8)
    if rows > 1:
        out_row[:, outlier_cols] = 0
    del outliers
    return out_row, row_stats, outlier_cols


def _int8_kernels(cpu: bool) -> dict[Any, Any]:
    """LLM.int8's ops (no outlier split: threshold 0) and the dispatch key of the kernel
    each runs on the CPU, all written in torch ops: bitsandbytes/backends/default/ops.py
    (``int8_vectorwise_quant``, ``int8_scaled_mm``, ``int8_mm_dequant``) and
    backends/cpu/ops.py (``int8_linear_matmul``: ``torch._int_mm`` on AVX-512)."""
    try:
        ops = torch.ops.bitsandbytes
        default = torch._C.DispatchKey.CompositeExplicitAutograd
        matmul = ops.int8_linear_matmul.default
        has_cpu = torch._C._dispatch_has_kernel_for_dispatch_key(matmul.name(), "CPU")
        # int8_mixed_scaled_mm (an outlier threshold) has only its default kernel
        # (backends/default/ops.py), on CUDA too
        if not cpu:
            return {ops.int8_scaled_mm.default: default, ops.int8_mixed_scaled_mm.default: default}
        return {
            ops.int8_vectorwise_quant.default: default,
            ops.int8_scaled_mm.default: default,
            ops.int8_mixed_scaled_mm.default: default,
            ops.int8_mm_dequant.default: default,
            matmul: torch._C.DispatchKey.CPU if has_cpu else default,
        }
    except (AttributeError, RuntimeError):  # bitsandbytes' ops not registered
        return {}


def _gemm_4bit_cpu(
    A: torch.Tensor,
    B: torch.Tensor,
    shapeB: list[int],
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """bitsandbytes 0.50's ``_gemm_4bit_default_impl`` (backends/default/ops.py), op for
    op, with ``F.linear`` decomposed here, and its matmul by :class:`DequantizingKernels`,
    into the mm / addmm the recorder and its CPU workspace probes know (this runs below
    autograd, where no one else decomposes them)."""
    if absmax_8bit is not None:
        absmax = (
            torch.ops.bitsandbytes.dequantize_blockwise.default(
                absmax_8bit, absmax, absmax_code, 256, torch.float32
            )
            + absmax_offset
        )
    B_dq = torch.ops.bitsandbytes.dequantize_4bit.default(
        B, absmax, blocksize, quant_type, shapeB, A.dtype
    )
    return torch.ops.aten.linear.default.decompose(A, B_dq, bias)


def real_quantized(model: torch.nn.Module, weights: Weights) -> torch.nn.Module:
    """``model`` (a real copy, changed in place) with its Linear layers quantized by
    bitsandbytes as ``from_pretrained`` quantizes them: the modules replaced by
    ``replace_with_bnb_linear``, then each weight loaded into a new ``Params4bit`` /
    ``Int8Params`` with the meta one's settings and moved to the device the weight was on
    (the CPU or a GPU), which quantizes it (transformers/integrations/bitsandbytes.py,
    ``Bnb4bitQuantize.convert`` / ``Bnb8bitQuantize.convert``)."""
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D

    bnb = require_bitsandbytes()
    quantized_modules(model, weights)
    originals = {n: m for n, m in model.named_modules()}
    replace_with_bnb_linear(
        model,
        modules_to_not_convert=modules_kept(model, weights),
        quantization_config=bnb_config(weights),
    )
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit | bnb.nn.Linear8bitLt):
            continue
        old = originals[name]
        value = old.weight.detach()
        device = value.device
        if isinstance(old, Conv1D):
            value = value.T
        meta = module.weight
        if isinstance(module, bnb.nn.Linear4bit):
            new = bnb.nn.Params4bit(value.contiguous(), requires_grad=False, **meta.__dict__)
        else:
            kwargs = dict(meta.__dict__)
            kwargs.pop("SCB", None)
            new = bnb.nn.Int8Params(value.cpu(), requires_grad=False, **kwargs)
        module.weight = new.to(device)
        if old.bias is not None:
            module.bias = torch.nn.Parameter(old.bias.detach().clone(), requires_grad=False)
        # the AVX512-BF16 CPU repacking of inference weights is a CPU-only layout
        # (Linear4bit.forward, bitsandbytes/nn/modules.py): off, as on a GPU
        _no_cpu_repacking(module)
    return model


def _no_cpu_repacking(module: torch.nn.Module) -> None:
    """Linear4bit's inference on a CPU with AVX512-BF16 repacks the weight into a CPU-only
    layout on its first call (``Linear4bit.forward``, ``_convert_weight_packed_for_cpu``,
    bitsandbytes/nn/modules.py): turned off, so that the CPU step is the one a GPU runs."""
    if hasattr(module, "support_avx512bf16_for_cpu"):
        setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010


def qlora_wrapped(
    model: torch.nn.Module, rank: int, targets: tuple[str, ...] | None, dtype: str | None
) -> torch.nn.Module:
    """QLoRA's wrapping of a quantized copy: PEFT's ``prepare_model_for_kbit_training``
    (every parameter frozen, the fp16 / bf16 ones other than ``Params4bit`` cast to fp32:
    peft/utils/other.py), then ``get_peft_model`` (``step.lora_wrapped``). Its
    ``use_gradient_checkpointing`` (default True) turns on Hugging Face's checkpointing;
    here checkpointing is the ``checkpoint`` lever's, as for any model, so it is called
    with False."""
    import peft

    from .step import lora_wrapped

    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return lora_wrapped(model, rank, targets, dtype)


def kept_dtypes(
    model: torch.nn.Module, base_ids: set[int], qlora: bool, adapter_dtype: str | None
) -> dict[str, str]:
    """The parameters of a quantized (meta) copy that keep a dtype of their own whatever
    the precision, by qualified name (tied ones once), each cast to it in the copy:

    - a ``Linear4bit``'s bias: its forward casts it to the compute dtype in place
      (``bias.data = bias.data.to(x.dtype)``, bitsandbytes/nn/modules.py), so from the
      second step on it is held in that dtype;
    - with QLoRA, every other floating base parameter in fp32
      (``prepare_model_for_kbit_training``), and PEFT's adapters as ``lora_profile`` keeps
      them (their own dtype, or the precision's with ``lora_dtype="base"``)."""
    bnb = require_bitsandbytes()
    fixed: dict[str, str] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{prefix}.{leaf}" if prefix else leaf
            if is_quantized_param(p) or not p.is_floating_point():
                continue
            if isinstance(module, bnb.nn.Linear4bit) and leaf == "bias":
                dtype = module.compute_dtype or p.dtype
            elif qlora and id(p) in base_ids:
                dtype = torch.float32
            elif qlora and adapter_dtype != "base" and id(p) not in base_ids:
                dtype = p.dtype
            else:
                continue
            p.data = p.data.to(dtype)
            fixed[name] = str(dtype).removeprefix("torch.")
    return fixed
