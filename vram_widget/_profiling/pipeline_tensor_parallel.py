"""Tensor parallelism inside pipeline stages (``gpus = pp x tp``): each pipeline stage's
module sharded by the model's tensor-parallel plan over the ``tp`` ranks that hold the
same stage.

As torchtitan composes them (torchtitan 0.3, torchtitan/distributed/pipeline_parallel.py,
``pipeline_llm``: the model split into stages on the ``pp`` sub-mesh, then each stage's
model part parallelized alone by ``parallelize_fn``, whose tensor parallelism shards it on
the ``tp`` sub-mesh, torchtitan/models/llama3/parallelize.py), the world's ranks form a 2-D
mesh ``("pp", "tp")``, pp the outer dimension (``ParallelDims.build_mesh``,
torchtitan/distributed/parallel_dims.py, ``["pp", "dp_replicate", "fsdp", "tp"]``): rank
``r`` holds stage ``r // tp`` as tensor-parallel rank ``r % tp``, and sends to and receives
from the ranks of the same tensor-parallel index on the ``pp`` sub-mesh.

A Hugging Face decoder is sharded by its own plan (``tensor_parallel.resolve_plan``, as
``from_pretrained(tp_plan="auto")`` resolves it) through transformers'
``apply_tensor_parallelism``, each stage by the plan's entries for the modules it holds
(the first stage's embedding, every stage's decoder layers, the last stage's head). Every
style of that plan hands its output back as a local, replicated tensor
(``colwise`` into ``rowwise`` in each layer, ``embedding_rowwise`` and
``colwise_gather_output`` at the ends: transformers/distributed/tensor_parallel.py), so a
stage's outputs, and its send and receive buffers, are plain tensors of the whole hidden
size, what ``PipelineStage`` sends (torch/distributed/pipelining/stage.py sends
``torch.Tensor`` outputs). torchtitan's own Llama plan would send less: its sequence
parallelism (``SequenceParallel`` norms, ``RowwiseParallel(output_layouts=Shard(1))``,
torchtitan/models/llama3/parallelize.py, ``apply_tp``) leaves a stage's output sharded on
the sequence; a plan of torch styles is refused with ``pp`` (``check_pipeline_parallel``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "dtensor_caches_cleared",
    "meshes_concatenated_outside_fake_mode",
    "parallelize_stage",
    "stage_plan",
]


def _clear_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans."""
    from torch.distributed.tensor import DTensor, _redistribute

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    planner = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if planner is not None:
        planner()


@contextlib.contextmanager
def dtensor_caches_cleared() -> Iterator[None]:
    """DTensor's caches emptied on entering and on leaving, whatever happens inside.

    DTensor caches each op's sharding decision and each redistribution's plan by the
    DTensors' specs, whose meshes compare equal by their ranks and dimension names, not
    by their process groups (torch/distributed/tensor/_sharding_prop.py,
    ``propagate_op_sharding``'s ``LocalLRUCache`` and the C++ dispatch's own cache;
    ``_redistribute._gen_transform_infos``). A ``("pp", "tp")`` mesh made again, after the
    groups of an earlier one were destroyed (each fake step's group, or the group a forked
    rank inherits), gets groups of other names, and a cached decision would send its
    collectives to a group no longer registered ("Could not resolve the process group").
    """
    _clear_dtensor_caches()
    try:
        yield
    finally:
        _clear_dtensor_caches()


@contextlib.contextmanager
def meshes_concatenated_outside_fake_mode() -> Iterator[None]:
    """``DeviceMesh._concatenate`` run with the fake mode set aside, for ``fully_shard``
    over the DTensor parameters of a stage made fake (FSDP2 over tensor-parallel ranks).

    ``fully_shard`` joins the data-parallel mesh and each tensor-parallel parameter's mesh
    into one (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``_init_sharding_spec_tp``:
    ``DeviceMesh._concatenate([dp_mesh, tp_mesh])``), and the new ``DeviceMesh`` indexes its
    rank map, a real int tensor, which the fake mode refuses as an input
    (torch/distributed/device_mesh.py, ``DeviceMesh.mesh``). A mesh holds rank numbers, no
    step's memory: building it outside the fake mode changes no tensor of the step."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(device_mesh_list: list[Any]) -> Any:
        with unset_fake_temporarily():
            return original(device_mesh_list)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)  # type: ignore[method-assign]


def stage_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """The Hugging Face plan's entries for the modules and parameters ``model`` (a stage's
    copy of the causal LM, ``pipeline_parallel.stage_copy``) holds: the plan resolved on
    the copy (whose layers are renumbered from 0), less the embedding a later stage does not
    hold and the head an earlier stage replaces by ``nn.Identity``.

    Examples
    --------
    >>> import transformers
    >>> from vram_widget._profiling.pipeline_parallel import stage_copy
    >>> config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32,
    ...     num_attention_heads=2, intermediate_size=64, vocab_size=100)
    >>> stage = stage_copy(transformers.LlamaForCausalLM(config), 1, 2, meta=True)
    >>> plan = stage_plan(stage.model, 2)
    >>> plan["lm_head"], "model.embed_tokens" in plan, "model.layers.1.mlp.up_proj" in plan
    ('colwise_gather_output', False, False)
    """
    from .tensor_parallel import resolve_plan

    styles = resolve_plan(model, tp).styles
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    out = {}
    for name, style in styles.items():
        module = modules.get(name)
        held = name in parameters or (module is not None and not isinstance(module, nn.Identity))
        if held:
            out[name] = style
    return out


def parallelize_stage(module: nn.Module, tp_mesh: Any) -> None:
    """``module`` (a ``pipeline_parallel.StageModule``) sharded in place over ``tp_mesh``
    by its model's Hugging Face plan (:func:`stage_plan`)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model: Any = module.model
    apply_tensor_parallelism(model, tp_mesh, stage_plan(model, tp_mesh.size()))
