"""vram_widget._profiling.composites: F.linear run as a real step runs it, and always restored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vram_widget._profiling.composites import (
    _linear_adds_bias_in_place,
    real_run_composites,
    rules_hold,
)


def test_rules_match_this_torch() -> None:
    # read from the autograd node a real call leaves (AddBackward0: the in-place bias add)
    assert rules_hold()


@pytest.mark.parametrize(
    ("x", "in_place"),
    [
        (torch.zeros(2, 4), False),  # 2-D: addmm
        (torch.zeros(2, 5, 4), False),  # contiguous 3-D: flattened into addmm
        (torch.zeros(5, 2, 4).transpose(0, 1), True),  # non-contiguous 3-D
        (torch.zeros(2, 3, 5, 4), False),  # contiguous 4-D with a 1-D bias: flattened
        (torch.zeros(2, 5, 3, 4).transpose(1, 2), True),  # non-contiguous 4-D
        (torch.zeros(4), False),  # contiguous 1-D with a 1-D bias: flattened too
    ],
)
def test_which_inputs_take_the_in_place_add(x: torch.Tensor, in_place: bool) -> None:
    weight = torch.zeros(3, 4, requires_grad=True)
    bias = torch.zeros(3, requires_grad=True)
    assert _linear_adds_bias_in_place(x, weight, bias) is in_place
    assert _linear_adds_bias_in_place(x, weight, None) is False  # no bias, no add
    # what the real kernel did: an in-place bias add leaves AddBackward0 as the last node
    node = F.linear(x, weight, bias).grad_fn
    assert (node is not None and node.name() == "AddBackward0") is in_place


def test_real_run_form_equals_f_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 4, generator=gen).transpose(0, 1)
    weight, bias = torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    expected = F.linear(x, weight, bias)
    with real_run_composites():
        got = F.linear(x, weight, bias)
    torch.testing.assert_close(got, expected)


def test_f_linear_is_restored_even_on_error() -> None:
    original = F.linear
    with pytest.raises(RuntimeError, match="boom"), real_run_composites():
        assert F.linear is not original
        raise RuntimeError("boom")
    assert F.linear is original
