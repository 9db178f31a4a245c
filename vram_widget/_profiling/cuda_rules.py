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

import contextlib
import dataclasses
import enum
import math
import re
import types as types_module
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "RULES",
    "CastPolicy",
    "CudaEmulation",
    "CudaTarget",
    "Rule",
    "SdpaBackend",
    "SdpaCall",
    "sdpa_backend_checked",
    "select_sdpa_backend",
]

# ``torch.overrides.redispatch_function`` (public; "skip one level of __torch_function__") lets a
# mode run a Python-level torch function's body with the mode still active, so nested torch calls
# are intercepted too. Older releases only have the private C entry point it wraps.
_redispatch: Callable[..., Any] | None = getattr(torch.overrides, "redispatch_function", None)
if _redispatch is None:  # pragma: no cover - torch releases without redispatch_function
    # TODO(lead): move to fake (private torch namespace)
    _redispatch = getattr(torch._C, "_skip_one_hop_torch_function", None)


def _installed_torch_version() -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:  # pragma: no cover - every release string starts with major.minor
        raise RuntimeError(f"cannot parse torch version {torch.__version__!r}")
    return int(match.group(1)), int(match.group(2))


# --------------------------------------------------------------------------------------------
# Target GPU
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CudaTarget:
    """The GPU and PyTorch release whose kernel choices are emulated.

    Parameters
    ----------
    sm
        Compute capability as ``10 * major + minor``: 80 (A100), 86/89 (RTX 30xx/40xx),
        90 (H100/H200), 100 (B200), 120 (RTX 50xx).
    torch_version
        ``(major, minor)`` of the PyTorch the user trains with; the installed one by default.
    prefer_cudnn_attention
        Whether SDPA tries cuDNN before flash. ``None`` derives it from ``sm`` and
        ``torch_version`` (fact sheet §1.2); set it to override (e.g. the env var
        ``TORCH_CUDNN_SDPA_PREFERRED`` on the user's machine).
    """

    sm: int = 90
    torch_version: tuple[int, int] = dataclasses.field(default_factory=_installed_torch_version)
    prefer_cudnn_attention: bool | None = None

    @property
    def major(self) -> int:
        return self.sm // 10

    @property
    def minor(self) -> int:
        return self.sm % 10

    @property
    def cudnn_attention_preferred(self) -> bool:
        """Whether SDPA's priority order puts cuDNN first (fact sheet §1.2).

        * <= 2.8: default order (flash, efficient, math, cudnn), so cuDNN is never picked. 2.5.0
          alone put cuDNN first on H100 (reverted in 2.5.1); ``(2, 5)`` cannot tell the patch
          releases apart and follows 2.5.1.
        * 2.9: cuDNN first on sm90/sm100 (minor 0) when the build's cuDNN >= 9.9 [sdp_utils.cpp
          · check_prefer_cudnn_attention, pytorch/pytorch PR 162073]; assumed true for the 2.9
          wheels.
        * 2.10: additionally needs runtime cuDNN > 9.15.0, which the 2.10 wheels do not bundle,
          so flash stays first.
        * >= 2.11: wheels bundle cuDNN >= 9.15.1: cuDNN first on major 9/10 with minor 0 or 3
          (pytorch/pytorch PR 171627 and issue 196678).
        """
        if self.prefer_cudnn_attention is not None:
            return self.prefer_cudnn_attention
        version = tuple(self.torch_version)
        if version >= (2, 11):
            return self.major in (9, 10) and self.minor in (0, 3)
        if version == (2, 9):
            return self.major in (9, 10) and self.minor == 0
        return False

    @property
    def flash_max_sm(self) -> int:
        # [sm80, sm121] in the 2.9-era sdp_utils.cpp read for the fact sheet; [sm80, sm90] in
        # older copies. The release that widened it is UNCONFIRMED (§1.3); 2.9 is assumed.
        return 121 if tuple(self.torch_version) >= (2, 9) else 90

    @property
    def cudnn_max_head_dim(self) -> int:
        # check_cudnn_tensor_shapes: 128, or 256 on sm90 (minor 0) with cuDNN >= 9.10, which the
        # 2.9+ wheels are assumed to bundle (UNCONFIRMED for 2.9; >= 9.15 from 2.11, §1.2).
        if self.major == 9 and self.minor == 0 and tuple(self.torch_version) >= (2, 9):
            return 256
        return 128


# --------------------------------------------------------------------------------------------
# Scaled dot-product attention
# --------------------------------------------------------------------------------------------


class SdpaBackend(str, enum.Enum):
    """The SDPA implementations CUDA chooses between (``sdp::SDPBackend``)."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    CUDNN = "cudnn"
    MATH = "math"


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """One emulated SDPA call, kept so the estimator can add the backward workspaces that the
    meta kernels do not allocate (fact sheet §1.4, last column)."""

    backend: SdpaBackend
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype
    dropout_p: float
    requires_grad: bool
    # True when the CUDA-only op could not run (real, non-fake CPU tensors) and the original
    # function ran instead: the trace then has CPU's choice, not CUDA's.
    fell_back: bool = False


_HALF = (torch.float16, torch.bfloat16)


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, same: bool) -> bool:
    # sdp_utils_cpp.h · check_batch_size_and_num_heads_dense<supports_gqa, requires_same_heads>
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if gqa:  # check_grouped_query_attention
        return q.size(1) % k.size(1) == 0 and k.size(1) == v.size(1)
    return not same or q.size(1) == k.size(1) == v.size(1)


def _common_fused_ok(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    ignore_singleton_dim: bool,
) -> bool:
    # sdp_utils_cpp.h · check_tensor_shapes (4-D), check_nonzero_sequence_lengths_dense,
    # check_last_dim_stride_equals_1_dense (GPU: the mask's last stride must be 1 too).
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if q.size(-2) == 0 or k.size(-2) == 0:
        return False
    strides_ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if ignore_singleton_dim:
        strides_ok = strides_ok or q.size(-1) == 1
    mask_ok = mask is None or mask.stride(-1) == 1
    return strides_ok and mask_ok


def _mask_shape_ok(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    # sdp_utils_cpp.h · check_attn_mask_shape (used by cuDNN)
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    if mask.size(-2) not in (q.size(2), 1) or mask.size(-1) not in (k.size(2), 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.size(0) in (1, q.size(0)) and mask.size(1) in (1, q.size(1))


def _same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Iterable) -> bool:
    # sdp_utils_cpp.h · check_tensor_dtype
    return q.dtype == k.dtype == v.dtype and q.dtype in tuple(allowed)


def _can_use_flash(
    t: CudaTarget,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    gqa: bool,
) -> bool:
    # cuda/sdp_utils.cpp · can_use_flash_attention (fact sheet §1.3)
    if not torch.backends.cuda.flash_sdp_enabled():  # check_runtime_disabled_flash
        return False
    if mask is not None:  # check_for_attn_mask
        return False
    if not _common_fused_ok(q, k, v, None, ignore_singleton_dim=True):
        return False
    d = q.size(-1)
    if not (d == k.size(-1) == v.size(-1) and d <= 256):  # check_head_dim_size_flash
        return False
    if not (80 <= t.sm <= t.flash_max_sm):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    small_smem = 86 <= t.sm <= 89 or 120 <= t.sm <= 121
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if small_smem and needs_grad and (192 < d <= 224 or (d > 224 and dropout_p > 0.0)):
        return False
    if is_causal and q.size(-2) != k.size(-2):  # check_flash_causal_non_square_seqlens
        return False
    # check_dtypes_low_precision
    if not _same_dtype(q, k, v, _HALF if t.major >= 8 else (torch.float16,)):
        return False
    return _heads_ok(q, k, v, gqa, same=True)


def _can_use_efficient(
    t: CudaTarget,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    gqa: bool,
) -> bool:
    # cuda/sdp_utils.cpp · can_use_mem_efficient_attention (fact sheet §1.3)
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return False
    if not (50 <= t.sm <= t.flash_max_sm):  # check_mem_efficient_hardware_support
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    # check_head_dim_size_mem_efficient with minimum_gemm_alignment: tensor cores on sm80+ (and
    # on sm7x for half) make it 128 / bits, i.e. 8 for fp16/bf16 and 4 for fp32.
    is_half = q.dtype in _HALF
    align = 1
    if t.major >= 8:
        align = 4
    if t.major >= 8 or (t.major >= 7 and is_half):
        align = max(align, 128 // (16 if is_half else 32))
    dq, dv = q.size(-1), v.size(-1)
    if not (dq == k.size(-1) and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    if not _common_fused_ok(q, k, v, mask, ignore_singleton_dim=False):
        return False
    # The 2.9-era copy rejects GQA here (check_batch_size_and_num_heads_dense<false>), and the
    # 2.13 meta backward fails on GQA shapes, so GQA with unequal heads falls to math (the
    # 2.13 F.scaled_dot_product_attention docstring agrees: "GQA ... currently works only for
    # Flash_attention and math kernel on CUDA tensor"). Hugging Face's repeat_kv path passes
    # equal heads, so it may take mem-eff while enable_gqa in fp32 runs math.
    if not _heads_ok(q, k, v, gqa=False, same=True):
        return False
    allowed = (*_HALF, torch.float32) if t.major >= 8 else (torch.float16, torch.float32)
    return _same_dtype(q, k, v, allowed)


def _can_use_cudnn(
    t: CudaTarget,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    gqa: bool,
) -> bool:
    # cuda/sdp_utils.cpp · can_use_cudnn_attention, check_cudnn_tensor_shapes (fact sheet §1.3)
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if torch.are_deterministic_algorithms_enabled() and not (
        torch.is_deterministic_algorithms_warn_only_enabled()
    ):  # check_cudnn_deterministic
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if not _same_dtype(q, k, v, _HALF if t.major >= 8 else (torch.float16,)):
        return False
    if not _mask_shape_ok(q, k, mask):
        return False
    if not 80 <= t.sm <= 121:
        return False
    if not _common_fused_ok(q, k, v, mask, ignore_singleton_dim=True):
        return False
    if not _heads_ok(q, k, v, gqa, same=False):
        return False
    d_qk, d_v = q.size(-1), v.size(-1)
    limit = t.cudnn_max_head_dim
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    return k.size(2) != 1  # "cudnn SDPA does not support key/value sequence length 1"


def select_sdpa_backend(
    target: CudaTarget,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> SdpaBackend:
    """The backend CUDA's ``select_sdp_backend`` picks for these inputs on ``target``.

    Walks the priority order (cuDNN first when :attr:`CudaTarget.cudnn_attention_preferred`,
    otherwise flash, efficient, math; fact sheet §1.2) and returns the first backend whose
    eligibility checks (§1.3, ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) pass.
    Runtime switches (``torch.backends.cuda.enable_*_sdp``, ``sdpa_kernel``) are honoured.
    Nested tensors are not modelled.
    """
    order = [SdpaBackend.FLASH, SdpaBackend.EFFICIENT, SdpaBackend.MATH]
    if target.cudnn_attention_preferred:
        order.insert(0, SdpaBackend.CUDNN)
    for backend in order:
        if backend is SdpaBackend.CUDNN:
            ok = _can_use_cudnn(target, query, key, value, attn_mask, enable_gqa)
        elif backend is SdpaBackend.FLASH:
            ok = _can_use_flash(
                target, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa
            )
        elif backend is SdpaBackend.EFFICIENT:
            ok = _can_use_efficient(target, query, key, value, attn_mask, enable_gqa)
        else:
            ok = True  # math always qualifies when enabled (checked by the caller's fallback)
        if ok:
            return backend
    return SdpaBackend.MATH  # pragma: no cover - MATH is last and always qualifies


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
        if autocast_dtype is not None and autocast_dtype not in _HALF:
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

KernelFn = Callable[[CudaEmulation, Callable[..., Any], Sequence[type], tuple, dict], Any]


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


def _bind(names: Sequence[str], defaults: dict[str, Any], args: tuple, kwargs: dict) -> dict:
    bound = dict(defaults)
    bound.update(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


# -- dropout --------------------------------------------------------------------------------

_DROPOUT_ARGS = ("input", "p", "training", "inplace")


def _dropout_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """``at::dropout`` takes ``native_dropout`` on CUDA when training with 0 < p < 1 and a
    non-empty input (``aten/src/ATen/native/Dropout.cpp · dropout, is_fused_kernel_acceptable``;
    fact sheet §2). Autograd then saves a bool mask instead of CPU's noise in the input dtype.
    ``inplace=True`` runs ``dropout_``, which never takes the fused path on CUDA either."""
    if func is torch.dropout:
        b = _bind(("input", "p", "train"), {}, args, kwargs)
        x, p, training, inplace = b["input"], b["p"], b["train"], False
    else:
        b = _bind(_DROPOUT_ARGS, {"p": 0.5, "training": True, "inplace": False}, args, kwargs)
        x, p, training, inplace = b["input"], b["p"], b["training"], b["inplace"]
    fused = (
        isinstance(x, torch.Tensor)
        and training
        and not inplace
        and isinstance(p, (int, float))
        and 0.0 < p < 1.0
        and x.numel() > 0
        and not x.is_nested
    )
    if not fused:
        return mode.passthrough(func, types, args, kwargs)
    return torch.native_dropout(x, float(p), True)[0]


# -- scaled dot-product attention ------------------------------------------------------------

_SDPA_ARGS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
_SDPA_DEFAULTS = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def _bool_mask_to_bias(mask: torch.Tensor | None, dtype: torch.dtype, fill: float) -> Any:
    # attention.cpp · convert_boolean_attn_mask (fill -inf) / convert_boolean_attn_mask_cudnn
    # (fill -65504): a new tensor of the mask's own shape in the query's dtype.
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # attention.cpp · preprocess_mask / aligned_tensor<8> / pad_bias<8>: an unaligned mask is
    # padded (a copy of the unexpanded mask) and sliced back, then expanded (a view).
    aligned = mask.stride(-1) == 1 and all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1))
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _pad_last_dim_8(t: torch.Tensor) -> torch.Tensor:
    # attention.cpp · pad_last_dim<8, false>: flash on CUDA pads the head dim to a multiple of 8,
    # and the flash op then saves the padded copies.
    rest = t.size(-1) % 8
    return t if rest == 0 else F.pad(t, (0, 8 - rest))


# check(backend, query, key, value, is_causal, enable_gqa), called on each emulated SDPA call
# once its backend is chosen and before it runs; it raises to refuse the call
SdpaCheck = Callable[[SdpaBackend, torch.Tensor, torch.Tensor, torch.Tensor, bool, bool], None]
_SDPA_CHECKS: list[SdpaCheck] = []


@contextlib.contextmanager
def sdpa_backend_checked(check: SdpaCheck) -> Iterator[None]:
    """Within the block, ``check`` sees the backend each emulated SDPA call picked (with
    its inputs, after autocast's casts) before the call runs, and may raise to refuse it:
    context parallelism's ring runs only some backends (``context_parallel.ring_attention``)."""
    _SDPA_CHECKS.append(check)
    try:
        yield
    finally:
        _SDPA_CHECKS.remove(check)


def _sdpa_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """The CUDA composite ``scaled_dot_product_attention`` (``aten/src/ATen/native/
    transformers/attention.cpp``), calling the backend op CUDA would pick (fact sheet §1)."""
    b = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, args, kwargs)
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    dropout_p, is_causal, scale, gqa = b["dropout_p"], b["is_causal"], b["scale"], b["enable_gqa"]
    if any(t.is_nested for t in (q, k, v)):
        return mode.passthrough(func, types, args, kwargs)
    backend = select_sdpa_backend(mode.target, q, k, v, mask, dropout_p, is_causal, gqa)
    for check in _SDPA_CHECKS:
        check(backend, q, k, v, bool(is_causal), bool(gqa))
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    aten = torch.ops.aten
    # GQA (enable_gqa, unequal heads): attention.cpp · scaled_dot_product_attention hands k/v
    # to the flash / cuDNN ops un-repeated (the kernels index k/v head h // (Hq / Hkv); the
    # FA2 mha_fwd check num_heads % num_heads_k == 0 is UNCONFIRMED here, read in no source
    # copy), so they save the Hkv-head k/v and no copy; only math repeat_interleaves k and v
    # (attention.cpp · _scaled_dot_product_attention_math, and the 2.13 docstring's
    # reference code). tests/test_cuda_rules.py works the bytes out per backend.
    extra = {"enable_gqa": True} if gqa else {}  # 2.4 ops have no enable_gqa argument
    try:
        if backend is SdpaBackend.CUDNN:
            bias = _bool_mask_to_bias(mask, q.dtype, -65504.0)
            out = aten._scaled_dot_product_cudnn_attention(
                q,
                k,
                v,
                attn_bias=bias,
                compute_log_sumexp=needs_grad,
                dropout_p=dropout_p,
                is_causal=is_causal,
                return_debug_mask=False,
                scale=scale,
            )[0]
        elif backend is SdpaBackend.FLASH:
            head_dim = q.size(-1)
            og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
            out = aten._scaled_dot_product_flash_attention(
                _pad_last_dim_8(q),
                _pad_last_dim_8(k),
                _pad_last_dim_8(v),
                dropout_p,
                is_causal,
                False,
                scale=og_scale,
            )[0]
            if out.size(-1) != head_dim:  # post_process_flash_output
                out = out[..., :head_dim]
        elif backend is SdpaBackend.EFFICIENT:
            bias = _bool_mask_to_bias(mask, q.dtype, float("-inf"))
            if bias is not None:
                bias = _preprocess_mask(bias, q, k)
            out = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
        else:
            # The math composite upcasts fp16/bf16 to fp32 on every device (§1.5). Calling it
            # directly avoids the CPU-only flash path that the original function could take.
            bias = _bool_mask_to_bias(mask, q.dtype, float("-inf"))
            out = aten._scaled_dot_product_attention_math(
                q, k, v, bias, dropout_p, is_causal, None, scale=scale, **extra
            )[0]
    except NotImplementedError:
        # Real CPU tensors: the fused ops have only CUDA and meta kernels (checked on 2.13).
        mode.sdpa_calls.append(_sdpa_record(backend, q, k, dropout_p, needs_grad, True))
        return mode.passthrough(func, types, args, kwargs)
    mode.sdpa_calls.append(_sdpa_record(backend, q, k, dropout_p, needs_grad, False))
    return out


def _sdpa_record(
    backend: SdpaBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    dropout_p: float,
    requires_grad: bool,
    fell_back: bool,
) -> SdpaCall:
    four_d = q.dim() == 4
    return SdpaCall(
        backend=backend,
        batch=int(q.size(0)),
        heads=int(q.size(1)) if four_d else 1,
        q_len=int(q.size(-2)),
        kv_len=int(k.size(-2)),
        head_dim=int(q.size(-1)),
        dtype=q.dtype,
        dropout_p=float(dropout_p),
        requires_grad=requires_grad,
        fell_back=fell_back,
    )


# -- softmax with half_to_float -------------------------------------------------------------


def _half_to_float_kernel(fused: Callable[..., torch.Tensor]) -> KernelFn:
    """``softmax``/``log_softmax`` of an fp16 CUDA tensor with ``dtype=float32`` call
    ``_softmax(x, dim, half_to_float=True)``: no fp32 copy of the input
    (``aten/src/ATen/native/SoftMax.cpp · softmax``; seen under fake-CUDA autocast, E3-style).
    bf16 is not special-cased there, so it converts first as on CPU."""

    def kernel(
        mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
    ) -> Any:
        b = _bind(("input", "dim", "dtype"), {"dtype": None}, args, kwargs)
        x, dim, dtype = b["input"], b.get("dim"), b["dtype"]
        if (
            isinstance(x, torch.Tensor)
            and x.dtype == torch.float16
            and dtype == torch.float32
            and isinstance(dim, int)
            and set(b) <= {"input", "dim", "dtype"}
        ):
            try:
                return fused(x, dim, True)
            except RuntimeError:
                pass  # real CPU tensors: "conversion is not supported on CPU"
        # A builtin: there are no nested torch calls for the mode to see.
        return func(*args, **kwargs)

    return kernel


# -- cross_entropy / nll_loss under autocast -------------------------------------------------

_CE_ARGS = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)
_CE_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
    "label_smoothing": 0.0,
}


def _legacy_reduction(size_average: bool | None, reduce: bool | None) -> str:
    # torch/nn/_reduction.py · legacy_get_string
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    if size_average and reduce:
        return "mean"
    return "sum" if reduce else "none"


_NLL_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_NLL_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
}


def _nll_loss_direct(args: tuple, kwargs: dict) -> bool:
    # nll_loss_nd calls nll_loss (1-D, 2-D) or nll_loss2d (4-D) directly on its input.
    x = args[0] if args else kwargs.get("input")
    return isinstance(x, torch.Tensor) and x.dim() in (1, 2, 4)


def _nll_loss_nd_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """``nll_loss_nd`` (``LossNLL.cpp``) reshapes 3-D and >4-D inputs to 4-D *before* the
    autocast-listed ``nll_loss2d`` casts them, so the cast is of the contiguous 4-D view."""
    if _nll_loss_direct(args, kwargs):
        return func(*args, **kwargs)  # the fp32 policy has already cast the inputs
    b = _bind(_NLL_ARGS, _NLL_DEFAULTS, args, kwargs)
    x, target = b["input"], b["target"]
    reduction = b["reduction"]
    if b["size_average"] is not None or b["reduce"] is not None:
        reduction = _legacy_reduction(b["size_average"], b["reduce"])
    n, c = x.size(0), x.size(1)
    out_size = (n, *x.shape[2:])
    x = x.contiguous()
    target = target.contiguous()
    x = x.view(n, c, 1, -1) if x.numel() > 0 else x.view(n, c, 0, 0)
    target = target.view(n, 1, -1) if target.numel() > 0 else target.view(n, 0, 0)
    with mode:
        out = F.nll_loss(
            x, target, b["weight"], ignore_index=b["ignore_index"], reduction=reduction
        )
    return out if reduction != "none" else out.view(out_size)


def _cross_entropy_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """``cross_entropy_loss`` is **not** in CUDA's autocast lists, so CUDA's autocast sees the
    ops of its decomposition (``aten/src/ATen/native/LossNLL.cpp · cross_entropy_loss_symint``):
    ``log_softmax(x, dtype=x.dtype)`` stays in the input dtype (set_opt_dtype keeps it) and
    ``nll_loss`` (fp32 list) casts that to fp32 and saves the copy (fact sheet §5, E3).
    The decomposition is re-run in Python with this mode active so each op gets its policy."""
    b = _bind(_CE_ARGS, _CE_DEFAULTS, args, kwargs)
    x, target, weight = b["input"], b["target"], b["weight"]
    reduction = b["reduction"]
    if b["size_average"] is not None or b["reduce"] is not None:
        reduction = _legacy_reduction(b["size_average"], b["reduce"])
    ignore_index, smoothing = b["ignore_index"], float(b["label_smoothing"])
    with mode:
        class_dim = 0 if x.dim() == 1 else 1
        if x.shape == target.shape:
            return _ce_prob_target(x, target, weight, reduction, smoothing, class_dim)
        log_probs = torch.log_softmax(x, class_dim, dtype=x.dtype)
        nll = F.nll_loss(log_probs, target, weight, ignore_index=ignore_index, reduction=reduction)
        if smoothing <= 0.0:
            return nll
        return _ce_label_smoothing(
            log_probs, nll, target, weight, reduction, ignore_index, smoothing, class_dim
        )


def _ce_prob_target(
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: str,
    smoothing: float,
    class_dim: int,
) -> torch.Tensor:
    # LossNLL.cpp · cross_entropy_loss_prob_target
    n_classes = x.size(class_dim)
    log_probs = torch.log_softmax(x, class_dim, dtype=x.dtype)
    if smoothing > 0.0:
        target = target * (1 - smoothing) + smoothing / n_classes
    product = log_probs * target
    if weight is not None:
        shape = [1] * log_probs.dim()
        if log_probs.dim() > 1:
            shape[1] = weight.size(0)
            product = product * weight.view(shape)
        else:
            product = product * weight
    if reduction == "mean":
        return -product.sum() / (log_probs.numel() / n_classes)
    if reduction == "sum":
        return -product.sum()
    return -product.sum(class_dim)


def _ce_label_smoothing(
    log_probs: torch.Tensor,
    nll: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    smoothing: float,
    class_dim: int,
) -> torch.Tensor:
    # LossNLL.cpp · cross_entropy_loss_label_smoothing (the tensor-subclass branch for the
    # weighted mean, which avoids a data-dependent masked_select and computes the same value).
    n_classes = log_probs.size(class_dim)
    if weight is not None:
        shape = [1] * log_probs.dim()
        shape[class_dim] = weight.size(0)
        smooth = -(log_probs * weight.view(shape)).sum(class_dim)
    else:
        smooth = -log_probs.sum(class_dim)
    ignore_mask = target == ignore_index
    smooth.masked_fill_(ignore_mask, 0.0)
    if reduction == "mean":
        # The divisor first: the order in which CUDA's (GCC-built) code evaluates the operands.
        if weight is not None:
            filtered = target.masked_fill(ignore_mask, 0)
            weights = weight.gather(0, filtered.flatten()).masked_fill_(ignore_mask.flatten(), 0)
            divisor = weights.sum()
        else:
            divisor = (~ignore_mask).sum()
        ret = smooth.sum() / divisor
    elif reduction == "sum":
        ret = smooth.sum()
    else:
        ret = smooth
    return (1 - smoothing) * nll + ret * (smoothing / n_classes)


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
        kernel=_nll_loss_nd_kernel,
        autocast_only=True,
        when=_nll_loss_direct,
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
        kernel=_half_to_float_kernel(torch._softmax),
        dtype_pos=2,
        source=_AUTOCAST_SRC.format("FP32_SET_OPT_DTYPE") + "; SoftMax.cpp · softmax",
    ),
)
_register(
    _apis("torch.log_softmax", "Tensor.log_softmax", "special.log_softmax"),
    Rule(
        policy=CastPolicy.FP32_SET_OPT_DTYPE,
        kernel=_half_to_float_kernel(torch._log_softmax),
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
        kernel=_cross_entropy_kernel,
        autocast_only=True,
        source="LossNLL.cpp · cross_entropy_loss_symint; fact sheet §5",
    ),
)

# Dropout: F.dropout (nn.Dropout) and torch.dropout. dropout1d/2d/3d (feature_dropout) and
# alpha_dropout never take the fused path (Dropout.cpp): no rule, CPU == CUDA.
_register(
    _apis("F.dropout", "torch.dropout"),
    Rule(kernel=_dropout_kernel, source="Dropout.cpp · dropout; fact sheet §2"),
)

# Attention: backend choice after the lower-precision cast registered above.
_register(
    _apis("F.scaled_dot_product_attention"),
    Rule(kernel=_sdpa_kernel, source="transformers/attention.cpp; sdp_utils.cpp; fact sheet §1"),
)
