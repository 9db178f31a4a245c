"""The GPU whose kernel choices are emulated (:class:`CudaTarget`: its compute capability and
the PyTorch release), and the scaled dot-product attention backend CUDA picks there
(:func:`select_sdpa_backend`, fact sheet §1.2-§1.4): rules on the tensors' shapes, dtypes and
strides, read from ``sdp_utils.cpp``, which :mod:`.cuda_kernels` follows when it runs the
attention :class:`~.cuda_rules.CudaEmulation` intercepts."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable

import torch

__all__ = ["HALF_DTYPES", "CudaTarget", "SdpaBackend", "SdpaCall", "select_sdpa_backend"]


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


# the half-precision dtypes (autocast's lower precisions; the fused kernels' inputs)
HALF_DTYPES = (torch.float16, torch.bfloat16)


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
    if not _same_dtype(q, k, v, HALF_DTYPES if t.major >= 8 else (torch.float16,)):
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
    is_half = q.dtype in HALF_DTYPES
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
    allowed = (*HALF_DTYPES, torch.float32) if t.major >= 8 else (torch.float16, torch.float32)
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
    if not _same_dtype(q, k, v, HALF_DTYPES if t.major >= 8 else (torch.float16,)):
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
