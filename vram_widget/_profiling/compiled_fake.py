"""The compiled step's saved set on fake tensors (a private prototype).

``fake_saved_set`` runs two training steps of ``torch.compile(model)`` with the
``GraphCapture`` backend (``compiled_graphs.py``: Inductor's own passes and partitioner, the
graphs run node by node) on fake parameters, buffers and inputs: no real memory, no kernel
compiled. The partitioner decides the saved set from shapes alone, so it is the one the real
compiled step keeps (checked to the byte against ``measure(compile=True)`` in
tests/test_compile.py and benchmarks/accuracy_compile.py). ``graph_breaks`` lists dynamo's
graph breaks with their reasons (``torch._dynamo.explain``), on fakes too.

The model passed in is not compiled: its parameters and buffers are swapped for fakes for
the length of the call (``fake.reparametrized``, as the profiler swaps them), the
whole-model compile wraps it (``torch.compile`` returns an ``OptimizedModule`` around it) and
the per-block compile sets each block's ``_compiled_call_impl`` (as ``Module.compile``
does, torch/nn/modules/module.py) and restores it after.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._estimating.compiled import CompileScope, parse_activation_memory_budget, parse_compile
from .._estimating.levers import repeated_blocks
from .._estimating.options import Precision, parse_option
from .compiled_graphs import captured_graphs
from .fake import new_fake_mode, reparametrized
from .step import ModelInputs, cast_floating, compute_loss, storage_dtype

__all__ = ["FakeSavedSet", "fake_saved_set", "graph_breaks"]


@dataclasses.dataclass(frozen=True)
class FakeSavedSet:
    """What the compiled forward leaves for the backward, read from the partitioned graphs.

    Attributes
    ----------
    saved_bytes
        The unique storages of every region's saved values, less the parameters, buffers,
        inputs and outputs (as ``Measurement.saved_bytes`` counts them). Compiled regions
        only: with ``compile="blocks"`` (or graph breaks around eager code) what the eager
        rest of the model saves is autograd's, not counted here (for GPT-2 and Llama tiny
        configs, the embeddings, final norm, output projection and loss).
    region_count
        The compiled regions (graphs) of the forward: one more per graph break.
    """

    saved_bytes: int
    region_count: int


def fake_saved_set(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], Any] | None = None,
    precision: str | Precision = "fp32",
    compile: object = True,
    activation_memory_budget: float | None = None,
) -> FakeSavedSet:
    """The saved set of ``torch.compile``'s training step of ``model``, on fake tensors.

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    >>> s = fake_saved_set(model, torch.randn(2, 8))
    >>> s.saved_bytes  # the first Linear's output and the GELU's: 2 x (2 x 16 x 4 B)
    256
    """
    scope = parse_compile(compile)
    if scope is None:
        raise ValueError("fake_saved_set reads torch.compile's saved set: give compile=True")
    budget = parse_activation_memory_budget(activation_memory_budget, scope)
    prec = parse_option(Precision, precision, "precision")
    if prec in (Precision.AMP_BF16, Precision.AMP_FP16):
        raise ValueError(f"precision={prec.value!r}: the prototype runs fp32, bf16 and fp16")
    dtype = storage_dtype(prec)
    from torch._functorch import config as functorch_config

    patch = (
        functorch_config.patch(activation_memory_budget=budget)
        if budget is not None
        else contextlib.nullcontext()
    )
    torch._dynamo.reset()
    try:
        with (
            patch,
            _faked(model, inputs, dtype) as fake_inputs,
            captured_graphs() as capture,
            _compiled(model, scope) as forward,
        ):
            for _ in range(2):  # the first compiles the backward; the second is read
                for p in model.parameters():
                    p.grad = None
                output = fake_inputs.call(forward)
                capture.note_forward((fake_inputs.args, fake_inputs.kwargs), output)
                loss = compute_loss(output, loss_fn)
                loss.backward()
                del output, loss
            for p in model.parameters():
                p.grad = None
    finally:
        torch._dynamo.reset()
    return FakeSavedSet(capture.saved_bytes(), len(capture.regions))


def graph_breaks(model: torch.nn.Module, inputs: Any) -> tuple[str, ...]:
    """Dynamo's graph breaks in ``model``'s forward, each ``"reason (file:line)"``, from
    ``torch._dynamo.explain`` on fake tensors."""
    torch._dynamo.reset()
    try:
        with _faked(model, inputs, None) as fake_inputs:
            explained = torch._dynamo.explain(model)(*fake_inputs.args, **fake_inputs.kwargs)
    finally:
        torch._dynamo.reset()
    breaks = []
    for brk in explained.break_reasons:
        where = brk.user_stack[-1] if brk.user_stack else None
        site = f" ({where.filename}:{where.lineno})" if where is not None else ""
        breaks.append(f"{str(brk.reason).strip().splitlines()[0]}{site}")
    return tuple(breaks)


@contextlib.contextmanager
def _faked(model: torch.nn.Module, inputs: Any, dtype: torch.dtype | None) -> Iterator[ModelInputs]:
    """``model``'s parameters and buffers swapped for fakes (floating ones in ``dtype``),
    and the inputs as fakes, inside a fake mode."""
    mode = new_fake_mode()

    def fake(t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = mode.from_tensor(t.detach())
        if dtype is not None:
            with mode:
                out = cast_floating(out, dtype)
        return out

    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # tied weights once: reparametrized ties them
        state[name] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
    for name, b in model.named_buffers():
        state[name] = fake(b)
    user = ModelInputs.from_user(inputs)
    fake_inputs = user.map(fake)
    with reparametrized(model, state), mode:
        yield fake_inputs


@contextlib.contextmanager
def _compiled(model: torch.nn.Module, scope: CompileScope) -> Iterator[Callable[..., Any]]:
    """The forward compiled as ``scope`` asks, the model as it was afterwards."""
    from .compiled_graphs import BACKEND

    backend = BACKEND.get("inductor")
    if scope is CompileScope.MODEL:
        yield torch.compile(model, backend=backend)
        return
    modules = dict(model.named_modules())
    names = repeated_blocks(tuple(modules), tuple(type(m).__name__ for m in modules.values()))
    if not names:
        raise ValueError(f"compile='blocks': {type(model).__name__} has no repeated blocks")
    blocks = [modules[n] for n in names]
    try:
        for block in blocks:
            block._compiled_call_impl = torch.compile(
                block._call_impl, backend=backend, fullgraph=True
            )
        yield model
    finally:
        for block in blocks:
            block._compiled_call_impl = None
