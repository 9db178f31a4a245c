"""Composite ops whose decomposition changes under a dispatch mode, run as a real step runs
them.

Some CompositeImplicitAutograd kernels choose between an in-place and an out-of-place form
with ``isTensorSubclassLike``, which is true for every tensor while any TorchDispatchMode is
active (c10 ``dispatch_mode_enabled()``): the recorder's mode, and fake tensors, are enough.
A real step then allocates less than the profiled one. The kernels are C++ and decompose
below the Python API, so the only place to restore the real choice is at that API, by
running the real decomposition there (which autograd records exactly as it records the C++
one: the same ops, the same saved tensors).

One such kernel changes what a step allocates: ``linear``'s bias add. The rule it follows
is checked once per process against real CPU tensors (``rules_hold``), and nothing is
changed on a torch whose kernel chooses otherwise. ``F.linear`` is swapped for the length of
a profiling run only; a profile is not thread-safe against other threads calling it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def _linear_adds_bias_in_place(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether ``at::native::linear`` (aten/src/ATen/native/Linear.cpp) takes its last
    branch, ``output = at::matmul(input, weight.t()); output.add_(bias)``, for these
    arguments in a real run. The earlier branches: a 2-D input with a bias is one ``addmm``;
    a contiguous 3-D input, or a contiguous strided N-D input with a 1-D bias, is flattened
    into one ``addmm`` (``_flatten_nd_linear``); ``TORCH_LINEAR_FLATTEN_3D=1`` flattens any
    3-D input. Without a bias there is no add. Under a dispatch mode that last branch adds
    out of place instead (one extra output-sized tensor), hence this emulation."""
    if bias is None or input.dim() == 2 or input.dim() == 0 or weight.dim() == 0:
        return False
    if input.is_mkldnn:
        return False
    contiguous = input.is_contiguous()
    if contiguous and input.dim() == 3:
        return False
    strided = input.layout is torch.strided and weight.layout is torch.strided
    if contiguous and strided and bias.dim() == 1:
        return False
    return not (input.dim() == 3 and os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1")


def _linear_as_real_run(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    output = torch.matmul(input, weight.t())
    assert bias is not None  # only called when _linear_adds_bias_in_place
    return output.add_(bias)


@functools.cache
def rules_hold() -> bool:
    """Whether this torch's real ``linear`` chooses as ``_linear_adds_bias_in_place`` says,
    read from the autograd node a real call leaves (``AddBackward0`` for the in-place add,
    ``ViewBackward0`` / ``AddmmBackward0`` for the fused paths) on tiny CPU tensors: a torch
    whose kernel chooses otherwise (the package accepts >= 2.4) is left as it runs."""
    weight = torch.zeros(3, 4, requires_grad=True)
    bias = torch.zeros(3, requires_grad=True)
    cases = [
        torch.zeros(2, 5, 4),  # contiguous 3-D: flattened
        torch.zeros(5, 2, 4).transpose(0, 1),  # non-contiguous 3-D: matmul + add_
        torch.zeros(2, 2, 5, 4),  # contiguous 4-D, 1-D bias: flattened
        torch.zeros(2, 5, 2, 4).transpose(1, 2),  # non-contiguous 4-D: matmul + add_
        torch.zeros(4),  # contiguous 1-D: flattened
    ]
    with torch.enable_grad():
        for x in cases:
            node = F.linear(x, weight, bias).grad_fn
            in_place = node is not None and node.name() == "AddBackward0"
            if in_place != _linear_adds_bias_in_place(x, weight, bias):
                return False
    return True


@contextlib.contextmanager
def real_run_composites() -> Iterator[None]:
    """Within this context, ``torch.nn.functional.linear`` runs in the form a real step
    takes (a no-op where this torch's kernel chooses otherwise than the rules say).

    ``nn.Linear`` calls ``F.linear`` and ``F.multi_head_attention_forward`` calls the module
    global ``linear``, both looked up at call time, so the module attribute is swapped for
    the duration of a profiling run and always restored. A TorchFunctionMode cannot do this:
    it sees ``multi_head_attention_forward`` as one call and is off inside its handler, so
    the ``linear`` calls within are out of its reach."""
    if not rules_hold():
        yield
        return
    original = F.linear

    def linear(input: Any, weight: Any, bias: Any = None) -> Any:
        if isinstance(input, torch.Tensor) and _linear_adds_bias_in_place(input, weight, bias):
            return _linear_as_real_run(input, weight, bias)
        return original(input, weight, bias)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


__all__ = ["real_run_composites", "rules_hold"]
