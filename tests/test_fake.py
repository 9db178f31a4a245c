"""The private-torch shims of ``vram_widget._profiling.fake``: what MetaShortcuts skips and
what it runs."""

from __future__ import annotations

import torch

from vram_widget._profiling.fake import MetaShortcuts


def test_real_tensors_run_in_full() -> None:
    # The optimizer's step counters are real CPU tensors: their values feed the bias
    # corrections, so their in-place updates must really happen.
    step = torch.zeros(())
    with MetaShortcuts():
        step.add_(1)
        torch._foreach_add_([step], 1)
    assert step.item() == 2.0


def test_in_place_pointwise_meta_ops_return_self_and_allocate_nothing() -> None:
    x = torch.empty(4, 3, device="meta")
    y = torch.empty(4, 3, device="meta")
    with MetaShortcuts():
        out = x.addcmul_(y, y, value=0.5)
        assert out is x
        (same,) = torch._foreach_lerp_([x], [y], 0.1)  # the binding hands back self
        assert same is x


def test_in_place_view_ops_still_run() -> None:
    # resize_ and unsqueeze_ change the tensor itself: never skipped
    x = torch.empty(4, 3, device="meta")
    with MetaShortcuts():
        x.unsqueeze_(0)
        x.resize_(5, 5)
    assert tuple(x.shape) == (5, 5)


def test_repeated_out_of_place_ops_give_new_tensors_of_the_same_metadata() -> None:
    a = torch.empty(2, 3, 8, 8, device="meta").to(memory_format=torch.channels_last)
    with MetaShortcuts() as mode:
        first = torch.sqrt(a)
        second = torch.sqrt(a)
        both = torch._foreach_sqrt([a, a])
        again = torch._foreach_sqrt([a, a])
    assert len(mode._outputs) == 2  # one remembered result per distinct call
    for out in (first, second, *both, *again):
        assert (out.shape, out.stride(), out.dtype) == (a.shape, a.stride(), a.dtype)
    # new storages, as the real kernels give: the recorder sees each as an allocation
    storages = {t.untyped_storage()._cdata for t in (first, second, *both, *again)}
    assert len(storages) == 6
    mixed = torch.empty(3, device="meta", dtype=torch.bfloat16)
    with MetaShortcuts():
        promoted = torch.add(mixed, torch.empty(3, device="meta"))  # bf16 + fp32 -> fp32
    assert promoted.dtype == torch.float32
