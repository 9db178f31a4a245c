"""One training iteration, written once and used by both the profiler (on fake tensors) and
``measure`` (on real ones), so that the estimate and the measurement follow the same protocol.

The protocol (docs/how-it-works.md): with parameters, buffers, optimizer state and the
input batch resident,

    output = model(*args, **kwargs)        # under autocast for amp-* precisions
    loss = loss_fn(output)
    # outputs="freed": del output (here, before the backward)
    loss.backward()                        # loss_scaled: (loss / k).backward(), loss kept
    # carried_scalars: the loss replaces the one the loop held (carried.py)
    # clip_grad_norm=c: norm = torch.nn.utils.clip_grad_norm_(grads' params, c)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del output, loss                       # (and norm)

By default (``outputs="kept"``) the output lives to the end of the step. With
``outputs="freed"`` it is dropped once the loss is computed, as Hugging Face's
``Trainer.compute_loss`` does (it returns the loss alone: ``outputs`` is local to it,
transformers/trainer.py, 5.x) and torchtune's recipes do (``_loss_step``: ``del logits``,
"free logits otherwise it peaks backward memory", recipes/full_finetune_single_device.py,
0.6.1). What the loss's autograd graph saved stays alive, through the backward.

With ``clip_grad_norm`` the gradients are clipped by torch's own
``torch.nn.utils.clip_grad_norm_`` between the last backward and the optimizer step, and the
total norm it returns is held to the end of the step, as the Trainer (``grad_norm =
self._clip_grad_norm(model)`` before ``self.optimizer.step()``) and torchtune (``grad_norm =
clip_grad_norm_(...)`` before ``self._optimizer.step()``) hold it. With ``loss_scaled`` the
backward runs on ``loss / k``, a new scalar, the loss held beside it (accelerate's
``Accelerator.backward``, which the Trainer calls). With ``carried_scalars`` each loss and the
norm outlive the step, held until the next ones replace them (``carried.py``). The optimizer
is built by ``make_optimizer``, over one group or the Trainer's two (``param_groups.py``).

Inference is ``output = model(...)`` under ``torch.no_grad()``, then ``del output``.

With gradient accumulation of k, the forward, loss and backward run k times (the gradients
summing into ``.grad``) before the one ``optimizer.step()`` and ``zero_grad``. The other levers
(activation checkpointing, a frozen subset) are applied to the model by ``applied_levers``,
the way the real libraries apply them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .._estimating.levers import Levers, repeated_blocks, resolve_levers
from .._estimating.options import (
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    Precision,
)
from .carried import CarriedScalars
from .optimizers import build_optimizer, is_library_optimizer

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


def optimizer_spec(name: OptimizerName) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The registered optimizer's class and keyword arguments (what a wrapper such as
    ``ZeroRedundancyOptimizer`` builds its local optimizer from)."""
    cls, kwargs = _OPTIMIZERS[name]
    return cls, dict(kwargs)


def make_optimizer(
    name: OptimizerChoice,
    params: Iterable[torch.Tensor],
    implementation: OptimizerImplementation | None = None,
    groups: Sequence[Sequence[torch.Tensor]] | None = None,
) -> torch.optim.Optimizer:
    """Build the registered optimizer over ``params``, run as ``implementation``; with
    ``groups``, over those parameter groups instead (``params`` unused).

    ``fused`` passes ``fused=True``, ``foreach`` ``foreach=True``, ``forloop``
    ``foreach=False``; None lets PyTorch choose as it does by default (the single-tensor loop
    on CPU, foreach on CUDA). The CUDA emulation names ``foreach`` explicitly: PyTorch's
    default check (``_default_to_fused_or_foreach``) also looks at ``type(p)``, and a
    FakeTensor is not in its list, so leaving it ``None`` on fake CUDA tensors would pick the
    loop.

    Another library's optimizer (bitsandbytes, torchao, transformers) or a user's callable
    is built by that library or callable (``optimizers.build_optimizer``); it runs its own
    ``step()``, and ``implementation`` does not apply.
    """
    if is_library_optimizer(name):
        # its own param groups do not change its per-parameter state or step
        return build_optimizer(name, [p for p in params if p.requires_grad])
    assert isinstance(name, OptimizerName)
    cls, kwargs = _OPTIMIZERS[name]
    chosen: list[Any]
    if groups is None:
        chosen = [p for p in params if p.requires_grad]
    else:  # param groups, as torch.optim takes them: [{"params": [...]}, ...]
        chosen = [{"params": [p for p in g if p.requires_grad]} for g in groups]
    if implementation is OptimizerImplementation.FUSED:
        return cls(chosen, fused=True, **kwargs)  # type: ignore[call-arg]
    foreach = None if implementation is None else implementation is OptimizerImplementation.FOREACH
    return cls(chosen, foreach=foreach, **kwargs)  # type: ignore[call-arg]


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
        if isinstance(inputs, ModelInputs):
            return inputs
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
    micro_batches: int = 1,
    set_to_none: bool = True,
    outputs_freed: bool = False,
    loss_scaled: bool = False,
    clip_grad_norm: float | None = None,
    clip_foreach: bool | None = None,
    carried: CarriedScalars | None = None,
) -> None:
    """Run one training iteration by the protocol above (``micro_batches`` forward and
    backward passes, accumulating into ``.grad``, before one optimizer step).

    ``context`` replaces the default forward context (autocast for amp precisions); the
    profiler passes its CUDA emulation there.

    With ``optimizer=None`` the gradients of ``params`` are still computed, and set to None
    where ``zero_grad`` would run. ``set_to_none=False``: ``zero_grad(set_to_none=False)``,
    the gradients zeroed in place instead (kept allocated for the next step).

    ``outputs_freed``: the output is dropped right after the loss is computed (before the
    backward). ``loss_scaled``: the backward runs on ``loss / micro_batches``, a new scalar
    dropped after it, the loss kept (accelerate's ``Accelerator.backward``).
    ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_(params with a gradient,
    clip_grad_norm, foreach=clip_foreach)`` after the last backward, its norm held to the
    end. ``clip_foreach`` None is torch's default: foreach (``torch._foreach_norm``, then
    ``torch._foreach_mul_``) for plain CPU and CUDA tensors (``_has_foreach_support`` in
    torch/utils/_foreach_utils.py, read by torch/nn/utils/clip_grad.py), the per-tensor loop
    for any tensor subclass. A FakeTensor is a subclass, so the profiler passes True, the
    path the real tensors take.

    ``carried``: the loop's scalars carried between steps (``carried.py``): each
    micro-batch's loss replaces the one held once its backward has run, instead of being
    dropped before the next forward, and the norm replaces the previous step's at the
    clipping; both outlive the iteration.

    ``between(phase)`` is called at each phase boundary ("backward", "optimizer",
    "zero_grad", "end", and "forward" before each micro-batch after the first), which is how
    the profiler tags phases and ``measure`` resets peaks; ``on_loss(loss)`` right before
    each backward.
    """
    mark = between or (lambda _phase: None)
    for micro in range(micro_batches):
        if micro:
            mark("forward")
        with context() if context is not None else forward_context(precision, device_type):
            output = inputs.call(model)
            loss = compute_loss(output, loss_fn)
            if outputs_freed:
                output = None
        mark("backward")
        root = loss / micro_batches if loss_scaled else loss
        if on_loss is not None:
            on_loss(root)  # the profiler's recorder reads the autograd graph before backward
        if root.requires_grad:  # nothing to differentiate (no trainable parameter)
            root.backward()
        del root
        if carried is not None:
            carried.replace_loss(loss.detach())
        if micro + 1 < micro_batches:
            del output, loss
    norm = None
    if clip_grad_norm is not None:
        with_grad = [p for p in (*params, *_optimized(optimizer)) if p.grad is not None]
        unique = list({id(p): p for p in with_grad}.values())
        if carried is not None:
            carried.replace_norm([p.grad for p in unique if p.grad is not None])
        norm = torch.nn.utils.clip_grad_norm_(unique, clip_grad_norm, foreach=clip_foreach)
        if carried is not None:
            carried.hold_norm(norm)
    mark("optimizer")
    if optimizer is not None:
        optimizer.step()
    mark("zero_grad")
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=set_to_none)
    else:
        for p in params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
    mark("end")
    del output, loss, norm


def _optimized(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The parameters ``optimizer`` steps (none without one)."""
    if optimizer is None:
        return []
    return [p for group in optimizer.param_groups for p in group["params"]]


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


def generate_pass(
    model: Any,
    inputs: ModelInputs,
    precision: Precision,
    device_type: str,
    new_tokens: int,
    *,
    context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    """Hugging Face's ``model.generate``: greedy, exactly ``new_tokens`` new tokens (the
    prompt's prefill, then one decode step per token with the model's own KV cache), under
    autocast for amp precisions. Each pass is generate's first call on ``model``: a
    ``StaticCache`` is otherwise sized by the largest one generate made on the model before
    (``GenerationMixin._previous_max_cache_length``, transformers/generation/utils.py), which
    the pass forgets (the caller restores the model where it must stay as it was)."""
    model.__dict__.pop("_previous_max_cache_length", None)
    with (
        torch.no_grad(),
        context() if context is not None else forward_context(precision, device_type),
    ):
        output = model.generate(
            *inputs.args,
            **inputs.kwargs,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
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


@contextlib.contextmanager
def restored_modules(model: torch.nn.Module) -> Iterator[None]:
    """Put every module of ``model`` back exactly as it was on exit: its attributes, and the
    contents of its dicts (submodules, parameters, hooks), whatever a lever changed (Hugging
    Face's checkpointing flags and input hook, wrapped children)."""
    saved = []
    for module in model.modules():
        attrs = dict(module.__dict__)
        contents = {k: dict(v) for k, v in attrs.items() if isinstance(v, dict)}
        saved.append((module, attrs, contents))
    try:
        yield
    finally:
        for module, attrs, contents in saved:
            module.__dict__.clear()
            module.__dict__.update(attrs)
            for key, items in contents.items():
                target = attrs[key]
                target.clear()
                target.update(items)


def _hf_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's own activation checkpointing, non-reentrant (``activation_
    checkpointing_enable``; ``gradient_checkpointing_enable`` before transformers 5)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )


def apply_levers(model: torch.nn.Module, levers: Levers) -> None:
    """Apply ``levers`` to ``model`` in place, as the libraries do: Hugging Face's
    ``activation_checkpointing_enable`` for its models' ``checkpoint="auto"``, torch's
    ``checkpoint_wrapper`` (non-reentrant) around each other module to checkpoint, and
    ``requires_grad_(False)`` on every parameter not in ``levers.trainable``. (Gradient
    accumulation is the iteration's ``micro_batches``.) A ``checkpoint_policy`` other than
    ``"full"`` is applied by ``checkpoint_policy.apply_checkpoint_policy``."""
    from .fake import checkpoint_wrapped

    if levers.trainable is not None:  # by the names before any wrapper renames them
        keep = set(levers.trainable)
        for name, p in model.named_parameters():
            if name not in keep:
                p.requires_grad_(False)
    if levers.checkpoint and levers.checkpoint_policy != "full":
        from .checkpoint_policy import apply_checkpoint_policy

        apply_checkpoint_policy(model, levers, _hf_checkpointing)
    elif levers.checkpoint_hf:
        _hf_checkpointing(model)
    else:
        modules = dict(model.named_modules())
        for name in levers.checkpoint:
            parent_name, _, child = name.rpartition(".")
            parent = modules[parent_name]
            parent._modules[child] = checkpoint_wrapped(modules[name])


def frozen_by(levers: Levers, names: Iterable[str]) -> set[str]:
    """The parameter names (of ``names``) that ``levers`` freeze."""
    if levers.trainable is None:
        return set()
    keep = set(levers.trainable)
    return {n for n in names if n not in keep}


def _hf_checkpointing_layer() -> type | None:
    """transformers' ``GradientCheckpointingLayer`` (None before transformers 4.52, where
    the layers carry the ``gradient_checkpointing`` flag themselves)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def checkpoint_auto(
    model: torch.nn.Module, names: Sequence[str], types: Sequence[str]
) -> tuple[tuple[str, ...], bool]:
    """What ``checkpoint="auto"`` wraps, and whether Hugging Face's own call applies it: for
    a Hugging Face model that supports it, the layers its ``activation_checkpointing_enable``
    wraps (``GradientCheckpointingLayer``s, transformers/modeling_layers.py); for any other
    model, each child of its largest ``ModuleList`` of repeated blocks."""
    hf = bool(getattr(model, "supports_gradient_checkpointing", False)) and (
        hasattr(model, "activation_checkpointing_enable")
        or hasattr(model, "gradient_checkpointing_enable")
    )
    if hf:
        layer_class = _hf_checkpointing_layer()
        if layer_class is not None:
            layers = [n for n, m in model.named_modules() if isinstance(m, layer_class)]
            outer = [n for n in layers if not any(n.startswith(o + ".") for o in layers)]
            if outer:
                return tuple(outer), True
    blocks = repeated_blocks(names, types)
    return blocks, hf and bool(blocks)


def model_levers(
    model: torch.nn.Module,
    checkpoint: object,
    trainable: object,
    grad_accumulation: object,
    lora_rank: object = None,
    lora_targets: object = "auto",
    checkpoint_policy: object = None,
) -> Levers:
    """The :class:`Levers` the keywords mean for ``model`` (as ``ModelProfile.levers`` does
    from a profile's names)."""
    names, types = [], []
    for name, module in model.named_modules():
        names.append(name)
        types.append(type(module).__name__)
    auto, hf = checkpoint_auto(model, names, types)
    return resolve_levers(
        module_names=names,
        module_types=types,
        param_names=[n for n, _p in model.named_parameters()],
        auto_blocks=auto,
        hf_auto=hf,
        model_name=type(model).__name__,
        checkpoint=checkpoint,
        trainable=trainable,
        grad_accumulation=grad_accumulation,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        checkpoint_policy=checkpoint_policy,
    )


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors of the same
    shapes, dtypes, strides and ``requires_grad`` (tied ones stay tied): the module tree to
    wrap (PEFT's LoRA) without copying, or touching, any weight."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if isinstance(t, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    return copy.deepcopy(model, memo)


def fake_tensors_in_place(modules: Iterable[torch.nn.Module], dtype: torch.dtype) -> None:
    """Replace the parameters and buffers of ``modules`` (meta copies) by CPU tensors of the
    same shapes, strides and ``requires_grad``, the floating ones in ``dtype``; a tensor held
    twice (tied weights, across the modules too) stays one. Call it inside a fake mode, which
    makes them fake."""
    memo: dict[int, torch.Tensor] = {}
    for sub in (s for module in modules for s in module.modules()):
        tables: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
        for table in tables:
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    want = dtype if t.is_floating_point() else t.dtype
                    fake = torch.empty_strided(t.shape, t.stride(), dtype=want, device="cpu")
                    if isinstance(t, torch.nn.Parameter):
                        fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
                    memo[id(t)] = fake
                table[name] = memo[id(t)]


# Where PEFT's get_peft_model puts the wrapped model: its modules' names gain this prefix
# (PeftModel.base_model is the LoraModel, whose .model is the user's model).
PEFT_PREFIX = "base_model.model."


def lora_wrapped(
    model: torch.nn.Module,
    rank: int,
    targets: Sequence[str] | None,
    dtype: str | None = None,
) -> torch.nn.Module:
    """``model`` with LoRA adapters of rank ``rank`` by PEFT's own ``get_peft_model`` (in
    place: give it a copy), with PEFT's ``LoraConfig`` defaults otherwise (alpha 8, no
    dropout); ``targets`` None takes PEFT's defaults for the architecture. ``dtype``
    (``levers.parse_lora_dtype``): None, PEFT's default (adapters upcast to fp32,
    ``autocast_adapter_dtype=True``); ``"base"``, ``autocast_adapter_dtype=False`` (PEFT
    leaves them in the base layer's dtype); a dtype name, that and then the adapters cast
    to it."""
    try:
        import peft
    except ImportError:
        raise ImportError(
            "LoRA (lora_rank=...) is applied by PEFT itself, which is not installed: "
            "pip install peft"
        ) from None
    # PEFT reads a string as one pattern (its "all-linear" shorthand) and a list as names or
    # name suffixes (peft/tuners/tuners_utils.py, check_target_module_exists)
    target_modules: str | list[str] | None = list(targets) if targets else None
    if targets is not None and len(targets) == 1 and targets[0] == "all-linear":
        target_modules = "all-linear"
    config = peft.LoraConfig(r=rank, target_modules=target_modules)
    try:
        if dtype is None:
            return peft.get_peft_model(model, config)
        base_ids = {id(p) for p in model.parameters()}
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        if dtype != "base":
            for p in wrapped.parameters():
                if id(p) not in base_ids and p.is_floating_point():
                    p.data = p.data.to(getattr(torch, dtype))
        return wrapped
    except (ValueError, TypeError, KeyError) as exc:
        what = "PEFT's defaults" if targets is None else f"lora_targets={list(targets)}"
        raise ValueError(
            f"LoRA cannot be applied to {type(model).__name__} with {what}: {exc}. LoRA "
            "targets must be Linear, Conv or Embedding modules, named by a suffix of their "
            "qualified names (lora_targets=['q_proj', 'v_proj']) or 'all-linear'"
        ) from None
