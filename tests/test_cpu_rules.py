"""CPU BatchNorm kernels against the real step: the rules of ``cpu_rules`` to the byte.

``measure`` gives the real CPU step (the allocator's events); ``device="cpu"`` estimates must
match it exactly. The hand-worked cases pin each rule's arithmetic.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vram_widget import measure, profile_model
from vram_widget._profiling.cpu_rules import batch_norm_scratch_bytes, unallocated_outputs

aten = torch.ops.aten


def _conv_bn_relu() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.ReLU())


def _bare_bn() -> nn.Module:
    return nn.BatchNorm2d(64)


def _bn_first() -> nn.Module:
    # the input needs no gradient: the BatchNorm backward computes no grad_input
    return nn.Sequential(nn.BatchNorm2d(8), nn.Conv2d(8, 16, 3), nn.Flatten(), nn.Linear(576, 4))


def _bn1d_features() -> nn.Module:
    # BatchNorm1d on N x C: one value per sample and channel, the channels-last kernel
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _bn1d_sequence() -> nn.Module:
    # BatchNorm1d on N x C x L: the same contiguous kernel as BatchNorm2d
    return nn.Sequential(nn.Conv1d(4, 32, 3), nn.BatchNorm1d(32), nn.ReLU())


@pytest.mark.parametrize("mode", ["train", "inference"])
@pytest.mark.parametrize(
    ("make", "sample"),
    [
        (_bare_bn, (64, 14, 14)),
        (_conv_bn_relu, (3, 16, 16)),
        (_bn_first, (8, 8, 8)),
        (_bn1d_sequence, (4, 20)),
    ],
)
def test_batch_norm_estimate_is_measured_peak(make, sample, mode) -> None:
    torch.manual_seed(0)
    model = make()
    estimate = profile_model(model, input_size=sample, device="cpu").estimate(
        4, "fp32", "adam", mode=mode
    )
    measured = measure(model, torch.randn(4, *sample), optimizer="adam", mode=mode)
    assert estimate.peak_bytes == measured.peak_bytes


def test_batch_norm1d_features_inference_is_measured_peak() -> None:
    # N x C takes the channels-last kernel: the same alpha and beta (2 x 32 x 4 = 256 B).
    # In training its reduction buffer (threads x C) is not emulated (cpu_rules).
    torch.manual_seed(0)
    model = _bn1d_features()
    estimate = profile_model(model, input_size=(16,), device="cpu").estimate(4, mode="inference")
    assert estimate.peak_bytes == measure(model, torch.randn(4, 16), mode="inference").peak_bytes


def test_forward_scratch_is_alpha_and_beta() -> None:
    # batch_norm_cpu_contiguous_impl: alpha, beta = 2 x C in the computation type.
    x = torch.zeros(4, 64, 14, 14)
    c = torch.ones(64)
    args = (x, c, c, c, c, True, 0.1, 1e-5)
    assert batch_norm_scratch_bytes(aten.native_batch_norm.default, args) == 2 * 64 * 4  # 512
    # bf16 input: alpha and beta in float (opmath), so still 2 x 64 x 4 = 512
    half = (x.bfloat16(), c, c, c, c, False, 0.1, 1e-5)
    assert batch_norm_scratch_bytes(aten.native_batch_norm.default, half) == 512
    # N x C (the channels-last kernel): the same alpha and beta, 2 x 64 x 4 = 512
    flat = (torch.zeros(4, 64), c, c, c, c, False, 0.1, 1e-5)
    assert batch_norm_scratch_bytes(aten.native_batch_norm.default, flat) == 512


def test_backward_scratch_is_second_grad_input() -> None:
    # batch_norm_backward_cpu_template allocates grad_input twice when it is asked for:
    # 4 x 64 x 14 x 14 x 4 B = 200,704 B more; nothing when the mask leaves it out.
    x = torch.zeros(4, 64, 14, 14)
    c = torch.ones(64)
    func = aten.native_batch_norm_backward.default
    wanted = (x, x, c, c, c, c, c, True, 1e-5, [True, True, True])
    assert batch_norm_scratch_bytes(func, wanted) == 4 * 64 * 14 * 14 * 4
    assert unallocated_outputs(func, wanted) == frozenset()
    no_input = (x, x, c, c, c, c, c, True, 1e-5, [False, True, True])
    assert batch_norm_scratch_bytes(func, no_input) == 0
    assert unallocated_outputs(func, no_input) == frozenset({0})
    # grad_out in another memory format: the template's non-contiguous path, no second copy
    other = (x.contiguous(memory_format=torch.channels_last), x, c, c, c, c, c, True, 1e-5,
             [True, True, True])  # fmt: skip
    assert batch_norm_scratch_bytes(func, other) == 0


def test_rules_match_the_real_kernel() -> None:
    # The real CPU kernel run under the profiler (probe.py's measurement): its in-call scratch
    # and its output sizes are what the rules say, for each path they cover.
    from vram_widget._profiling.probe import KernelProbe

    def real(func, args):
        probe = KernelProbe()
        sig = probe.request(func, args, {})
        return probe.workspace_bytes(sig), [probe.output_bytes(sig, i) for i in range(3)]

    # inference on the channels-last kernel (channels-last maps, N x C): alpha and beta too
    for x in (
        torch.zeros(3, 32, 5, 6).contiguous(memory_format=torch.channels_last),
        torch.zeros(5, 32),
        torch.zeros(5, 32).bfloat16(),
    ):
        p = torch.ones(32)
        args = (x, p, p, torch.zeros(32), p, False, 0.1, 1e-5)
        workspace, _ = real(aten.native_batch_norm.default, args)
        assert workspace == batch_norm_scratch_bytes(aten.native_batch_norm.default, args)
    c = torch.ones(32)
    for x in (torch.zeros(3, 32, 5, 6), torch.zeros(2, 32, 7), torch.zeros(3, 32, 4).bfloat16()):
        for train in (True, False):
            args = (x, c, c, torch.zeros(32), torch.ones(32), train, 0.1, 1e-5)
            workspace, _ = real(aten.native_batch_norm.default, args)
            assert workspace == batch_norm_scratch_bytes(aten.native_batch_norm.default, args)
            out, mean, invstd = aten.native_batch_norm.default(*args)
            for mask in ([True, True, True], [False, True, True], [True, False, False]):
                back = (torch.zeros_like(out), x, c, c, c, mean, invstd, train, 1e-5, mask)
                func = aten.native_batch_norm_backward.default
                workspace, sizes = real(func, back)
                assert workspace == batch_norm_scratch_bytes(func, back)
                assert [i for i, n in enumerate(sizes) if n == 0] == sorted(
                    unallocated_outputs(func, back)
                )
