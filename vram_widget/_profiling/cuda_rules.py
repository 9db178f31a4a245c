"""CUDA's kernel choices, emulated on CPU (fake) tensors.

On a CPU-only torch build a fake CUDA tensor that requires grad aborts the whole process
(``docs/cuda-semantics.md`` §0 and E1), so ``device="cuda"`` estimates trace the step on
**CPU** fake tensors. The CPU kernels then allocate differently from CUDA's (fact sheet §0), and
:class:`CudaEmulation` puts CUDA's choices back. It is a
:class:`torch.overrides.TorchFunctionMode`, i.e. it works *above* autograd: it calls the ops
CUDA would call, so autograd records the backward nodes, and the saved tensors, that a CUDA
step records.

The rules live in one registry, :data:`RULES` (public torch function -> :class:`Rule`):

* dropout -> fused ``native_dropout`` with a 1-byte mask (fact sheet §2);
* ``scaled_dot_product_attention`` -> the backend CUDA picks for the target GPU (§1.2-§1.4);
* CUDA's autocast policy (lower precision / fp32 / fp32-set-opt-dtype / promote / banned),
  with the weight-cast cache (§4), when an ``autocast_dtype`` is given; the caller does **not**
  enable CPU autocast;
* ``softmax``/``log_softmax`` of fp16 with ``dtype=float32`` -> CUDA's ``half_to_float`` kernel.

The kernels a rule runs are in :mod:`.cuda_kernels`; the target GPU and its attention backend
choice in :mod:`.cuda_sdpa`.

Everything else runs unchanged. Functions without a rule are re-dispatched with the mode still
active, so that the torch functions *they* call (e.g. the ``F.linear`` inside
``F.multi_head_attention_forward``) are seen too, exactly as CUDA's dispatcher sees them.

What this module does not model (documented, not emulated): the backward workspaces of the fused
attention kernels (flash ``dq_accum``/``softmax_d``, mem-eff gQ workspace; §1.4), which meta
kernels do not allocate; cuDNN RNN's flat-weight copy; the dropout inside the *math* attention
path (it runs in C++, below this mode, so it keeps CPU's noise tensor); aten composites other
than ``cross_entropy``/``nll_loss``/``linalg.norm`` whose inner calls CUDA's autocast would see.
"""

from __future__ import annotations

import dataclasses
import enum
import types as types_module
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .cuda_kernels import (
    KernelFn,
    cross_entropy_kernel,
    dropout_kernel,
    half_to_float_kernel,
    nll_loss_direct,
    nll_loss_nd_kernel,
    sdpa_kernel,
)
from .cuda_sdpa import HALF_DTYPES, CudaTarget, SdpaCall

__all__ = [
    "RULES",
    "CastPolicy",
    "CudaEmulation",
    "Rule",
]

# ``torch.overrides.redispatch_function`` (public; "skip one level of __torch_function__") lets a
# mode run a Python-level torch function's body with the mode still active, so nested torch calls
# are intercepted too. Older releases only have the private C entry point it wraps.
_redispatch: Callable[..., Any] | None = getattr(torch.overrides, "redispatch_function", None)
if _redispatch is None:  # pragma: no cover - torch releases without redispatch_function
    _redispatch = getattr(torch._C, "_skip_one_hop_torch_function", None)


# --------------------------------------------------------------------------------------------
# Autocast policy
# --------------------------------------------------------------------------------------------


class CastPolicy(enum.Enum):
    """CUDA autocast's cast policies (``aten/src/ATen/autocast_mode.h · CastPolicy``)."""

    LOWER_PRECISION = "lower_precision_fp"
    FP32 = "fp32"
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    PROMOTE = "promote"
    BANNED = "banned"


def _eligible(t: Any) -> bool:
    # autocast_mode.h · is_eligible: a defined floating tensor on the autocast device, not fp64.
    # Every CPU tensor here stands in for a CUDA tensor, so the device test is dropped.
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    # cached_cast is applied to every Tensor, Tensor? and TensorList argument (autocast_mode.h).
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _iter_tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
    "(emulated CUDA autocast; aten/src/ATen/autocast_mode.cpp · binary_cross_entropy_banned). "
    "Many models use a sigmoid layer right before the binary cross entropy layer. In this case, "
    "combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits or "
    "torch.nn.BCEWithLogitsLoss, which are safe to autocast."
)


# --------------------------------------------------------------------------------------------
# The mode
# --------------------------------------------------------------------------------------------


class CudaEmulation(TorchFunctionMode):
    """Make a forward on CPU (fake) tensors allocate and save what a CUDA forward would.

    Parameters
    ----------
    target
        The GPU / PyTorch release emulated; ``CudaTarget()`` (H100, installed torch) by default.
    autocast_dtype
        ``torch.float16`` or ``torch.bfloat16`` to apply CUDA's autocast policy (the caller must
        *not* enable CPU autocast), or ``None`` for no autocast.
    cache_enabled
        Autocast's weight-cast cache (``torch.autocast(cache_enabled=...)``).

    Notes
    -----
    Enter it around the forward (and around anything that re-runs the forward, such as a
    checkpoint recompute during backward). The weight-cast cache is cleared when the outermost
    ``with`` exits, as ``torch.autocast.__exit__`` does (fact sheet §4.2), so enter it once per
    autocast region. While active with an ``autocast_dtype`` it also sets CUDA's autocast flags
    (``torch.set_autocast_enabled("cuda", True)``), which do not touch CPU tensors, so model code
    that asks ``torch.is_autocast_enabled()`` sees what it would see on CUDA, and a user
    ``torch.autocast("cuda", enabled=False)`` region switches the emulated casts off.

    The fused attention ops exist only as CUDA kernels and meta kernels: on real (non-fake) CPU
    tensors the attention rule falls back to the original function and records
    ``fell_back=True`` in :attr:`sdpa_calls`.
    """

    def __init__(
        self,
        target: CudaTarget | None = None,
        autocast_dtype: torch.dtype | None = None,
        *,
        cache_enabled: bool = True,
    ) -> None:
        super().__init__()
        if autocast_dtype is not None and autocast_dtype not in HALF_DTYPES:
            raise ValueError(f"autocast_dtype must be float16 or bfloat16, not {autocast_dtype}")
        self.target = target if target is not None else CudaTarget()
        self.autocast_dtype = autocast_dtype
        self.cache_enabled = cache_enabled
        self.sdpa_calls: list[SdpaCall] = []
        self._depth = 0
        self._passthrough_stack: list[Callable[..., Any]] = []
        self._cast_cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._saved_autocast_state: tuple[bool, torch.dtype] | None = None

    # -- enter / exit ---------------------------------------------------------------------

    def __enter__(self) -> CudaEmulation:
        if self._depth == 0 and self.autocast_dtype is not None:
            self._saved_autocast_state = _set_cuda_autocast(True, self.autocast_dtype)
        self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)
        self._depth -= 1
        if self._depth == 0:
            # torch.autocast.__exit__ clears the cast cache when the outermost region exits
            # (torch/amp/autocast_mode.py; fact sheet §4.2).
            self.clear_cast_cache()
            if self._saved_autocast_state is not None:
                _set_cuda_autocast(*self._saved_autocast_state)
                self._saved_autocast_state = None

    def clear_cast_cache(self) -> None:
        """Drop the cached weight casts, as ``torch.clear_autocast_cache()`` does.

        The outermost exit does this. Call it where CUDA would leave an autocast region while
        this mode stays active, e.g. after each checkpoint recompute during backward (the
        recompute runs in its own ``torch.autocast`` region; fact sheet §7).
        """
        self._cast_cache.clear()

    # -- dispatch -------------------------------------------------------------------------

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        rule = RULES.get(func)
        if rule is None:
            return self.passthrough(func, types, args, kwargs)
        return rule(self, func, types, tuple(args), kwargs)

    def passthrough(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run ``func`` unchanged, with this mode active for the torch calls inside it."""
        if not isinstance(func, types_module.FunctionType):
            # A C function or method (torch.add, Tensor.view, a property getter) calls no
            # Python torch function inside: nothing nested to see, so skip the re-dispatch,
            # which costs more than the call itself (most calls of a model are these).
            return func(*args, **kwargs)
        if _redispatch is None or (self._passthrough_stack and self._passthrough_stack[-1] is func):
            # A Python Tensor method that calls ``super().method()`` (Tensor.unflatten,
            # Tensor.split, ...) reaches the mode again under the same public function: that
            # inner call is the C implementation, with nothing nested to see. Re-dispatching it
            # would recurse forever. (Without redispatch_function nested calls go unseen.)
            return func(*args, **kwargs)
        self._passthrough_stack.append(func)
        try:
            with self:
                return _redispatch(func, types, tuple(args), kwargs)
        finally:
            self._passthrough_stack.pop()

    # -- autocast helpers -----------------------------------------------------------------

    @property
    def autocast_active(self) -> bool:
        """Whether the emulated CUDA autocast applies to the next call."""
        if self.autocast_dtype is None:
            return False
        try:
            return bool(torch.is_autocast_enabled("cuda"))
        except TypeError:  # pragma: no cover - torch < 2.4 has no device argument
            return True

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``cached_cast`` (``aten/src/ATen/autocast_mode.cpp``; fact sheet §4.2).

        Casts an eligible tensor to ``dtype``. A cast to the autocast dtype of an fp32 leaf that
        requires grad and is not a view (a parameter) is cached until the outermost region
        exits, so a weight used twice is cast once.
        """
        if not _eligible(tensor) or tensor.dtype == dtype:
            return tensor
        can_cache = (
            self.cache_enabled
            and dtype == self.autocast_dtype
            and tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not tensor._is_view()
            and not torch.is_inference_mode_enabled()
        )
        if not can_cache:
            return tensor.to(dtype)
        entry = self._cast_cache.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        casted = tensor.to(dtype)
        self._cast_cache[id(tensor)] = (weakref.ref(tensor), casted)
        return casted


def _set_cuda_autocast(enabled: bool, dtype: torch.dtype) -> tuple[bool, torch.dtype]:
    """Set CUDA's autocast flags; return the previous ones. CPU tensors ignore these flags."""
    try:
        previous = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
    except (TypeError, AttributeError):  # pragma: no cover - torch < 2.4
        return (False, dtype)
    return previous


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """What :class:`CudaEmulation` does for one torch function.

    Attributes
    ----------
    policy
        CUDA autocast's cast policy for the op, applied first when autocast is emulated.
    kernel
        The CUDA kernel choice, run after the casts; ``None`` calls the function itself.
    dtype_pos
        Positional index of the ``dtype`` argument for ``FP32_SET_OPT_DTYPE`` ops that accept it
        positionally (``softmax(input, dim, dtype)``); keyword-only elsewhere.
    autocast_only
        The kernel is an autocast decomposition (``cross_entropy``) and runs only under
        emulated autocast.
    when
        Extra predicate on ``(args, kwargs)`` for the policy (``interpolate``: not ``"area"``).
    source
        Where the rule comes from.
    """

    policy: CastPolicy | None = None
    kernel: KernelFn | None = None
    dtype_pos: int | None = None
    autocast_only: bool = False
    when: Callable[[tuple, dict], bool] | None = None
    source: str = ""

    def __call__(
        self,
        mode: CudaEmulation,
        func: Callable[..., Any],
        types: Sequence[type],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        applied = False
        if (
            self.policy is not None
            and mode.autocast_active
            and "out" not in kwargs  # out= overloads are not autocast ops
            and (self.when is None or self.when(args, kwargs))
        ):
            args, kwargs = _apply_policy(mode, self.policy, args, kwargs, self.dtype_pos)
            applied = True
        if self.kernel is not None and (not self.autocast_only or mode.autocast_active):
            return self.kernel(mode, func, types, args, kwargs)
        if applied:
            # A listed op: CUDA runs its inner ops with autocast excluded
            # (ExcludeDispatchKeyGuard in autocast_mode.h), as this mode does for calls made
            # inside __torch_function__.
            return func(*args, **kwargs)
        return mode.passthrough(func, types, args, kwargs)


def _apply_policy(
    mode: CudaEmulation,
    policy: CastPolicy,
    args: tuple,
    kwargs: dict,
    dtype_pos: int | None,
) -> tuple[tuple, dict]:
    """The autocast wrappers of ``aten/src/ATen/autocast_mode.h`` (WrapFunction_)."""
    lower = mode.autocast_dtype
    assert lower is not None
    if policy is CastPolicy.BANNED:
        raise RuntimeError(_BCE_BANNED)
    if policy is CastPolicy.FP32_SET_OPT_DTYPE:
        # firstarg_is_eligible, then set_opt_dtype: keep an explicitly passed dtype.
        if not (args and _eligible(args[0])):
            return args, kwargs
        if dtype_pos is not None and len(args) > dtype_pos:
            if args[dtype_pos] is None:
                args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1 :])
            return args, kwargs
        if kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": torch.float32}
        return args, kwargs
    if policy is CastPolicy.LOWER_PRECISION:
        to_type = lower
    elif policy is CastPolicy.FP32:
        to_type = torch.float32
    else:  # PROMOTE: autocast_mode.h · promote_type / prioritize -- fp32 wins over half
        wide = any(
            _eligible(t) and t.dtype == torch.float32
            for t in _iter_tensors((*args, *kwargs.values()))
        )
        to_type = torch.float32 if wide else lower

    def cast(t: torch.Tensor) -> torch.Tensor:
        return mode.cast(t, to_type)

    new_args = tuple(_map_tensors(a, cast) for a in args)
    new_kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
    return new_args, new_kwargs


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

RULES: dict[Callable[..., Any], Rule] = {}
"""Public torch function -> what :class:`CudaEmulation` does for it."""


def _register(apis: Iterable[Any], rule: Rule) -> None:
    for api in apis:
        if api is None:  # not in this torch release
            continue
        old = RULES.get(api)
        if old is None:
            RULES[api] = rule
        else:  # merge an autocast policy and a kernel registered separately
            RULES[api] = dataclasses.replace(
                old,
                policy=rule.policy or old.policy,
                kernel=rule.kernel or old.kernel,
                dtype_pos=rule.dtype_pos if rule.dtype_pos is not None else old.dtype_pos,
                autocast_only=rule.autocast_only or old.autocast_only,
                when=rule.when or old.when,
                source="; ".join(s for s in (old.source, rule.source) if s),
            )


def _apis(*names: str) -> list[Any]:
    """Resolve ``"torch.mm"``, ``"Tensor.mm"``, ``"F.linear"``, ``"linalg.norm"``,
    ``"special.expm1"``; names missing from this release resolve to ``None``."""
    spaces = {
        "torch": torch,
        "Tensor": torch.Tensor,
        "F": F,
        "linalg": torch.linalg,
        "special": torch.special,
    }
    out = []
    for name in names:
        space, _, attr = name.partition(".")
        out.append(getattr(spaces[space], attr, None))
    return out


def _both(*ops: str) -> list[str]:
    """``torch.op`` and ``Tensor.op`` for each op."""
    return [f"{space}.{op}" for op in ops for space in ("torch", "Tensor")]


_AUTOCAST_SRC = "aten/src/ATen/autocast_mode.h · AT_FORALL_{} (CUDA); fact sheet §4.1"

# Lower precision (AT_FORALL_LOWER_PRECISION_FP). lstm/gru/rnn_*: CUDA's cuDNN RNN casts in
# aten/src/ATen/cudnn/AutocastRNN.cpp · _cudnn_rnn_cast_reflatten (assumed, not verifiable on a
# CPU build; its flat-weight copy is not modelled).
_register(
    _apis(
        "torch._convolution",
        "torch.convolution",
        *[f"{s}.conv{d}" for s in ("torch", "F") for d in ("1d", "2d", "3d", "_tbc")],
        *[f"{s}.conv_transpose{d}d" for s in ("torch", "F") for d in (1, 2, 3)],
        "torch.prelu",
        "Tensor.prelu",
        "F.prelu",
        *_both("addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm"),
        "Tensor.__matmul__",
        "torch.einsum",
        "linalg.vecdot",
        "F.linear",
        "torch.chain_matmul",
        "linalg.multi_dot",
        "torch.lstm_cell",
        "torch.gru_cell",
        "torch.rnn_tanh_cell",
        "torch.rnn_relu_cell",
        "torch.lstm",
        "torch.gru",
        "torch.rnn_tanh",
        "torch.rnn_relu",
        "torch._scaled_dot_product_flash_attention",
        "F.scaled_dot_product_attention",
    ),
    Rule(policy=CastPolicy.LOWER_PRECISION, source=_AUTOCAST_SRC.format("LOWER_PRECISION_FP")),
)

# fp32 (AT_FORALL_FP32). The F.* wrappers stand for ops only reachable through torch._C._nn.
_register(
    _apis(
        *_both("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2"),
        *_both("log1p", "reciprocal", "rsqrt", "sinh", "tan", "pow", "dist", "renorm"),
        *_both("logsumexp"),
        "special.erfinv",
        "special.expm1",
        "special.log1p",
        "special.logsumexp",
        "F.softplus",
        "torch.layer_norm",
        "torch.native_layer_norm",
        "torch.rms_norm",
        "torch.group_norm",
        "torch.frobenius_norm",
        "torch.nuclear_norm",
        "torch.cosine_similarity",
        "F.cosine_similarity",
        "torch.poisson_nll_loss",
        "torch.cosine_embedding_loss",
        "torch.hinge_embedding_loss",
        "torch.kl_div",
        "torch.margin_ranking_loss",
        "torch.triplet_margin_loss",
        "torch.binary_cross_entropy_with_logits",
        "F.l1_loss",
        "F.smooth_l1_loss",
        "F.huber_loss",
        "F.mse_loss",
        "F.multilabel_margin_loss",
        "F.soft_margin_loss",
        "F.multi_margin_loss",
        "torch.pdist",
        "F.pdist",
        "torch.cdist",
    ),
    Rule(policy=CastPolicy.FP32, source=_AUTOCAST_SRC.format("FP32")),
)

# nll_loss / nll_loss2d are in the fp32 list; F.nll_loss reaches them through nll_loss_nd.
_register(
    _apis("F.nll_loss"),
    Rule(
        policy=CastPolicy.FP32,
        kernel=nll_loss_nd_kernel,
        autocast_only=True,
        when=nll_loss_direct,
        source=_AUTOCAST_SRC.format("FP32") + "; LossNLL.cpp · nll_loss_nd_symint",
    ),
)

# upsample_* / _upsample_*_aa are in the fp32 list; F.interpolate reaches them for every mode
# except "area", which is adaptive_avg_pool (in no list).
_register(
    _apis("F.interpolate"),
    Rule(
        policy=CastPolicy.FP32,
        when=lambda args, kwargs: (
            (args[3] if len(args) > 3 else kwargs.get("mode", "nearest")) != "area"
        ),
        source=_AUTOCAST_SRC.format("FP32") + " (upsample_*)",
    ),
)

# fp32_set_opt_dtype (AT_FORALL_FP32_SET_OPT_DTYPE). linalg.norm is a composite whose inner
# linalg_vector_norm / linalg_matrix_norm get the policy on CUDA: same effect.
_register(
    _apis(
        *_both("prod", "cumprod", "cumsum", "sum"),
        "linalg.vector_norm",
        "linalg.matrix_norm",
        "linalg.norm",
    ),
    Rule(policy=CastPolicy.FP32_SET_OPT_DTYPE, source=_AUTOCAST_SRC.format("FP32_SET_OPT_DTYPE")),
)
_register(
    _apis("torch.softmax", "Tensor.softmax", "special.softmax"),
    Rule(
        policy=CastPolicy.FP32_SET_OPT_DTYPE,
        kernel=half_to_float_kernel(torch._softmax),
        dtype_pos=2,
        source=_AUTOCAST_SRC.format("FP32_SET_OPT_DTYPE") + "; SoftMax.cpp · softmax",
    ),
)
_register(
    _apis("torch.log_softmax", "Tensor.log_softmax", "special.log_softmax"),
    Rule(
        policy=CastPolicy.FP32_SET_OPT_DTYPE,
        kernel=half_to_float_kernel(torch._log_softmax),
        dtype_pos=2,
        source=_AUTOCAST_SRC.format("FP32_SET_OPT_DTYPE") + "; SoftMax.cpp · log_softmax",
    ),
)

# promote (AT_FORALL_PROMOTE). arctan2 is a composite alias of atan2.
_register(
    _apis(
        *_both("addcdiv", "addcmul", "atan2", "arctan2", "cross", "dot", "vdot"),
        *_both("index_put", "scatter_add"),
        "torch.bilinear",
        "F.bilinear",
        "torch.grid_sampler",
        "torch.tensordot",
    ),
    Rule(policy=CastPolicy.PROMOTE, source=_AUTOCAST_SRC.format("PROMOTE")),
)

# binary_cross_entropy raises under CUDA autocast.
_register(
    _apis("F.binary_cross_entropy"),
    Rule(
        policy=CastPolicy.BANNED,
        source="aten/src/ATen/autocast_mode.cpp · binary_cross_entropy_banned",
    ),
)

# cross_entropy: not listed on CUDA (it is on CPU); emulate its decomposition under autocast.
_register(
    _apis("F.cross_entropy"),
    Rule(
        kernel=cross_entropy_kernel,
        autocast_only=True,
        source="LossNLL.cpp · cross_entropy_loss_symint; fact sheet §5",
    ),
)

# Dropout: F.dropout (nn.Dropout) and torch.dropout. dropout1d/2d/3d (feature_dropout) and
# alpha_dropout never take the fused path (Dropout.cpp): no rule, CPU == CUDA.
_register(
    _apis("F.dropout", "torch.dropout"),
    Rule(kernel=dropout_kernel, source="Dropout.cpp · dropout; fact sheet §2"),
)

# Attention: backend choice after the lower-precision cast registered above.
_register(
    _apis("F.scaled_dot_product_attention"),
    Rule(kernel=sdpa_kernel, source="transformers/attention.cpp; sdp_utils.cpp; fact sheet §1"),
)
