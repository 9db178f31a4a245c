"""Tests for vram_widget._profiling.flops: hand-worked FLOP counts and the three fixes to stock
``torch.utils.flop_counter.FlopCounterMode``.

Convention throughout: 2 FLOPs per multiply-add; a (M, K) @ (K, N) product is 2*M*K*N.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from vram_widget._profiling.fake import TorchDispatchMode
from vram_widget._profiling.flops import count_flops, flops_to_macs, has_flop_formula, op_flops

aten = torch.ops.aten


def stock_flops(fn: Callable[[], Any]) -> int:
    """What unmodified FlopCounterMode counts for ``fn()``."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


class _OpLog(TorchDispatchMode):
    """Records (op, op_flops) for every op dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, int]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func._overloadpacket, op_flops(func, args, kwargs, out)))
        return out

    def flops_of(self, packet: Any) -> list[int]:
        return [flops for p, flops in self.calls if p is packet]


@contextmanager
def op_log() -> Iterator[_OpLog]:
    log = _OpLog()
    with log:
        yield log


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ------------------------------------------------------------------------------------------
# Basics
# ------------------------------------------------------------------------------------------


def test_linear_forward_and_backward() -> None:
    lin = nn.Linear(10, 20)
    x = torch.randn(4, 10, requires_grad=True)
    # (4, 10) @ (10, 20): 2 * 4 * 10 * 20 = 1600; the bias add is not counted.
    assert count_flops(lambda: lin(x)) == 1600
    # Backward: grad_input (4, 20) @ (20, 10) and grad_weight (20, 4) @ (4, 10), 1600 each.
    assert count_flops(lambda: lin(x).sum().backward()) == 3 * 1600


def test_linear_under_inference_mode_is_decomposed() -> None:
    # Under inference_mode aten.linear reaches the dispatch mode undecomposed; it has no formula,
    # so count_flops decomposes it (as FlopCounterMode does) and counts the addmm inside.
    lin = nn.Linear(10, 20)
    x = torch.randn(4, 10)

    def run() -> None:
        with torch.inference_mode():
            lin(x)

    assert not has_flop_formula(aten.linear.default)
    assert has_flop_formula(aten.addmm.default)
    assert count_flops(run) == 1600 == stock_flops(run)


def test_uncounted_ops_are_zero() -> None:
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert op_flops(aten.add.Tensor, (a, b), {}, a + b) == 0
    assert op_flops(aten.relu.default, (a,), {}, a.relu()) == 0
    assert count_flops(lambda: (a * b).softmax(-1).sum()) == 0


def test_flops_to_macs() -> None:
    assert flops_to_macs(1600) == 800
    assert flops_to_macs(7) == 3


# ------------------------------------------------------------------------------------------
# Convolutions (fix 2: groups in the backward)
# ------------------------------------------------------------------------------------------


def test_conv2d_forward_and_backward() -> None:
    conv = nn.Conv2d(3, 8, 3, padding=1)
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    # N * H_out * W_out * C_out * C_in * k*k MACs: 2 * (2*16*16) * 8 * 3 * 9 = 221184.
    forward = 2 * (2 * 16 * 16) * 8 * 3 * 9
    assert count_flops(lambda: conv(x)) == forward == 221_184
    # grad_input and grad_weight each cost one forward.
    train_step = count_flops(lambda: conv(x).sum().backward())
    assert train_step == forward + 2 * forward
    # With groups == 1 our backward formula agrees with stock's.
    assert train_step == stock_flops(lambda: conv(x).sum().backward())


def test_alexnet_conv1_stride() -> None:
    # AlexNet's (torchvision) first layer: 64 filters 11x11, stride 4, padding 2 on 224x224.
    # H_out = (224 + 2*2 - 11) // 4 + 1 = 55, so 55*55*64*3*121 = 70_276_800 MACs.
    conv = nn.Conv2d(3, 64, 11, stride=4, padding=2)
    x = torch.randn(1, 3, 224, 224)
    flops = count_flops(lambda: conv(x))
    assert flops == 2 * 55 * 55 * 64 * 3 * 121 == 140_553_600
    assert flops_to_macs(flops) == 70_276_800


def test_grouped_conv_forward_uses_weight_shape() -> None:
    # Conv1d(8, 16, 3, groups=4): weight (16, 2, 3), so each output channel sees 8/4 = 2 inputs.
    # L_out = 20 - 3 + 1 = 18: 2 * (2*18) * 16 * 2 * 3 = 6912.
    conv = nn.Conv1d(8, 16, 3, groups=4)
    x = torch.randn(2, 8, 20)
    assert count_flops(lambda: conv(x)) == 2 * (2 * 18) * 16 * 2 * 3 == 6912
    assert stock_flops(lambda: conv(x)) == 6912  # stock's forward is right too


def test_depthwise_conv_backward() -> None:
    conv = nn.Conv2d(32, 32, 3, groups=32, padding=1)
    x = torch.randn(2, 32, 16, 16, requires_grad=True)
    # Weight (32, 1, 3, 3): 2 * (2*16*16) * 32 * 1 * 9 = 294912.
    forward = 2 * (2 * 16 * 16) * 32 * 1 * 9
    assert count_flops(lambda: conv(x)) == forward == 294_912

    with op_log() as log:
        conv(x).sum().backward()
    [backward] = log.flops_of(aten.convolution_backward)
    assert backward == 2 * forward  # grad_input + grad_weight, one forward each

    # Stock (measured, torch 2.13): grad_input is right, but grad_weight is computed over all
    # C_in = 32 input channels, 32x too high: forward + 32 * forward = 9_732_096.
    stock_backward = stock_flops(lambda: conv(x).sum().backward()) - forward
    assert stock_backward == forward + 32 * forward
    assert backward != stock_backward


def test_conv_backward_output_mask() -> None:
    # op_flops straight on aten.convolution_backward with meta tensors: one forward per
    # requested gradient; the bias gradient (a reduction) is free.
    x = torch.empty(2, 32, 16, 16, device="meta")
    w = torch.empty(32, 1, 3, 3, device="meta")
    grad_out = torch.empty(2, 32, 16, 16, device="meta")
    forward = 2 * (2 * 16 * 16) * 32 * 1 * 9

    def backward(mask: list[bool]) -> int:
        args = (grad_out, x, w, [32], [1, 1], [1, 1], [1, 1], False, [0, 0], 32, mask)
        out = (x if mask[0] else None, w if mask[1] else None, None)
        return op_flops(aten.convolution_backward.default, args, {}, out)

    assert backward([True, False, False]) == forward
    assert backward([False, True, False]) == forward
    assert backward([False, False, True]) == 0
    assert backward([True, True, True]) == 2 * forward


def test_transposed_conv() -> None:
    # ConvTranspose2d(8, 4, 3, stride=2, groups=2): weight (8, 2, 3, 3); every input pixel is
    # multiplied into C_out/groups * k*k outputs: 2 * (2*7*7) * 8 * 2 * 9 = 28224.
    grouped = nn.ConvTranspose2d(8, 4, 3, stride=2, groups=2)
    x = torch.randn(2, 8, 7, 7, requires_grad=True)
    forward = 2 * (2 * 7 * 7) * 8 * 2 * 9
    assert count_flops(lambda: grouped(x)) == forward == 28_224
    assert count_flops(lambda: grouped(x).sum().backward()) == 3 * forward

    # groups == 1: identical to stock, forward and backward.
    plain = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
    assert count_flops(lambda: plain(x)) == 2 * (2 * 7 * 7) * 8 * 4 * 9
    step = count_flops(lambda: plain(x).sum().backward())
    assert step == 3 * 2 * (2 * 7 * 7) * 8 * 4 * 9
    assert step == stock_flops(lambda: plain(x).sum().backward())


# ------------------------------------------------------------------------------------------
# Attention (fix 1: CPU flash attention)
# ------------------------------------------------------------------------------------------

B, H, L, D = 2, 4, 16, 8
# One (L, D) @ (D, S) per batch and head: 2 * B * H * L * S * D = 2 * 2*4*16*16*8 = 32768.
ONE_ATTN_MATMUL = 2 * B * H * L * L * D


def test_sdpa_cpu_forward_and_backward() -> None:
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    with op_log() as log:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    [forward] = log.flops_of(aten._scaled_dot_product_flash_attention_for_cpu)
    [backward] = log.flops_of(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    # Forward: Q K^T and P V.
    assert forward == 2 * ONE_ATTN_MATMUL == 65_536
    assert forward == sdpa_flop_count(q.shape, k.shape, v.shape)
    # Backward (registry helper): recompute Q K^T, then dP, dV, dQ, dK: five matmuls.
    assert backward == 5 * ONE_ATTN_MATMUL == 163_840
    assert backward == sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)
    # Stock counts neither (measured, torch 2.13).
    assert stock_flops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward()) == 0


def test_sdpa_cpu_grouped_query_attention() -> None:
    q = torch.randn(B, H, L, D, requires_grad=True)
    k, v = (torch.randn(B, H // 2, 12, D, requires_grad=True) for _ in range(2))
    flops = count_flops(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    assert flops == sdpa_flop_count(q.shape, k.shape, v.shape) == 2 * (2 * B * H * L * 12 * D)


def test_sdpa_math_path_counts_through_bmm() -> None:
    # A value head dim != query head dim is not supported by the CPU flash kernel, so SDPA takes
    # the math path (two bmm): the count is the same as the fused kernel's formula.
    q, k = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    v = torch.randn(B, H, L, 5)
    with op_log() as log:
        F.scaled_dot_product_attention(q, k, v)
    assert log.flops_of(aten.bmm)
    assert sum(f for _, f in log.calls) == sdpa_flop_count(q.shape, k.shape, v.shape)


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("_scaled_dot_product_flash_attention", ()),
        ("_scaled_dot_product_efficient_attention", (None, False)),
        ("_scaled_dot_product_cudnn_attention", (None, False)),
        ("_scaled_dot_product_fused_attention_overrideable", ()),
    ],
)
def test_fused_sdpa_variants(name: str, extra: tuple[Any, ...]) -> None:
    # The CUDA kernels cannot run here; their formulas only read shapes, so feed meta tensors.
    q, k, v = (torch.empty(B, H, L, D, device="meta") for _ in range(3))
    forward_op = getattr(aten, name).default
    backward_op = getattr(aten, name + "_backward").default
    assert op_flops(forward_op, (q, k, v, *extra), {}, None) == 2 * ONE_ATTN_MATMUL
    # Every backward schema starts (grad_out, query, key, value, ...).
    assert op_flops(backward_op, (q, q, k, v), {}, None) == 5 * ONE_ATTN_MATMUL


def test_fused_sdpa_variants_agree_with_stock() -> None:
    # Where stock has a formula we must not change its number.
    q, k, v = (torch.empty(B, H, L, D, device="meta") for _ in range(3))
    for packet in (
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
    ):
        assert op_flops(packet.default, (q, k, v), {}, None) == flop_registry[packet](
            q, k, v, out_val=None
        )


# ------------------------------------------------------------------------------------------
# Fused transformer inference kernels (fix 3)
# ------------------------------------------------------------------------------------------

E, NHEAD, FF, SEQ, BATCH = 32, 4, 64, 10, 2


def _encoder_layer_flops(lengths: list[int]) -> int:
    """Hand count of one encoder layer over sequences of the given lengths."""
    tokens = sum(lengths)
    in_proj = 2 * tokens * E * 3 * E  # (T, E) @ (E, 3E)
    attention = sum(2 * (2 * NHEAD * n * n * (E // NHEAD)) for n in lengths)  # QK^T and PV
    out_proj = 2 * tokens * E * E
    ffn = 2 * tokens * E * FF + 2 * tokens * FF * E
    return in_proj + attention + out_proj + ffn


def _encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(E, NHEAD, FF, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_transformer_encoder_fused_equals_unfused() -> None:
    encoder = _encoder()
    x = torch.randn(BATCH, SEQ, E)
    # Per layer: 122880 + 25600 + 40960 + 163840 = 353280; two layers 706560.
    expected = 2 * _encoder_layer_flops([SEQ] * BATCH)
    assert expected == 706_560

    def run() -> None:
        with torch.no_grad():
            encoder(x)

    encoder.eval()
    with op_log() as log:
        run()
    fused = log.flops_of(aten._transformer_encoder_layer_fwd)
    assert len(fused) == 2  # the fast path really ran
    assert sum(fused) == count_flops(run) == expected
    assert stock_flops(run) == 0  # measured, torch 2.13

    # Training mode (dropout 0) takes the decomposed path: addmm/mm + CPU flash SDPA.
    encoder.train()
    with op_log() as log:
        run()
    assert not log.flops_of(aten._transformer_encoder_layer_fwd)
    assert count_flops(run) == expected
    # FlopCounterMode on that path, taught only fix 1, agrees; stock misses the attention.
    cpu_sdpa = {
        aten._scaled_dot_product_flash_attention_for_cpu: (
            lambda q, k, v, *a, out_shape=None, **kw: sdpa_flop_count(q, k, v)
        )
    }
    with FlopCounterMode(display=False, custom_mapping=cpu_sdpa) as counter:
        run()
    assert counter.get_total_flops() == expected
    assert stock_flops(run) == expected - 2 * 2 * (2 * BATCH * NHEAD * SEQ * SEQ * (E // NHEAD))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_transformer_encoder_fused_nested_counts_real_tokens() -> None:
    # With a padding mask the encoder packs the batch into a nested tensor and the fused kernel
    # computes only the 10 + 6 real tokens.
    layer = nn.TransformerEncoderLayer(E, NHEAD, FF, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(BATCH, SEQ, E)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    mask[1, 6:] = True

    def run() -> None:
        with torch.no_grad():
            encoder(x, src_key_padding_mask=mask)

    assert count_flops(run) == 2 * _encoder_layer_flops([10, 6])


def test_native_multi_head_attention() -> None:
    mha = nn.MultiheadAttention(E, NHEAD, batch_first=True)
    x = torch.randn(BATCH, SEQ, E)

    def run() -> None:
        with torch.no_grad():
            mha(x, x, x)

    # In-projection, QK^T and PV, out-projection: the encoder layer without its FFN.
    tokens = BATCH * SEQ
    expected = _encoder_layer_flops([SEQ] * BATCH) - 2 * 2 * tokens * E * FF
    mha.eval()
    with op_log() as log:
        run()
    assert log.flops_of(aten._native_multi_head_attention) == [expected]
    mha.train()
    assert count_flops(run) == expected


# ------------------------------------------------------------------------------------------
# Fake tensors
# ------------------------------------------------------------------------------------------


def test_op_flops_on_fake_tensors() -> None:
    encoder = _encoder().eval()
    depthwise = nn.Conv2d(32, 32, 3, groups=32, padding=1)

    def workload(x: torch.Tensor, img: torch.Tensor, q: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                encoder(x)  # fused kernel
            depthwise(img).sum().backward()
            F.scaled_dot_product_attention(q, q, q).sum().backward()

        return run

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.randn(BATCH, SEQ, E),
            torch.randn(2, 32, 16, 16, requires_grad=True),
            torch.randn(B, H, L, D, requires_grad=True),
        )

    real = count_flops(workload(*inputs()))
    # Parameters stay real; the fake mode converts them on use.
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_inputs = inputs()
        with op_log() as log:
            workload(*fake_inputs)()
        fake = count_flops(workload(*fake_inputs))
    assert all(type(t).__name__ == "FakeTensor" for t in fake_inputs)
    expected = (
        2 * _encoder_layer_flops([SEQ] * BATCH)
        + 3 * 2 * (2 * 16 * 16) * 32 * 9  # depthwise forward + two gradients
        + 7 * ONE_ATTN_MATMUL  # SDPA forward (2) + backward (5)
    )
    assert fake == real == expected
    assert sum(f for _, f in log.calls) == expected


def test_alexnet_and_vgg16_macs_at_224_match_the_hand_count() -> None:
    """MACs of one 1x3x224x224 forward, as thop/torchinfo/cs231n count (convs and linears)."""
    from vram_widget import profile_model, zoo

    # AlexNet (torchvision): output side x output side x C_out x C_in x k x k per conv
    #   conv1 3->64, 11x11, stride 4, pad 2: 55*55*64*3*121    =  70,276,800
    #   conv2 64->192, 5x5, pad 2 (27x27):   27*27*192*64*25   = 223,948,800
    #   conv3 192->384, 3x3 (13x13):         13*13*384*192*9   = 112,140,288
    #   conv4 384->256:                      13*13*256*384*9   = 149,520,384
    #   conv5 256->256:                      13*13*256*256*9   =  99,680,256
    #   fc 9216->4096, 4096->4096, 4096->1000: 37,748,736 + 16,777,216 + 4,096,000
    alexnet_macs = (
        70_276_800
        + 223_948_800
        + 112_140_288
        + 149_520_384
        + 99_680_256
        + 37_748_736
        + 16_777_216
        + 4_096_000
    )
    assert alexnet_macs == 714_188_480
    est = profile_model(zoo.alexnet(), input_size=(3, 224, 224)).estimate(1, mode="inference")
    assert est.macs == alexnet_macs
    assert est.flops == 2 * alexnet_macs

    # VGG16: 13 3x3 convs, "same" padding, a 2x2 pool after blocks of (2, 2, 3, 3, 3) convs
    side, c_in, vgg_macs = 224, 3, 0
    for block, (c_out, convs) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]):
        for _ in range(convs):
            vgg_macs += side * side * c_out * c_in * 9
            c_in = c_out
        side //= 2
        assert block < 5
    vgg_macs += 25_088 * 4_096 + 4_096 * 4_096 + 4_096 * 1_000
    assert vgg_macs == 15_470_264_320  # the widely quoted 15.47 GMACs
    est = profile_model(zoo.vgg16(), input_size=(3, 224, 224)).estimate(1, mode="inference")
    assert est.macs == vgg_macs


def test_cpu_lstm_counts_its_gate_matmuls() -> None:
    """nn.LSTM on the CPU runs aten.mkldnn_rnn_layer, which stock FlopCounterMode counts as 0."""
    from vram_widget._profiling.flops import count_flops

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(16, 32, num_layers=1, batch_first=True)
    x = torch.zeros(3, 5, 16)
    # 5 steps x 3 sequences x 4 gates x 32 hidden x (16 input + 32 hidden) MACs, 2 FLOPs each
    forward = 2 * 5 * 3 * (4 * 32) * (16 + 32)
    assert forward == 184_320
    with torch.no_grad():
        assert count_flops(lambda: lstm(x)) == forward
    x.requires_grad_(True)
    # backward: a gradient matmul for each operand of each forward matmul
    assert count_flops(lambda: lstm(x)[0].sum().backward()) == forward + 2 * forward


def test_int4_cpu_matmul_counts_the_unpacked_weight() -> None:
    # torchao's int4 CPU kernel: x (M=5, K=256) times a 48 x 256 int4 weight packed by
    # torch into 48 x 128 uint8 (two values a byte); 2 * M * N * K = 2 * 5 * 48 * 256
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (48, 256), dtype=torch.int32), 1
    )
    assert tuple(packed.shape) == (48, 128)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    scales_and_zeros = torch.randn(256 // 32, 48, 2, dtype=torch.bfloat16)
    args = (x, packed, 32, scales_and_zeros)
    out = aten._weight_int4pack_mm_for_cpu.default(*args)
    assert tuple(out.shape) == (5, 48)
    assert op_flops(aten._weight_int4pack_mm_for_cpu.default, args, {}, out) == 122880
