"""The ``torch.compile`` training step recorded on fake tensors, for the profile.

``compiled_step`` compiles the profiled model's forward with the ``GraphCapture`` backend
(``compiled_graphs.py``: Inductor's pre-grad passes, decompositions, joint-graph passes and
``min_cut_rematerialization_partition`` under the asked ``activation_memory_budget``, the
partitioned forward and backward graphs then run node by node instead of Inductor's
generated code) on the profiler's fake parameters and inputs. One unrecorded iteration
compiles the forward and, at its backward, the backward graphs; the recorded iteration then
runs those graphs under the package's recorder (``CompiledRecorder``), so the timeline has:

* the partitioner's saved set, exactly (what each region's forward returns for its
  backward, saved by AOTAutograd's ``CompiledFunction`` through ``saved_tensors_hooks``);
* the eager code between graph breaks as it runs;
* each compiled region's temporaries as Inductor's generated code for the CPU allocates
  them (``compiled_inductor.py``: its buffers, frees, reuse and order, its C++ kernels
  no-ops), exact against the real compiled CPU step (tests/test_compile.py). Where
  Inductor cannot generate or run a graph's code on fake tensors, that graph runs node by
  node (``torch.fx.Interpreter`` with ``garbage_collect_values``), an upper bound on
  Inductor's fused kernels and reused buffers (``COMPILE_BOUND``; the estimate's
  ``compile_fallbacks`` says why).
  For ``device="cuda"`` the compiled step is recorded with the CPU's semantics: dynamo
  cannot trace the CUDA emulation's ``TorchFunctionMode`` (``cuda_rules.CudaEmulation``;
  on torch 2.13 it stops with "cls_source must not be None for MRO walk"), so the graphs
  are Inductor's decompositions and partition on CPU fake tensors (attention as
  ``_scaled_dot_product_flash_attention_for_cpu``, which keeps the output and the
  log-sum-exp as CUDA's flash kernel does; dropout as Inductor's decomposition, a boolean
  mask on either device), and the eager code between graph breaks runs the CPU kernels,
  autocast by the CPU's lists. The allocator's 512-byte rounding and the accelerator
  extras are applied as for any CUDA estimate. The saved set and the region temporaries
  are UNCONFIRMED against Triton's generated code (compare ``benchmarks/results/
  compile_cuda.json``, the guide on torch.compile).

The module hooks that tell the recorder which module runs are not traced (they are not
registered while dynamo traces, and dynamo does not guard on them:
``torch._dynamo.config.skip_nnmodule_hook_guards``), so a compiled region's events are the
module's that called it (the model's own row for ``compile="model"``, each block's for
``compile="blocks"``, whose compiled call is wrapped by the recorder's hooks).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._estimating.compiled import CompileScope
from .._estimating.levers import repeated_blocks
from .compiled import compiled_run
from .compiled_graphs import BACKEND, captured_graphs
from .recorder import Recorder

__all__ = [
    "COMPILE_BOUND",
    "CompiledRecorder",
    "compiled_module_hooks",
    "compiled_step",
    "uncompiled_saved_tensor_hooks",
]

# What ``est.notes`` says of a compiled step's estimate (module docstring).
COMPILE_BOUND = (
    "torch.compile: the saved set is the partitioner's (exact); the temporaries of a "
    "compiled graph Inductor's code could not run for are its ATen ops run one at a time, "
    "an upper bound on Inductor's fused kernels and reused buffers"
)


class CompiledRecorder(Recorder):
    """The recorder, seeing the compiled code's ops: dynamo skips compiling (and running
    compiled code) under a dispatch mode unless the mode ignores compile internals
    (torch/_dynamo/convert_frame.py: ``any_torch_dispatch_mode_on_stack``;
    torch/utils/_python_dispatch.py: ``TorchDispatchMode.ignore_compile_internals``, "turning
    off the TorchDispatchMode throughout the whole compilation process, and turning it back
    on for the runtime of the compiled artifact(s)"). Compilation happens before recording
    (``compiled_step``'s warm-up), so the recorded run only runs compiled graphs."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # the dispatch below wrapped in torch._disable_dynamo (TorchDispatchMode.
        # __init_subclass__, torch/utils/_python_dispatch.py): where eager code runs between
        # graph breaks, dynamo would otherwise compile the recorder's own frames
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return super().__torch_dispatch__(func, types, args, kwargs)


def _rng_rules() -> None:
    """The recorder's rules for the RNG higher-order ops of a partitioned graph
    (torch/_prims/rng_prims.py): where a checkpointed region inside a compiled region runs
    a random op, the forward graph runs it in ``run_and_save_rng_state`` and the backward's
    recompute in ``run_with_rng_state`` with that state. A higher-order op has no rule for a
    dispatch mode it was not told of ("There was no rule registered for HigherOrderOperator
    run_and_save_rng_state and mode ..."), so the op inside each runs under the recorder as
    the fake tensor rules run it: ``run_and_save_rng_state`` returns the generator's state
    (``torch.get_rng_state()``: the CPU impl's, which ``recorder.tracked_rng_states``
    counts for the CPU) beside the op's output; ``run_with_rng_state`` runs the op without
    setting the state, as its fake tensor rule does (the values change no memory)."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    def save(mode: CompiledRecorder, op: Any, *args: Any, **kwargs: Any) -> Any:
        with mode:
            return torch.get_rng_state(), op(*args, **kwargs)

    def replay(mode: CompiledRecorder, _state: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        with mode:
            return op(*args, **kwargs)

    run_and_save_rng_state.py_impl(CompiledRecorder)(save)
    run_with_rng_state.py_impl(CompiledRecorder)(replay)


_rng_rules()


@contextlib.contextmanager
def compiled_module_hooks(recorder: Recorder, model: torch.nn.Module) -> Iterator[None]:
    """``recorder.module_hooks`` as hooks of each module of ``model`` (not global ones), each
    in ``torch._disable_dynamo``: eager code between graph breaks runs under dynamo's frame
    callback, which would otherwise compile the hooks' own frames. Per module, because
    dynamo guards on the global hooks where it inlines ``Module._call_impl`` (a module with a
    ``__call__`` of its own, as transformers' ``GradientCheckpointingLayer``: the guard
    ``len(...module._global_forward_hooks) != 0``), so hooks added after the warm-up would
    recompile the recorded run, and does not guard on a module's own where they were empty
    when it traced (torch/_dynamo/guards.py, ``EMPTY_NN_MODULE_HOOKS_DICT``, skipped where
    ``torch._dynamo.config.skip_nnmodule_hook_guards``, True by default). A module that has
    forward hooks already (transformers' ``enable_input_require_grads`` puts one on the
    input embeddings) is guarded on their number, so it gets none: where it runs eagerly,
    its events are its parent's."""
    enter = torch._disable_dynamo(lambda m, args: recorder.enter_module(m, args))
    leave = torch._disable_dynamo(lambda m, args, out: recorder.exit_module(m, out))
    handles = []
    try:
        for module in model.modules():
            if module._forward_pre_hooks or module._forward_hooks:
                continue
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def uncompiled_saved_tensor_hooks(
    recorder: Recorder,
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """The recorder's ``saved_tensors_hooks`` pair, each in ``torch._disable_dynamo``
    (as ``compiled_module_hooks``)."""

    def pack(t: torch.Tensor) -> Any:
        return recorder.pack_hook(t)

    def unpack(t: Any) -> torch.Tensor:
        return recorder.unpack_hook(t)

    return torch._disable_dynamo(pack), torch._disable_dynamo(unpack)


# The recorder's module attribution around a compiled call: ``enter(module, args)`` and
# ``exit(module, output)`` (``Recorder.enter_module`` / ``exit_module``).
ModuleHooks = tuple[Callable[[torch.nn.Module, Any], None], Callable[[torch.nn.Module, Any], None]]


@contextlib.contextmanager
def compiled_step(
    model: torch.nn.Module,
    scope_name: str,
    budget: float | None,
    warm_up: Callable[[Callable[..., Any]], None],
    hooks: ModuleHooks | None = None,
    fallbacks: list[str] | None = None,
) -> Iterator[Callable[..., Any]]:
    """``model``'s forward compiled as ``scope_name`` asks with the ``GraphCapture`` backend,
    for the length of the block; ``warm_up(forward)`` runs one unrecorded iteration (the
    compile). Dynamo's caches are reset before and after, the model restored after; a model
    dynamo or Inductor cannot compile is a ValueError giving their reason.

    ``hooks``: called around each call of a compiled module (the model, or each block)
    after the warm-up, outside the compiled code, so that the recorder knows which module
    runs (the global module hooks inside are not traced: module docstring).
    """
    scope = CompileScope(scope_name)
    live: list[ModuleHooks] = []  # the hooks, once the warm-up has compiled
    # compiled_run: the caches reset, the budget patched, the compiler's failures explained
    with (
        compiled_run(scope, budget),
        captured_graphs(True, fallbacks),
        _compiled(model, scope, live) as forward,
    ):
        warm_up(forward)
        if hooks is not None:
            live.append(hooks)
        # the recorded run only runs what the warm-up compiled: a compile there would
        # trace the recorder's hooks (torch.compiler.set_stance, torch >= 2.6)
        with torch.compiler.set_stance("fail_on_recompile"):
            yield forward


@contextlib.contextmanager
def _compiled(
    model: torch.nn.Module, scope: CompileScope, live: list[ModuleHooks]
) -> Iterator[Callable[..., Any]]:
    """The forward compiled as ``scope`` asks (``BACKEND``'s backend: the ``GraphCapture``
    of ``captured_graphs``), the model as it was afterwards. Per block, as
    ``Module.compile(fullgraph=True)`` compiles one (torch/nn/modules/module.py: it sets
    ``_compiled_call_impl``, which ``_wrapped_call_impl`` calls instead of ``_call_impl``)."""
    backend = BACKEND.get("inductor")
    if scope is CompileScope.MODEL:
        # torch.compile(model), as measure compiles it (compiling ``model._call_impl``
        # instead leaves an nn.Sequential uncompiled: its frames are torch's own)
        yield _hooked(_quiet(torch.compile(model, backend=backend)), model, live)
        return
    modules = dict(model.named_modules())
    names = repeated_blocks(tuple(modules), tuple(type(m).__name__ for m in modules.values()))
    if not names:
        raise ValueError(
            f"compile='blocks' compiles each repeated block (the children of a ModuleList "
            f"of one class) on its own, and {type(model).__name__} has no such list; use "
            "compile=True to compile the whole model"
        )
    blocks = [modules[n] for n in names]
    try:
        for block in blocks:
            compiled = torch.compile(block._call_impl, backend=backend, fullgraph=True)
            block._compiled_call_impl = _hooked(compiled, block, live)
        yield model
    finally:
        for block in blocks:
            block._compiled_call_impl = None


def _quiet(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (an ``OptimizedModule``) called without torch's warning that global
    module hooks fire once more for it (torch/_dynamo/eval_frame.py): the recorder's hooks
    are global, and the wrapper's own call is attributed to the model's row."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)`")
            return compiled(*args, **kwargs)

    return call


def _hooked(
    compiled: Callable[..., Any], module: torch.nn.Module, live: list[ModuleHooks]
) -> Callable[..., Any]:
    """``compiled`` with ``live``'s hooks called around it, once there are any (plain
    Python around the compiled frame, which dynamo does not trace)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not live:
            return compiled(*args, **kwargs)
        enter, leave = live[0]
        enter(module, args)
        out = None
        try:
            out = compiled(*args, **kwargs)
            return out
        finally:
            leave(module, out)

    return call
