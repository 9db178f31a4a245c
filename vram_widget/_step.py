"""One training iteration, written once and used by both the profiler (on fake tensors) and
``measure`` (on real ones), so that the estimate and the measurement follow the same protocol.

The protocol (DESIGN.md, "Definitions"): with parameters, buffers, optimizer state and the
input batch resident,

    output = model(*args, **kwargs)        # under autocast for amp-* precisions
    loss = loss_fn(output)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del output, loss

Inference is ``output = model(...)`` under ``torch.no_grad()``, then ``del output``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ._options import OptimizerName, Precision

# The optimizer registry: name -> (class, keyword arguments). Hyper-parameters do not change
# memory; these are PyTorch's documented defaults where a default exists.
_OPTIMIZERS: dict[OptimizerName, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    OptimizerName.SGD: (torch.optim.SGD, {"lr": 1e-2}),
    OptimizerName.SGD_MOMENTUM: (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    OptimizerName.ADAM: (torch.optim.Adam, {"lr": 1e-3}),
    OptimizerName.ADAMW: (torch.optim.AdamW, {"lr": 1e-3}),
    OptimizerName.ADAGRAD: (torch.optim.Adagrad, {"lr": 1e-2}),
    OptimizerName.RMSPROP: (torch.optim.RMSprop, {"lr": 1e-2}),
}


def make_optimizer(
    name: OptimizerName, params: Iterable[torch.Tensor], *, foreach: bool | None = None
) -> torch.optim.Optimizer:
    """Build the registered optimizer over ``params``.

    ``foreach=None`` lets PyTorch choose as it does by default (single-tensor loop on CPU,
    foreach on CUDA). The CUDA emulation passes ``foreach=True`` explicitly: PyTorch's default
    check (``_default_to_fused_or_foreach``) also looks at ``type(p)``, and a FakeTensor is not
    in its list, so leaving it ``None`` on fake CUDA tensors would pick the loop.
    """
    cls, kwargs = _OPTIMIZERS[name]
    params = [p for p in params if p.requires_grad]
    return cls(params, foreach=foreach, **kwargs)  # type: ignore[call-arg]


HALF_DTYPES: dict[Precision, torch.dtype] = {
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
    Precision.AMP_BF16: torch.bfloat16,
    Precision.AMP_FP16: torch.float16,
}


def storage_dtype(precision: Precision) -> torch.dtype:
    """The dtype floating parameters, buffers and inputs are stored in."""
    if precision in (Precision.BF16, Precision.FP16):
        return HALF_DTYPES[precision]
    return torch.float32


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """The autocast dtype for amp precisions, else None."""
    if precision in (Precision.AMP_BF16, Precision.AMP_FP16):
        return HALF_DTYPES[precision]
    return None


def forward_context(
    precision: Precision, device_type: str
) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for amp precisions, else a no-op context."""
    amp = autocast_dtype(precision)
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=amp)


def default_loss(output: Any) -> torch.Tensor:
    """The loss used when the user gives none.

    ``output.loss`` (Hugging Face style: a ``ModelOutput`` or dataclass field) or
    ``output["loss"]`` (a plain dict) if present and a tensor, else the first floating tensor
    found in the output (tensor, sequence, mapping or dataclass; dataclass fields in their
    declared order), as ``.float().mean()``. A ``loss`` that is not a scalar is averaged.
    """
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.float().mean()
    tensor = first_floating_tensor(output)
    if tensor is None:
        raise TypeError(
            "the model's output holds no floating-point tensor to build a default loss from "
            f"(got {type(output).__name__}); pass loss_fn=..."
        )
    return tensor.float().mean()


def first_floating_tensor(obj: Any) -> torch.Tensor | None:
    """Depth-first search for the first floating tensor in a nested output."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, Mapping):
        values: Iterable[Any] = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = (getattr(obj, f.name) for f in dataclasses.fields(obj))
    elif isinstance(obj, Sequence) and not isinstance(obj, str):
        values = obj
    else:
        return None
    for value in values:
        found = first_floating_tensor(value)
        if found is not None:
            return found
    return None


def compute_loss(output: Any, loss_fn: Callable[[Any], Any] | None) -> torch.Tensor:
    """Apply ``loss_fn`` (or :func:`default_loss`) and check the result is a scalar tensor."""
    loss = default_loss(output) if loss_fn is None else loss_fn(output)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}; "
            "reduce it (for example with .mean())"
        )
    return loss


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """An example batch, split into positional and keyword tensors (dim 0 is the batch)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @staticmethod
    def from_user(inputs: Any) -> ModelInputs:
        if isinstance(inputs, Mapping):
            return ModelInputs((), dict(inputs))
        if isinstance(inputs, (tuple, list)):
            return ModelInputs(tuple(inputs), {})
        return ModelInputs((inputs,), {})

    def tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for value in (*self.args, *self.kwargs.values()):
            if isinstance(value, torch.Tensor):
                out.append(value)
        return out

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ModelInputs:
        """Apply ``fn`` to every tensor (other values pass through)."""

        def apply(value: Any) -> Any:
            return fn(value) if isinstance(value, torch.Tensor) else value

        return ModelInputs(
            tuple(apply(v) for v in self.args), {k: apply(v) for k, v in self.kwargs.items()}
        )

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors with their names: ``"[i]"`` for the i-th positional, else the keyword."""
        named = [(f"[{i}]", v) for i, v in enumerate(self.args)]
        named += list(self.kwargs.items())
        return [(k, v) for k, v in named if isinstance(v, torch.Tensor)]

    def map_named(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> ModelInputs:
        """Apply ``fn(name, tensor)`` to every tensor (names as ``named_tensors`` gives)."""

        def apply(name: str, value: Any) -> Any:
            return fn(name, value) if isinstance(value, torch.Tensor) else value

        return ModelInputs(
            tuple(apply(f"[{i}]", v) for i, v in enumerate(self.args)),
            {k: apply(k, v) for k, v in self.kwargs.items()},
        )

    def batch_size(self) -> int:
        tensors = [t for t in self.tensors() if t.dim() > 0]
        if not tensors:
            raise ValueError("inputs hold no tensor with a batch dimension (dim 0)")
        return int(tensors[0].shape[0])

    def call(self, model: Callable[..., Any]) -> Any:
        return model(*self.args, **self.kwargs)


def check_model(model: Any) -> None:
    """Raise a TypeError that says what to do when ``model`` is not a module instance."""
    if isinstance(model, torch.nn.Module):
        return
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        raise TypeError(
            f"model is the class {model.__name__}, not a module: instantiate it, e.g. "
            f"{model.__name__}(...) with its constructor arguments"
        )
    if (
        isinstance(model, Mapping)
        and model
        and all(isinstance(v, torch.Tensor) for v in model.values())
    ):
        raise TypeError(
            "model is a state dict: it holds weights but no architecture. Build the model "
            "first, then load the weights into it: model = MyModel(...); "
            "model.load_state_dict(state_dict)"
        )
    raise TypeError(f"model must be a torch.nn.Module instance, got {type(model).__name__}")


_STARS: dict[Any, str] = {
    inspect.Parameter.VAR_POSITIONAL: "*",
    inspect.Parameter.VAR_KEYWORD: "**",
}


def check_forward_accepts(model: torch.nn.Module, inputs: ModelInputs) -> None:
    """Raise a TypeError naming the forward's parameters when the example inputs cannot be
    bound to them (a forward that needs two tensors, given one), before any run."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C++ forward: let the run decide
        return
    try:
        signature.bind(*inputs.args, **inputs.kwargs)
    except TypeError as exc:
        given = [f"{len(inputs.args)} positional"] + [f"keyword {k!r}" for k in inputs.kwargs]
        names = ", ".join(_STARS.get(p.kind, "") + p.name for p in signature.parameters.values())
        raise TypeError(
            f"{type(model).__name__}.forward({names}) cannot take the example inputs "
            f"({', '.join(given)}): {exc}. Give every input the forward needs: "
            "inputs=(x, y) for positional arguments, or inputs={'name': tensor, ...} for "
            "keyword arguments (dim 0 of each batched tensor is the batch)"
        ) from None


def cast_floating(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a floating tensor to ``dtype``; integer tensors (token ids, masks) are kept."""
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def training_iteration(
    model: Callable[..., Any],
    inputs: ModelInputs,
    loss_fn: Callable[[Any], Any] | None,
    optimizer: torch.optim.Optimizer | None,
    precision: Precision,
    device_type: str,
    *,
    params: Sequence[torch.Tensor] = (),
    between: Callable[[str], None] | None = None,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    on_loss: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Run one training iteration by the protocol above.

    ``context`` replaces the default forward context (autocast for amp precisions); the
    profiler passes its CUDA emulation there.

    With ``optimizer=None`` the gradients of ``params`` are still computed, and set to None
    where ``zero_grad`` would run.

    ``between(phase)`` is called at each phase boundary ("backward", "optimizer",
    "zero_grad", "end"), which is how the profiler tags phases and ``measure`` resets peaks;
    ``on_loss(loss)`` right before the backward.
    """
    mark = between or (lambda _phase: None)
    with context() if context is not None else forward_context(precision, device_type):
        output = inputs.call(model)
        loss = compute_loss(output, loss_fn)
    mark("backward")
    if on_loss is not None:
        on_loss(loss)  # the profiler's recorder reads the autograd graph before backward
    if loss.requires_grad:  # nothing to differentiate (no trainable parameter): no backward
        loss.backward()
    mark("optimizer")
    if optimizer is not None:
        optimizer.step()
    mark("zero_grad")
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in params:
            p.grad = None
    mark("end")
    del output, loss


def inference_pass(
    model: Callable[..., Any],
    inputs: ModelInputs,
    precision: Precision,
    device_type: str,
    *,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    """One forward under ``torch.no_grad()`` (and autocast for amp precisions)."""
    with (
        torch.no_grad(),
        context() if context is not None else forward_context(precision, device_type),
    ):
        output = inputs.call(model)
    del output


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause automatic garbage collection while a step runs (restored afterwards).

    Memory must be freed when references drop, as in an ordinary training loop; the cycle
    collector firing at a random point would make two runs disagree. Objects made while it is
    paused stay in the youngest generation, so ``gc.collect(0)`` (fast) collects a step's
    garbage, and the caller's older garbage is left alone.
    """
    gc.collect(0)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
