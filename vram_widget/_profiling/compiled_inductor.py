"""Inductor's generated code for a partitioned graph, run on fake tensors (CPU backend).

``inductor_graph`` compiles one partitioned forward or backward graph with Inductor's own
``compile_fx_inner`` (torch/_inductor/compile_fx.py, the default ``inner_compile``): its
lowering, fusion, scheduling (``reorder_for_peak_memory``, torch/_inductor/memory.py) and
its Python wrapper (torch/_inductor/codegen/wrapper.py, the default; ``cpp_wrapper`` is
off), whose ``call(args)`` allocates each buffer (``empty_strided_cpu``), calls the fused
C++ kernels and the extern kernels (``extern_kernels.mm`` / ``addmm`` / ``bmm``, ATen
fallbacks such as ``aten._scaled_dot_product_flash_attention_for_cpu``), reuses buffers
(``ReuseLine``: ``buf3 = buf0; del buf0  # reuse``), views them (``reinterpret_tensor``)
and frees them (``del bufN``). Run on the profiler's fake tensors under its recorder, that
code allocates and frees exactly what the real compiled step does, in its order:

* the fused C++ kernels only write into buffers the wrapper allocated, so each is replaced
  by a no-op and none is compiled: ``AsyncCompile.cpp_pybinding`` (and ``AsyncCompile.cpp``)
  return one while Inductor compiles (torch/_inductor/async_compile.py; the generated module
  calls them at its top level, when ``PyCodeCache.load_by_key_path`` loads it);
* the wrapper binds ``empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu`` and
  ``reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor``, C++ fast paths that
  bypass the dispatcher (the first allocates a real tensor; the second makes a plain tensor
  on a fake's meta storage): the loaded module's globals get ``torch.empty_strided`` and
  ``torch.as_strided`` instead (``_reinterpret_tensor`` is ``as_strided`` with the offset
  added to the tensor's own, torch/csrc/inductor/inductor_ops.cpp), which fake mode and
  the recorder see;
* the extern kernels, ``assert_size_stride`` and Inductor's random-seed ops run as they
  are, on fake tensors;
* a buffer's storage dies when the wrapper drops its last reference, and the recorder
  notes the free there (its weak reference to the storage), as for any op's output.

The generated module is loaded afresh for each graph (``compile_to_module`` passes the
graph's constants as ``attrs``, and ``PyCodeCache`` caches no module loaded with attrs), and
no stubbed kernel enters ``CppPythonBindingsCodeCache``; the FX graph cache and AOTAutograd's
cache are off during the compile (``GraphCapture``), so nothing compiled here serves a real
run, nor the other way round.

For a CUDA device Inductor generates Triton kernels whose buffer plan may differ (other
fusion and scheduling heuristics): this plans the CPU backend's code, which
``measure(compile=...)`` runs on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["GENERATED_GLOBALS", "inductor_graph"]


def _no_op_kernel(*_args: Any) -> None:
    """A fused C++ kernel: it only writes into the buffers it is given."""
    return None


def _empty_strided_cpu(
    size: Sequence[int], stride: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """``torch._C._dynamo.guards._empty_strided_cpu`` through the dispatcher."""
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret_tensor(
    t: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset_increment: int = 0
) -> torch.Tensor:
    """``torch._C._dynamo.guards._reinterpret_tensor`` (torch/csrc/inductor/inductor_ops.cpp:
    as_strided, the offset added to the tensor's own) through the dispatcher."""
    return torch.as_strided(t, size, stride, t.storage_offset() + offset_increment)


# The names the generated wrapper binds to C++ fast paths (torch/_inductor/codegen/
# wrapper.py, ``PythonWrapperCodegen.write_header``), and what runs instead.
GENERATED_GLOBALS: dict[str, Callable[..., Any]] = {
    "empty_strided_cpu": _empty_strided_cpu,
    "reinterpret_tensor": _reinterpret_tensor,
}


@contextlib.contextmanager
def _kernels_not_compiled() -> Iterator[None]:
    """``AsyncCompile.cpp_pybinding`` / ``cpp`` return a no-op instead of compiling."""
    from torch._inductor.async_compile import AsyncCompile

    cls: Any = AsyncCompile
    saved = cls.cpp_pybinding, cls.cpp
    cls.cpp_pybinding = lambda _self, _argtypes, _source: _no_op_kernel
    cls.cpp = lambda _self, _source: _no_op_kernel
    try:
        yield
    finally:
        cls.cpp_pybinding, cls.cpp = saved


def inductor_graph(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
) -> Callable[[list[Any]], Any]:
    """Inductor's generated code for ``gm`` (module docstring): a boxed callable (it takes
    the inputs list and clears it) that runs the generated wrapper on fake tensors.

    ``kwargs`` are ``compile_fx_inner``'s (what ``compile_fx`` passes its inner compiler).
    Raises what Inductor raises; a graph whose code is not the Python wrapper on the CPU
    (a CUDA graph's Triton kernels) is a ``NotImplementedError``.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    kwargs["cpp_wrapper"] = False
    with inductor_config.patch(cpp_wrapper=False), _kernels_not_compiled():
        compiled: Any = compile_fx_inner(gm, example_inputs, **kwargs)
    code = getattr(compiled, "source_code", "")
    # the loaded module's globals: its Runner's ``call`` (compile_fx.py keeps the runner as
    # ``compiled_fn_runner``; ``current_callable`` may be wrapped by ``post_compile``)
    runner = getattr(compiled, "compiled_fn_runner", None)
    scope = getattr(getattr(getattr(runner, "call", None), "__func__", None), "__globals__", None)
    if (
        scope is None
        or "empty_strided_cpu" not in scope
        or "async_compile.triton(" in code
        or any(d != "cpu" for d in getattr(compiled, "device_types", {"cpu"}))
    ):
        raise NotImplementedError(
            "Inductor's generated code here is not the CPU backend's Python wrapper"
        )
    scope.update(GENERATED_GLOBALS)
    return compiled
