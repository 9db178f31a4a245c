"""CUDA kernel-choice emulation on CPU (fake) tensors: ``vram_widget._profiling.cuda_rules``.

References are the fact sheet ``docs/cuda-semantics.md`` and, where this CPU-only build
can show it, PyTorch itself: fake CUDA tensors with CUDA's autocast flag and no grad run CUDA's
real autocast wrappers and CUDA's ``at::dropout`` branch (fact sheet E3), so the emulation is
compared op by op against them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from vram_widget._profiling.cuda_rules import RULES, CastPolicy, CudaEmulation
from vram_widget._profiling.cuda_sdpa import CudaTarget, SdpaBackend, select_sdpa_backend

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

Saved = list[tuple[tuple[int, ...], torch.dtype, torch.Tensor]]


@contextlib.contextmanager
def saved_tensors() -> Iterator[Saved]:
    """Collect (shape, dtype, tensor) of everything autograd saves inside the block."""
    out: Saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        out.append((tuple(t.shape), t.dtype, t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


class OpLog(TorchDispatchMode):
    """Aten ops run, as (op name without overload, output dtypes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.namespace != "prim":
            flat = out if isinstance(out, (tuple, list)) else (out,)
            dtypes = tuple(str(o.dtype) for o in flat if isinstance(o, torch.Tensor))
            self.ops.append((func.overloadpacket.__name__, dtypes))
        return out


class CopyCount(TorchDispatchMode):
    """How many ``aten._to_copy`` (dtype casts) run."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._to_copy.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_autocast_flags(dtype: torch.dtype) -> Iterator[None]:
    """CUDA's autocast on fake CUDA tensors (E3): ``torch.autocast("cuda")`` refuses on a
    CPU-only build, but the flags drive the AutocastCUDA dispatch key all the same."""
    previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", previous[0])
        torch.set_autocast_dtype("cuda", previous[1])


def trace(
    fn: Callable[..., Any],
    make_inputs: Callable[[str], tuple],
    autocast: torch.dtype | None,
    *,
    emulate: bool,
) -> tuple[Any, list[tuple[str, tuple[str, ...]]]]:
    """Run ``fn`` on fake tensors without grad, either on fake CUDA with CUDA's real kernels
    and autocast (the reference) or on fake CPU under :class:`CudaEmulation`."""
    with FakeTensorMode(), torch.no_grad():
        if emulate:
            inputs = make_inputs("cpu")
            with CudaEmulation(autocast_dtype=autocast), OpLog() as log:
                out = fn(*inputs)
        else:
            inputs = make_inputs("cuda")
            flags = cuda_autocast_flags(autocast) if autocast else contextlib.nullcontext()
            with flags, OpLog() as log:
                out = fn(*inputs)
    return out, log.ops


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def test_registry_covers_the_rules_with_sources() -> None:
    for api in (F.dropout, F.scaled_dot_product_attention, F.linear, F.cross_entropy):
        assert api in RULES and RULES[api].source
    assert RULES[F.linear].policy is CastPolicy.LOWER_PRECISION
    assert RULES[torch.layer_norm].policy is CastPolicy.FP32
    assert RULES[torch.Tensor.softmax].policy is CastPolicy.FP32_SET_OPT_DTYPE
    assert RULES[torch.addcmul].policy is CastPolicy.PROMOTE
    # SDPA: cast first (lower-precision list), then the backend choice
    sdpa = RULES[F.scaled_dot_product_attention]
    assert sdpa.policy is CastPolicy.LOWER_PRECISION and sdpa.kernel is not None
    # feature / alpha dropout never take CUDA's fused path: no rule
    for api in (F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout):
        assert api not in RULES


def test_rejects_non_half_autocast_dtype() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        CudaEmulation(autocast_dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# dropout (fact sheet §2)
# --------------------------------------------------------------------------------------------


def test_dropout_saves_a_bool_mask_under_emulation() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    drop = nn.Dropout(0.1).train()
    with CudaEmulation(), saved_tensors() as saved:
        y = drop(x)
    assert [(s, d) for s, d, _ in saved] == [((4, 8), torch.bool)]
    assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_dropout_saves_float_noise_on_cpu() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors() as saved:
        y = nn.Dropout(0.1).train()(x)
    assert [(s, d) for s, d, _ in saved] == [((4, 8), torch.float32)]
    assert type(y.grad_fn).__name__ == "MulBackward0"


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda x: nn.Dropout(0.1).eval()(x), id="eval"),
        pytest.param(lambda x: F.dropout(x, 0.0, training=True), id="p0"),
        pytest.param(lambda x: F.dropout(x, 1.0, training=True), id="p1"),
        pytest.param(lambda x: F.dropout(x.clone(), 0.1, True, inplace=True), id="inplace"),
    ],
)
def test_dropout_left_alone_where_cuda_does_not_fuse(call: Callable) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with saved_tensors() as plain:
        y_plain = call(x)
    with CudaEmulation(), saved_tensors() as emulated:
        y_emulated = call(x)
    assert [(s, d) for s, d, _ in emulated] == [(s, d) for s, d, _ in plain]
    assert type(y_emulated.grad_fn) is type(y_plain.grad_fn)


@pytest.mark.parametrize(
    ("call", "fused"),
    [
        pytest.param(lambda x: F.dropout(x, 0.1, training=True), True, id="dropout"),
        pytest.param(lambda x: torch.dropout(x, 0.1, True), True, id="torch.dropout"),
        pytest.param(lambda x: F.dropout2d(x, 0.1, training=True), False, id="dropout2d"),
        pytest.param(lambda x: F.alpha_dropout(x, 0.1, training=True), False, id="alpha"),
    ],
)
def test_dropout_matches_cuda_dispatch(call: Callable, fused: bool) -> None:
    """CUDA's own at::dropout (fake CUDA, no grad) takes native_dropout for dropout only;
    dropout2d (feature_dropout) and alpha_dropout are not fused on CUDA either (Dropout.cpp)."""

    def make(device: str) -> tuple:
        return (torch.empty(2, 4, 8, 8, device=device),)

    _, reference = trace(call, make, None, emulate=False)
    _, emulated = trace(call, make, None, emulate=True)
    assert emulated == reference
    assert any(op == "native_dropout" for op, _ in reference) is fused


# --------------------------------------------------------------------------------------------
# scaled_dot_product_attention (fact sheet §1)
# --------------------------------------------------------------------------------------------

TORCH_2_8 = CudaTarget(sm=90, torch_version=(2, 8))  # flash first (default priority order)
TORCH_2_13 = CudaTarget(sm=90, torch_version=(2, 13))  # cuDNN first on H100


def qkv(
    batch: int = 2,
    heads: int = 4,
    length: int = 128,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    kv_heads: int | None = None,
    transposed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as most models make them: (B, L, H, D) storage viewed as (B, H, L, D)."""

    def one(h: int) -> torch.Tensor:
        if transposed:
            t = torch.empty(batch, length, h, head_dim, dtype=dtype).transpose(1, 2)
        else:
            t = torch.empty(batch, h, length, head_dim, dtype=dtype)
        return t.requires_grad_()

    kvh = kv_heads or heads
    return one(heads), one(kvh), one(kvh)


def test_flash_saves_logsumexp_not_scores() -> None:
    with FakeTensorMode():
        q, k, v = qkv()
        with CudaEmulation(TORCH_2_8) as mode, saved_tensors() as saved:
            out = F.scaled_dot_product_attention(q, k, v)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.FLASH
        shapes = [(s, d) for s, d, _ in saved]
        bhld = ((2, 4, 128, 64), torch.bfloat16)
        assert shapes.count(bhld) == 4  # q, k, v, out
        assert ((2, 4, 128), torch.float32) in shapes  # logsumexp
        rest = [x for x in shapes if x != bhld and x != ((2, 4, 128), torch.float32)]
        assert all(torch.Size(s).numel() <= 2 for s, _ in rest)  # rng state scalars
        assert all(torch.Size(s).numel() < 2 * 4 * 128 * 128 for s, _ in shapes)
        # out has q's memory layout (E2), so out.transpose(1, 2).reshape(B, L, E) is a view
        assert out.stride() == q.stride()
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape


def test_cudnn_is_first_on_h100_with_recent_torch() -> None:
    with FakeTensorMode():
        q, k, v = qkv()
        with CudaEmulation(TORCH_2_13) as mode, saved_tensors() as saved:
            out = F.scaled_dot_product_attention(q, k, v)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.CUDNN
        shapes = [(s, d) for s, d, _ in saved]
        assert ((2, 4, 128, 1), torch.float32) in shapes  # cuDNN logsumexp (E2)
        assert all(torch.Size(s).numel() < 2 * 4 * 128 * 128 for s, _ in shapes)
        assert out.stride() == q.stride()
        out.sum().backward()


def test_fp32_takes_efficient_with_padded_logsumexp() -> None:
    with FakeTensorMode():
        q, k, v = qkv(length=100, dtype=torch.float32)
        with CudaEmulation(TORCH_2_13) as mode, saved_tensors() as saved:
            out = F.scaled_dot_product_attention(q, k, v)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.EFFICIENT
        assert ((2, 4, 128), torch.float32) in [(s, d) for s, d, _ in saved]  # ceil32(100)
        out.sum().backward()


def test_bool_mask_takes_efficient_with_a_padded_bias() -> None:
    length = 100  # S % 8 != 0: preprocess_mask pads the (L, S) bias to (L, 104) and slices
    with FakeTensorMode():
        q, k, v = qkv(length=length)
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        with CudaEmulation(TORCH_2_8) as mode, saved_tensors() as saved:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.EFFICIENT  # flash refuses masks
        shapes = [(s, d) for s, d, _ in saved]
        assert ((2, 4, 128), torch.float32) in shapes
        (bias,) = [t for s, d, t in saved if s == (2, 4, length, length)]
        assert bias.dtype == torch.bfloat16
        assert bias.untyped_storage().nbytes() == length * 104 * 2  # not B*H*L*S
        out.sum().backward()

        # cuDNN first (H100, recent torch): a 2-D mask qualifies; its bias is not padded
        with CudaEmulation(TORCH_2_13) as mode, saved_tensors() as saved:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.CUDNN
        (bias,) = [t for s, d, t in saved if s == (length, length)]
        assert bias.dtype == torch.bfloat16
        out.sum().backward()


def test_unaligned_head_dim_saves_padded_copies() -> None:
    with FakeTensorMode():
        q, k, v = qkv(head_dim=60, transposed=False)
        with CudaEmulation(TORCH_2_8) as mode, saved_tensors() as saved:
            out = F.scaled_dot_product_attention(q, k, v)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.FLASH
        assert out.shape == (2, 4, 128, 60)
        shapes = [(s, d) for s, d, _ in saved]
        assert shapes.count(((2, 4, 128, 64), torch.bfloat16)) == 4  # padded q, k, v, out
        assert ((2, 4, 128, 60), torch.bfloat16) not in shapes
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == (2, 4, 128, 60)


def test_gqa() -> None:
    with FakeTensorMode():
        q, k, v = qkv(kv_heads=2)
        with CudaEmulation(TORCH_2_8) as mode:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.FLASH
        out.sum().backward()
        # mem-eff does not take GQA (sdp_utils.cpp, 2.9-era copy): fp32 GQA runs math
        q, k, v = qkv(kv_heads=2, dtype=torch.float32)
        assert select_sdpa_backend(TORCH_2_8, q, k, v, enable_gqa=True) is SdpaBackend.MATH


def _saved_bytes(saved: Saved) -> int:
    """Bytes of the distinct storages autograd saved."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for _s, _d, t in saved}
    return sum(storages.values())


def _repeat_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    # transformers/integrations/sdpa_attention.py · repeat_kv: expand + reshape, a copy
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


@pytest.mark.parametrize(
    ("target", "dtype", "repeat", "backend", "expected"),
    [
        # B=2, H=4 query heads, 2 k/v heads, L=S=128, D=64. q and out: 2*4*128*64*2 = 131,072
        # bytes each in bf16; un-repeated k and v: 2*2*128*64*2 = 65,536 each; repeated:
        # 131,072 each. The fused kernels take k/v with fewer heads as they are (torch 2.13
        # F.scaled_dot_product_attention docstring: "GQA ... works only for Flash_attention and
        # math kernel on CUDA"; attention.cpp passes k/v to the op without repeating them), so
        # enable_gqa keeps no copy; repeat_kv's copies are what the kernel saves instead.
        # flash: + lse (2,4,128) fp32 4,096 + rng (2,) u64 16 + () u64 8 (E2)
        # 131,072*2 + 65,536*2 + 4,120 = 397,336; repeated: 131,072*4 + 4,120 = 528,408
        (TORCH_2_8, torch.bfloat16, False, SdpaBackend.FLASH, 397_336),
        (TORCH_2_8, torch.bfloat16, True, SdpaBackend.FLASH, 528_408),
        # cuDNN (first on H100, recent torch): + lse (2,4,128,1) fp32 4,096 + seed/offset
        # int64 8 + 8: 397,328 and 528,400
        (TORCH_2_13, torch.bfloat16, False, SdpaBackend.CUDNN, 397_328),
        (TORCH_2_13, torch.bfloat16, True, SdpaBackend.CUDNN, 528_400),
        # fp32: flash and cuDNN need fp16/bf16 and mem-eff refuses unequal heads (same
        # docstring; sdp_utils.cpp check_batch_size_and_num_heads_dense<false>), so enable_gqa
        # runs math (§1.5): repeat_interleave'd k^T (8,64,128) and v (8,128,64), the scaled q
        # (8,128,64) and the softmax (8,128,128), fp32: 262,144*3 + 524,288 = 1,310,720.
        (TORCH_2_13, torch.float32, False, SdpaBackend.MATH, 1_310_720),
        # repeat_kv gives equal heads, so mem-eff runs: q, k, v, out 262,144 each + lse
        # (2,4,ceil32(128)) 4,096 + philox seed/offset 16 = 1,052,688
        (TORCH_2_13, torch.float32, True, SdpaBackend.EFFICIENT, 1_052_688),
    ],
)
def test_grouped_query_attention_keeps_what_the_cuda_kernel_keeps(
    target: CudaTarget, dtype: torch.dtype, repeat: bool, backend: SdpaBackend, expected: int
) -> None:
    # Hugging Face's two GQA paths (sdpa_attention.py): enable_gqa=True without a mask, or
    # repeat_kv; here both causal and unmasked, to isolate what the repeat costs.
    with FakeTensorMode():
        q, k, v = qkv(kv_heads=2, dtype=dtype)
        with CudaEmulation(target) as mode, saved_tensors() as saved:
            if repeat:
                out = F.scaled_dot_product_attention(
                    q, _repeat_kv(k, 2), _repeat_kv(v, 2), is_causal=True
                )
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert mode.sdpa_calls[-1].backend is backend
        assert _saved_bytes(saved) == expected
        # head counts of the 4-D (B, heads, L, D) tensors kept: the 2-head k/v themselves
        # unless repeated (math keeps only 3-D (B*H, ., .) tensors)
        heads_saved = {s[1] for s, d, _t in saved if len(s) == 4 and s[-1] == 64}
        if backend is not SdpaBackend.MATH:
            assert heads_saved == ({4} if repeat else {2, 4})
        out.sum().backward()
        assert k.grad is not None and k.grad.shape == (2, 2, 128, 64)


def test_attention_under_autocast_casts_first() -> None:
    with FakeTensorMode():
        q, k, v = qkv(dtype=torch.float32)
        with CudaEmulation(TORCH_2_8, torch.bfloat16) as mode, saved_tensors() as saved:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.FLASH
        assert out.dtype == torch.bfloat16
        # the bf16 casts are what is saved (fact sheet §1.4); no B*H*L*S dropout mask
        assert [d for s, d, _ in saved].count(torch.bfloat16) == 4
        assert all(torch.Size(s).numel() < 2 * 4 * 128 * 128 for s, _, _ in saved)


@pytest.mark.parametrize(
    ("target", "kwargs", "expected"),
    [
        (TORCH_2_8, {"dtype": torch.bfloat16}, SdpaBackend.FLASH),
        (TORCH_2_13, {"dtype": torch.bfloat16}, SdpaBackend.CUDNN),
        (CudaTarget(sm=80, torch_version=(2, 13)), {"dtype": torch.bfloat16}, SdpaBackend.FLASH),
        (TORCH_2_13, {"dtype": torch.float32}, SdpaBackend.EFFICIENT),
        (TORCH_2_13, {"dtype": torch.float32, "head_dim": 6}, SdpaBackend.MATH),
        (TORCH_2_13, {"dtype": torch.bfloat16, "head_dim": 512}, SdpaBackend.EFFICIENT),
        (CudaTarget(sm=75), {"dtype": torch.bfloat16}, SdpaBackend.MATH),
        (CudaTarget(sm=75), {"dtype": torch.float16}, SdpaBackend.EFFICIENT),
    ],
)
def test_backend_choice(target: CudaTarget, kwargs: dict, expected: SdpaBackend) -> None:
    with FakeTensorMode():
        q, k, v = qkv(**kwargs)
        assert select_sdpa_backend(target, q, k, v) is expected


def test_backend_choice_edge_cases() -> None:
    with FakeTensorMode():
        q, k, v = qkv()
        # 3-D inputs never reach a fused kernel (check_tensor_shapes)
        q3, k3, v3 = (t.flatten(0, 1) for t in (q, k, v))
        assert select_sdpa_backend(TORCH_2_13, q3, k3, v3) is SdpaBackend.MATH
        # causal with L != S: not flash, mem-eff takes it
        k_short = k[:, :, :64]
        v_short = v[:, :, :64]
        assert (
            select_sdpa_backend(TORCH_2_8, q, k_short, v_short, is_causal=True)
            is SdpaBackend.EFFICIENT
        )
        # an expanded mask (last stride 0) disqualifies every fused kernel on GPU
        mask = torch.ones(128, 1, dtype=torch.bool).expand(128, 128)
        assert select_sdpa_backend(TORCH_2_13, q, k, v, mask) is SdpaBackend.MATH
        # the user's sdpa_kernel choice is honoured
        with sdpa_kernel(SDPBackend.MATH):
            assert select_sdpa_backend(TORCH_2_13, q, k, v) is SdpaBackend.MATH


def test_math_backend_upcasts_like_cuda() -> None:
    with FakeTensorMode():
        q, k, v = qkv(dtype=torch.bfloat16)
        with (
            sdpa_kernel(SDPBackend.MATH),
            CudaEmulation(TORCH_2_13) as mode,
            saved_tensors() as saved,
        ):
            out = F.scaled_dot_product_attention(q, k, v)
        assert mode.sdpa_calls[-1].backend is SdpaBackend.MATH
        assert out.dtype == torch.bfloat16
        assert ((2, 4, 128, 128), torch.float32) in [(s, d) for s, d, _ in saved]  # softmax


@pytest.mark.parametrize(
    ("sm", "version", "preferred"),
    [
        (90, (2, 4), False),
        (90, (2, 5), False),
        (90, (2, 8), False),
        (90, (2, 9), True),
        (80, (2, 9), False),
        (100, (2, 9), True),
        (90, (2, 10), False),
        (90, (2, 11), True),
        (103, (2, 11), True),
        (120, (2, 11), False),
        (86, (2, 13), False),
    ],
)
def test_cudnn_preference(sm: int, version: tuple[int, int], preferred: bool) -> None:
    assert CudaTarget(sm=sm, torch_version=version).cudnn_attention_preferred is preferred
    override = CudaTarget(sm=sm, torch_version=version, prefer_cudnn_attention=not preferred)
    assert override.cudnn_attention_preferred is (not preferred)


def test_real_cpu_tensors_fall_back_to_the_original() -> None:
    """The fused ops have no CPU kernel (only CUDA and meta): on real tensors the rule runs the
    original function and says so."""
    q = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    with CudaEmulation(TORCH_2_13) as mode:
        out = F.scaled_dot_product_attention(q, q, q)
    assert mode.sdpa_calls[-1].fell_back
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q))
    out.float().sum().backward()


def test_multihead_attention_reaches_the_attention_rule() -> None:
    """nn.MultiheadAttention calls F.multi_head_attention_forward, a Python function whose
    inner F.scaled_dot_product_attention (need_weights=False) must still be seen."""
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        params = {n: fake.from_tensor(p).requires_grad_() for n, p in mha.named_parameters()}
        x = torch.empty(2, 16, 32)
        with CudaEmulation(TORCH_2_8, torch.bfloat16) as mode:
            out, _ = torch.func.functional_call(mha, params, (x, x, x), {"need_weights": False})
        assert [c.backend for c in mode.sdpa_calls] == [SdpaBackend.FLASH]
        out.float().sum().backward()


# --------------------------------------------------------------------------------------------
# autocast (fact sheet §4, §5)
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A small transformer block: LayerNorm, Linear, softmax attention, dropout, GELU MLP,
    residual adds, a vocabulary head and cross_entropy."""

    def __init__(self, width: int = 32, heads: int = 4, vocab: int = 50) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, e // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2) / 8.0).softmax(-1)
        y = (self.drop(scores) @ v).transpose(1, 2).reshape(b, n, e)
        x = x + self.drop(self.proj(y))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_matches_cuda_autocast_op_by_op(dtype: torch.dtype) -> None:
    block = Block().train()

    def make(device: str) -> tuple:
        params = {n: torch.empty(p.shape, device=device) for n, p in block.named_parameters()}
        x = torch.empty(2, 8, 32, device=device)
        target = torch.zeros(2, 8, dtype=torch.long, device=device)
        return params, x, target

    def run(params: dict, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(block, params, (x, target))

    out_ref, reference = trace(run, make, dtype, emulate=False)
    out_emu, emulated = trace(run, make, dtype, emulate=True)
    assert emulated == reference
    assert out_emu.dtype == out_ref.dtype == torch.float32
    # what the comparison covers: bf16/fp16 matmuls, fp32 softmax / layer_norm, fused dropout,
    # CE's log_softmax in the half dtype then an fp32 copy into nll_loss
    half = str(dtype)
    assert ("addmm", (half,)) in reference
    assert ("native_layer_norm", ("torch.float32",) * 3) in reference
    assert ("native_dropout", ("torch.float32", "torch.bool")) in reference
    log_softmax = reference.index(("_log_softmax", (half,)))
    assert reference[log_softmax + 1] == ("_to_copy", ("torch.float32",))
    assert reference[log_softmax + 2][0] == "nll_loss_forward"


def _inputs(*spec: str) -> Callable[[torch.dtype], Callable[[str], tuple]]:
    """Inputs from a spec: "h:8,8" (half), "f:8,8" (fp32), "i:8" (int64 class indices)."""

    def with_dtype(half: torch.dtype) -> Callable[[str], tuple]:
        def make(device: str) -> tuple:
            out = []
            for item in spec:
                kind, _, dims = item.partition(":")
                shape = tuple(int(d) for d in dims.split(","))
                if kind == "i":
                    out.append(torch.zeros(shape, dtype=torch.long, device=device))
                else:
                    dtype = half if kind == "h" else torch.float32
                    out.append(torch.empty(shape, dtype=dtype, device=device))
            return tuple(out)

        return make

    return with_dtype


OPS: dict[str, tuple[Callable, Callable]] = {
    # lower precision
    "linear": (lambda x, w: F.linear(x, w), _inputs("f:8,8", "f:4,8")),
    "matmul": (lambda a, b: a @ b, _inputs("f:8,8", "f:8,8")),
    "bmm": (torch.bmm, _inputs("f:2,8,8", "f:2,8,8")),
    "baddbmm": (torch.baddbmm, _inputs("f:2,8,8", "f:2,8,8", "f:2,8,8")),
    "addmm": (torch.addmm, _inputs("f:8", "f:8,8", "f:8,8")),
    "einsum": (lambda a, b: torch.einsum("ij,kj->ik", a, b), _inputs("f:8,8", "f:8,8")),
    "conv2d": (F.conv2d, _inputs("f:1,2,8,8", "f:3,2,3,3", "f:3")),
    "conv_transpose2d": (F.conv_transpose2d, _inputs("f:1,2,8,8", "f:2,3,3,3")),
    "prelu": (F.prelu, _inputs("f:2,8", "f:1")),
    # fp32
    "layer_norm": (lambda x: F.layer_norm(x, (8,)), _inputs("h:4,8")),
    "group_norm": (lambda x: F.group_norm(x, 2), _inputs("h:2,4,8")),
    "rms_norm": (lambda x: F.rms_norm(x, (8,)), _inputs("h:4,8")),
    "exp": (torch.exp, _inputs("h:4,8")),
    "log": (lambda x: x.log(), _inputs("h:4,8")),
    "pow": (lambda x: x**2, _inputs("h:4,8")),
    "rpow": (lambda x: 2**x, _inputs("h:4,8")),
    "rsqrt": (torch.rsqrt, _inputs("h:4,8")),
    "softplus": (F.softplus, _inputs("h:4,8")),
    "erfinv": (torch.special.erfinv, _inputs("h:4,8")),
    "logsumexp": (lambda x: x.logsumexp(-1), _inputs("h:4,8")),
    "cosine_similarity": (F.cosine_similarity, _inputs("h:4,8", "h:4,8")),
    "cdist": (torch.cdist, _inputs("h:4,8", "h:4,8")),
    "mse_loss": (F.mse_loss, _inputs("h:4,8", "h:4,8")),
    "l1_loss": (F.l1_loss, _inputs("h:4,8", "f:4,8")),
    "smooth_l1_loss": (F.smooth_l1_loss, _inputs("h:4,8", "h:4,8")),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, _inputs("h:4,8", "h:4,8")),
    "kl_div": (lambda a, b: F.kl_div(a, b, reduction="batchmean"), _inputs("h:4,8", "h:4,8")),
    "nll_loss": (F.nll_loss, _inputs("h:8,8", "i:8")),
    "interpolate_bilinear": (
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
        _inputs("h:1,1,4,4"),
    ),
    "interpolate_nearest": (lambda x: F.interpolate(x, scale_factor=2), _inputs("h:1,1,4,4")),
    "interpolate_area": (
        lambda x: F.interpolate(x, size=(2, 2), mode="area"),
        _inputs("h:1,1,4,4"),
    ),
    # fp32_set_opt_dtype (an explicit dtype is kept)
    "softmax": (lambda x: x.softmax(-1), _inputs("h:4,8")),
    "F.softmax": (lambda x: F.softmax(x, -1), _inputs("h:4,8")),
    "softmax_explicit_dtype": (lambda x: torch.softmax(x, -1, x.dtype), _inputs("h:4,8")),
    "log_softmax": (lambda x: F.log_softmax(x, -1), _inputs("h:4,8")),
    "sum": (lambda x: x.sum(), _inputs("h:4,8")),
    "sum_dim": (lambda x: x.sum(-1), _inputs("h:4,8")),
    "cumsum": (lambda x: x.cumsum(0), _inputs("h:4,8")),
    "prod": (lambda x: x.prod(), _inputs("h:4,8")),
    "norm": (lambda x: x.norm(), _inputs("h:4,8")),
    "normalize": (F.normalize, _inputs("h:4,8")),
    "vector_norm": (torch.linalg.vector_norm, _inputs("h:4,8")),
    "linalg_norm": (torch.linalg.norm, _inputs("h:4,8")),
    # promote
    "addcmul_mixed": (torch.addcmul, _inputs("h:4,8", "h:4,8", "f:4,8")),
    "addcmul_half": (torch.addcmul, _inputs("h:4,8", "h:4,8", "h:4,8")),
    "atan2": (torch.atan2, _inputs("h:4,8", "f:4,8")),
    "dot": (torch.dot, _inputs("h:8", "f:8")),
    # in no list
    "mean": (lambda x: x.mean(), _inputs("h:4,8")),
    "gelu": (F.gelu, _inputs("h:4,8")),
    "silu": (F.silu, _inputs("h:4,8")),
    "add_mixed": (torch.add, _inputs("h:4,8", "f:4,8")),
    # cross_entropy: not listed on CUDA; its decomposition is (fact sheet §5)
    "cross_entropy": (F.cross_entropy, _inputs("h:8,8", "i:8")),
    "cross_entropy_3d": (F.cross_entropy, _inputs("h:2,8,4", "i:2,4")),
    "cross_entropy_smoothing": (
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1),
        _inputs("h:8,8", "i:8"),
    ),
    "cross_entropy_smoothing_weight": (
        lambda x, t, w: F.cross_entropy(x, t, w, label_smoothing=0.1, reduction="sum"),
        _inputs("h:8,8", "i:8", "f:8"),
    ),
    "cross_entropy_probabilities": (F.cross_entropy, _inputs("h:8,8", "f:8,8")),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_cuda_autocast(name: str, dtype: torch.dtype) -> None:
    """Each op's aten calls and output dtypes equal CUDA's autocast (fake CUDA, E3/E7)."""
    fn, make = OPS[name]
    out_ref, reference = trace(fn, make(dtype), dtype, emulate=False)
    out_emu, emulated = trace(fn, make(dtype), dtype, emulate=True)
    assert out_emu.dtype == out_ref.dtype
    assert emulated == reference


def test_binary_cross_entropy_is_banned_under_autocast() -> None:
    x = torch.rand(4, 8)
    with CudaEmulation(autocast_dtype=torch.bfloat16), pytest.raises(RuntimeError, match="unsafe"):
        F.binary_cross_entropy(x, x)
    with CudaEmulation():
        F.binary_cross_entropy(x, x)  # no autocast: fine


def test_cross_entropy_saves_half_log_probs_and_an_fp32_copy() -> None:
    """CUDA autocast: log_softmax stays bf16 (saved, 2 bytes) and nll_loss saves its fp32 copy
    (4 bytes): 6 bytes per N*V element (fact sheet §5), against 4 under CPU autocast (E4)."""
    n, v = 16, 50
    head = nn.Linear(32, v)
    x = torch.randn(n, 32, requires_grad=True)
    target = torch.zeros(n, dtype=torch.long)

    def big(saved: Saved) -> list[torch.dtype]:
        return sorted((d for s, d, _ in saved if s == (n, v)), key=str)

    with CudaEmulation(autocast_dtype=torch.bfloat16):
        logits = head(x)
        with saved_tensors() as cuda_saved:
            loss = F.cross_entropy(logits, target)
    assert big(cuda_saved) == [torch.bfloat16, torch.float32]
    loss.backward()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(x)
        with saved_tensors() as cpu_saved:
            F.cross_entropy(logits, target)
    assert big(cpu_saved) == [torch.float32, torch.float32]
    assert cpu_saved[0][2] is cpu_saved[1][2]  # one fp32 tensor, saved by both nodes


def _count_casts(regions: int, uses: int, *, emulate: bool, cache: bool = True) -> int:
    linear = nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8)
    with CopyCount() as count:
        for _ in range(regions):
            region = (
                CudaEmulation(autocast_dtype=torch.bfloat16, cache_enabled=cache)
                if emulate
                else torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)
            )
            with region:
                for _ in range(uses):
                    linear(x)
    return count.n


@pytest.mark.parametrize(
    ("regions", "uses", "cache", "expected"),
    [(1, 2, True, 3), (2, 1, True, 4), (1, 2, False, 4), (1, 3, True, 4)],
)
def test_weight_cast_cache(regions: int, uses: int, cache: bool, expected: int) -> None:
    """A parameter is cast once per autocast region; inputs every time (fact sheet §4.2, E6).
    CPU autocast shares the caching code (cached_cast) and is the reference."""
    assert _count_casts(regions, uses, emulate=True, cache=cache) == expected
    assert _count_casts(regions, uses, emulate=False, cache=cache) == expected


def test_clear_cast_cache_starts_a_new_region() -> None:
    linear = nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8)
    with CopyCount() as count, CudaEmulation(autocast_dtype=torch.bfloat16) as mode:
        linear(x)
        mode.clear_cast_cache()
        linear(x)
    assert count.n == 4  # x twice, the weight twice


def test_weight_cast_is_saved_once_for_two_uses() -> None:
    linear = nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8, requires_grad=True)
    with CudaEmulation(autocast_dtype=torch.bfloat16), saved_tensors() as saved:
        linear(linear(x).float())
    weights = [t for s, d, t in saved if s == (8, 8)]
    assert len(weights) == 2 and all(t.dtype == torch.bfloat16 for t in weights)
    assert weights[0].untyped_storage().data_ptr() == weights[1].untyped_storage().data_ptr()


def test_autocast_flags_follow_the_region() -> None:
    assert not torch.is_autocast_enabled("cuda")
    linear = nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with CudaEmulation(autocast_dtype=torch.float16):
        # model code that asks sees CUDA autocast, as on a GPU
        assert torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.float16
        assert linear(x).dtype == torch.float16
        # a user region that switches CUDA autocast off switches the emulated casts off
        with torch.autocast("cuda", enabled=False):
            assert linear(x).dtype == torch.float32
        assert linear(x).dtype == torch.float16
    assert not torch.is_autocast_enabled("cuda")
    assert linear(x).dtype == torch.float32


def test_functions_without_rules_run_unchanged() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))

    def run(emulate: bool) -> list:
        model.zero_grad(set_to_none=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(2, 8)
            region = CudaEmulation() if emulate else contextlib.nullcontext()
            with region, OpLog() as log:
                model(x).sum().backward()
        return log.ops

    assert run(True) == run(False)


def test_training_step_on_fake_tensors() -> None:
    """A TransformerEncoderLayer forward + backward under emulated CUDA autocast."""
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        params = {n: fake.from_tensor(p).requires_grad_() for n, p in layer.named_parameters()}
        x = torch.empty(2, 16, 64)
        with CudaEmulation(TORCH_2_13, torch.bfloat16) as mode, saved_tensors() as saved:
            out = torch.func.functional_call(layer, params, (x,))
        out.float().sum().backward()
    assert [c.backend for c in mode.sdpa_calls] == [SdpaBackend.CUDNN]
    assert {d for _, d, _ in saved} >= {torch.bool, torch.bfloat16, torch.float32}
    assert all(p.grad is not None for p in params.values())
