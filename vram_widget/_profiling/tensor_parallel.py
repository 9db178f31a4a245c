"""Tensor parallelism: one rank's shard of the model, made by DTensor on a fake process group.

A tensor-parallel rank runs the model with its Linear (and embedding) weights split over
``tp`` ranks, and DTensor's collectives between them. Its memory is profiled on a copy of
the model parallelized by the same library a real run uses: a Hugging Face model's own plan
through transformers' ``apply_tensor_parallelism`` (transformers/distributed/
tensor_parallel.py, which ``from_pretrained(tp_plan="auto")`` calls through
``maybe_distribute_model`` in transformers/distributed/mixin.py), or a user's plan of
``torch.distributed.tensor.parallel`` styles through ``parallelize_module``. The profile's
runs use PyTorch's fake process group (torch/testing/_internal/distributed/fake_pg.py: one
rank, no communication, collectives' outputs of the right shapes), as torchtitan's memory
estimation script does (torchtitan 0.3, scripts/estimate/estimation.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "DTENSOR_TYPES",
    "WAITS_RETURN_INPUT",
    "TensorParallelPlan",
    "fake_process_group",
    "is_dtensor",
    "local_part",
    "local_shard_like",
    "parallelized",
    "resolve_plan",
    "tensor_parallel_lora",
]

try:
    from torch.distributed.tensor import DTensor

    DTENSOR_TYPES: frozenset[type] = frozenset({DTensor})
except ImportError:  # a torch built without distributed
    DTENSOR_TYPES = frozenset()
try:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    WRAPPED_COLLECTIVE_TYPES: frozenset[type] = frozenset({AsyncCollectiveTensor})
except ImportError:
    WRAPPED_COLLECTIVE_TYPES = frozenset()


def _waits() -> frozenset[Any]:
    try:
        return frozenset({torch.ops._c10d_functional.wait_tensor.default})
    except (AttributeError, RuntimeError):  # a torch built without distributed
        return frozenset()


# Functional collectives' wait: in eager, ``wait_tensor`` hands back the tensor it waited on
# (a real gloo rank's allocator records no allocation for it), where its meta kernel, which
# fake tensors run, makes a new one (torch/distributed/_functional_collectives.py,
# ``_wait_tensor_meta``: ``return torch.empty_like(self)``): an allocation no real run makes.
WAITS_RETURN_INPUT = _waits()


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (a tensor-parallel shard)."""
    return type(t) in DTENSOR_TYPES


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s memory: a DTensor's local shard, the result
    an ``AsyncCollectiveTensor`` (a functional collective's output not waited on yet, as
    ``DTensor.to_local`` may return it) wraps, else ``t``."""
    kind = type(t)
    if kind in DTENSOR_TYPES:
        return t._local_tensor  # type: ignore[attr-defined]
    if kind in WRAPPED_COLLECTIVE_TYPES:
        return t.elem  # type: ignore[attr-defined]
    return t


def local_shard_like(
    p: torch.Tensor, dtype: torch.dtype, real: bool, device: str = "cpu"
) -> torch.Tensor:
    """A new leaf DTensor with ``p``'s mesh, placements and global shape, whose local shard
    is a new tensor of ``dtype`` (fake inside a fake mode, real zeros for the fallback)."""
    from torch.distributed.tensor import DTensor

    assert isinstance(p, DTensor)
    local = p.to_local()
    if real:
        t = torch.zeros(tuple(local.shape), dtype=dtype, device="cpu")
    else:
        t = torch.empty_strided(tuple(local.shape), local.stride(), dtype=dtype, device=device)
    out = DTensor.from_local(
        t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return out.detach().requires_grad_(p.requires_grad)


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    """Which modules a tensor-parallel degree shards, and how.

    Attributes
    ----------
    styles : dict
        Module name (exact, after the patterns were expanded) -> a transformers style name
        (``"colwise"``, ``"rowwise"``, ``"embedding_rowwise"``...) or a
        ``torch.distributed.tensor.parallel.ParallelStyle``.
    source : str
        ``"transformers"`` (the model's own plan) or ``"user"``.
    """

    styles: dict[str, Any]
    source: str

    @property
    def huggingface(self) -> bool:
        return self.source == "transformers"


def _hf_plan(model: torch.nn.Module, tp: int) -> dict[str, Any] | None:
    """The model's own expanded plan, as ``from_pretrained(tp_plan="auto")`` resolves it
    (``_resolve_parallel_plans`` with ``DistributedConfig(tp_size=tp)``), or None for a
    model without one."""
    resolve: Any = getattr(model, "_resolve_parallel_plans", None)
    if resolve is None or not getattr(model, "tp_plan", None):
        return None
    from transformers.distributed.configuration_utils import DistributedConfig

    plan, _ep, _fsdp = resolve(DistributedConfig(tp_size=tp))
    return dict(plan)


def _user_plan(model: torch.nn.Module, tp_plan: dict[str, Any]) -> dict[str, Any]:
    """A user's ``{pattern: ParallelStyle}`` expanded to module names (``*`` matches one
    name part, as transformers' plans and ``parallelize_module`` read it)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    names = [n for n, _m in model.named_modules() if n]
    out: dict[str, Any] = {}
    for pattern, style in tp_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"tp_plan[{pattern!r}] is a {type(style).__name__}; a tp_plan maps module "
                "patterns to torch.distributed.tensor.parallel styles (ColwiseParallel(), "
                "RowwiseParallel(), SequenceParallel()...)"
            )
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        matched = [n for n in names if regex.fullmatch(n)]
        if not matched:
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module of the model")
        out.update(dict.fromkeys(matched, style))
    return out


def resolve_plan(model: torch.nn.Module, tp: int, tp_plan: object = None) -> TensorParallelPlan:
    """The plan ``tp`` ranks shard ``model`` by, checked before any profiling.

    Raises
    ------
    ValueError
        For a model with no plan and no ``tp_plan``, or a degree that does not divide a
        size the plan shards (the attention heads, the key/value heads, a Linear's
        output or input features, an embedding's rows), each named.
    """
    if tp_plan is not None:
        if not isinstance(tp_plan, dict) or not tp_plan:
            raise TypeError(
                "tp_plan must be a dict of module patterns to torch.distributed.tensor."
                f"parallel styles, got {type(tp_plan).__name__}"
            )
        plan = TensorParallelPlan(_user_plan(model, tp_plan), "user")
    else:
        styles = _hf_plan(model, tp)
        if styles is None:
            raise ValueError(
                f"tp={tp}: {type(model).__name__} has no tensor-parallel plan (a Hugging Face "
                "model's config.base_model_tp_plan, the plan from_pretrained(tp_plan='auto') "
                "uses); pass tp_plan={'module.pattern': ColwiseParallel(), ...} with "
                "torch.distributed.tensor.parallel styles"
            )
        plan = TensorParallelPlan(styles, "transformers")
    _check_divides(model, tp, plan)
    return plan


def _check_divides(model: torch.nn.Module, tp: int, plan: TensorParallelPlan) -> None:
    """A clear error where ``tp`` does not divide what the plan shards."""
    config = getattr(model, "config", None)
    projections = {n.rsplit(".", 1)[-1] for n in plan.styles}
    for attr, shards in (
        ("num_attention_heads", "q_proj"),
        ("num_key_value_heads", "k_proj"),
    ):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and shards in projections and heads % tp:
            raise ValueError(
                f"tp={tp} does not divide the model's {attr}={heads}: the plan shards "
                f"{shards} by heads; use a tp that divides {heads}"
            )
    modules = dict(model.named_modules())
    for name, style in plan.styles.items():
        module = modules.get(name)
        for attr in ("out_features", "in_features", "num_embeddings"):
            size = getattr(module, attr, None)
            if isinstance(size, int) and _shards(style, attr) and size % tp:
                raise ValueError(
                    f"tp={tp} does not divide {name}.{attr}={size}, which the plan "
                    f"shards ({_style_name(style)}); use a tp that divides {size}"
                )


def _style_name(style: object) -> str:
    return style if isinstance(style, str) else type(style).__name__


def _shards(style: object, attr: str) -> bool:
    """Whether ``style`` splits a module along ``attr``."""
    name = _style_name(style).lower()
    if attr == "out_features":
        return "colwise" in name
    if attr == "in_features":
        return "rowwise" in name and "embedding" not in name
    return "embedding_rowwise" in name or name == "rowwiseparallel"


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[Any]:
    """A default process group of PyTorch's fake backend and its 1-D CPU mesh, destroyed
    on leaving, whatever happens inside.

    Raises
    ------
    RuntimeError
        Where this process is already in a process group (its group is left as it is).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "estimating tp > 1 profiles one rank on a fake process group of its own; this "
            "process is already in a torch.distributed process group: estimate from a "
            "process outside it"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _sharding_propagation_unrecorded():
            yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _sharding_propagation_unrecorded() -> Iterator[None]:
    """DTensor's sharding propagation outside the dispatch modes that are on.

    DTensor derives an op's output shapes by running it on fake tensors of the global
    shapes (``ShardingPropagator._propagate_tensor_meta_non_cached``, torch/distributed/
    tensor/_sharding_prop.py, under the fake mode it detects), once per op signature: the
    recorder would read those as allocations, at the first run only. Run with no mode on,
    it makes a fake mode of its own (no memory either way)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def unrecorded(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = unrecorded  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def parallelized(model: torch.nn.Module, plan: TensorParallelPlan, mesh: Any) -> torch.nn.Module:
    """``model`` (a copy: changed in place) sharded over ``mesh`` by ``plan``'s library."""
    if plan.huggingface:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        return apply_tensor_parallelism(model, mesh, plan.styles)
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, plan.styles)


# The styles PEFT gives LoRA adapters a tensor-parallel layout for (peft 0.21.2,
# peft/tuners/lora/model.py, LoraModel._create_and_replace: ``_SUPPORTED_TP_PLANS =
# ("colwise", "rowwise", "embedding_rowwise")``); on a base layer of any other style it
# warns and makes the adapters whole, without tensor-parallel hooks
PEFT_TP_STYLES = frozenset({"colwise", "rowwise", "embedding_rowwise"})


def tensor_parallel_lora(
    model: torch.nn.Module, rank: int, targets: tuple[str, ...] | None, dtype: str | None
) -> torch.nn.Module:
    """PEFT's LoRA on ``model`` as a Hugging Face plan sharded it (in place: give it a copy).

    ``from_pretrained(tp_plan="auto")`` leaves the layout on the model
    (transformers/distributed/mixin.py, ``maybe_distribute_model``: ``config.
    distributed_config``, ``_device_mesh``, ``_tp_size``), where PEFT reads it
    (peft/tuners/lora/model.py, ``get_tp_plan_and_mesh``: the mesh and the base layer's
    style from ``model.tp_plan``); the same three are set here, then ``get_peft_model``
    runs (``step.lora_wrapped``). PEFT 0.21.2 then shards the adapter on the sharded side
    (``add_lora_tp_hooks_dtensor``): a colwise base layer's ``lora_B`` becomes a DTensor
    ``Shard(0)`` of ``out_features / tp`` rows and its ``lora_A`` stays whole on every
    rank; a rowwise one's ``lora_A`` a ``Shard(1)`` of ``in_features / tp`` columns and
    its ``lora_B`` whole; each sharded adapter gets its base layer's style's forward hooks.

    Raises
    ------
    ValueError
        Where an adapter's base layer is sharded by a style PEFT does not lay adapters out
        for (the Hugging Face plan's ``colwise_gather_output`` head, or a user's plan).
    """
    from transformers.distributed.configuration_utils import DistributedConfig

    from .step import lora_wrapped

    mesh = next(p.device_mesh for p in model.parameters() if is_dtensor(p))  # type: ignore[attr-defined]
    tp = mesh.size()
    config: Any = getattr(model, "config", None)
    if config is not None:
        config.distributed_config = DistributedConfig(tp_size=tp)
    model._device_mesh = mesh
    model._tp_size = tp
    wrapped = lora_wrapped(model, rank, targets, dtype)
    for name, module in wrapped.named_modules():
        base = getattr(module, "base_layer", None)
        weight = getattr(base, "weight", None)
        if not hasattr(module, "lora_A") or not is_dtensor(weight):
            continue
        style = getattr(base, "_hf_tp_plan", None)
        if style not in PEFT_TP_STYLES:
            short = name.removeprefix("base_model.model.")
            raise ValueError(
                f"lora_rank with tp={tp}: {short} is sharded by "
                f"{'no Hugging Face style' if style is None else repr(style)}, and PEFT lays "
                "LoRA adapters out over tensor-parallel ranks only on the plan's 'colwise', "
                "'rowwise' and 'embedding_rowwise' layers (peft/tuners/lora/model.py); "
                "leave it out of lora_targets"
            )
    return wrapped


def rank_setup(
    plan: TensorParallelPlan,
    tp: int,
    reshard_after_forward: bool | None = None,
    lora: tuple[int, tuple[str, ...] | None, str | None] | None = None,
) -> Any:
    """How a real tensor-parallel rank of ``measure(gpus=k, tp=k)`` shards its copy: the
    plan applied by its library on a 1-D CPU mesh of the gloo group's ranks, to a meta copy
    of the model (so each rank holds its shards only, never the whole weights), then
    materialized (``to_empty``) with the copy's buffers and a seeded N(0, 0.02) fill of the
    shards (the step's memory does not read the weights' values). Each collective drops
    its buffers on the rank's own thread (``distributed._collectives_release_on_caller``),
    so every measured step reads the same bytes.

    With ``reshard_after_forward`` (not None: ``"zero3"`` True, ``"zero2"`` False) and a
    world of ``dp x tp`` ranks, the ranks form a 2-D mesh ``("dp_shard", "tp")``, tp the
    inner dimension, as torchtitan 0.3 lays its dense mesh out (``ParallelDims.build_mesh``,
    torchtitan/distributed/parallel_dims.py:237, ``["pp", "dp_replicate", "fsdp", "tp"]``);
    the plan is applied on the ``tp`` sub-mesh first (torchtitan/models/llama3/parallelize.py:53,
    ``model.parallelize(parallel_dims)``), then a training copy is wrapped by FSDP2 on the
    ``dp_shard`` sub-mesh, each block then the root (parallelize.py:77-80, ``apply_fsdp_to_decoder``
    on ``get_mesh(["fsdp"])``; torchtitan/distributed/fsdp.py:209 and 310), by the units and
    policy ``measure``'s FSDP ranks use (``distributed.fully_sharded``).

    Under ``"hsdp"`` (``reshard_after_forward`` True), the ranks form a 3-D mesh
    ``("dp_replicate", "dp_shard", "tp")``, a node's ``gpus_per_node`` ranks being
    ``dp_shard x tp`` (torchtitan 0.3.0's ``["pp", "dp_replicate", "fsdp", "tp"]``,
    parallel_dims.py:329-334), and FSDP2 shards on the 2-D ``("dp_replicate", "dp_shard")``
    sub-mesh after the plan is applied on ``"tp"`` (parallelize.py:53 then 74-80:
    ``get_mesh(["dp_replicate", "fsdp"])`` where a replicate degree is set): sharded within
    ``dp_shard``, the gradient shards all-reduced across ``dp_replicate``.

    With ``lora`` (rank, targets, dtype), PEFT's LoRA is applied to the sharded copy
    (:func:`tensor_parallel_lora`), as a model loaded with ``from_pretrained(tp_plan=
    "auto")`` is wrapped by ``get_peft_model`` after it is sharded."""
    from .._estimating.options import Strategy
    from .distributed import RankSetup

    def wrap(model: torch.nn.Module, parallel: Any, precision: Any) -> torch.nn.Module:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from .distributed import fully_sharded
        from .step import meta_copy

        world = dist.get_world_size()
        dp = world // tp
        dp_mesh = None
        if dp > 1 and parallel.strategy is Strategy.HSDP:
            # the nodes replicate; a node's gpus_per_node ranks are dp_shard x tp
            shard = min(world, parallel.gpus_per_node) // tp
            names = ("dp_replicate", "dp_shard", "tp")
            mesh = init_device_mesh("cpu", (dp // shard, shard, tp), mesh_dim_names=names)
            tp_mesh, dp_mesh = mesh["tp"], mesh["dp_replicate", "dp_shard"]
        elif dp > 1:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
            tp_mesh, dp_mesh = mesh["tp"], mesh["dp_shard"]
        else:
            tp_mesh = init_device_mesh("cpu", (world,))
        # inference is not wrapped (as estimate takes it): each group holds its tp shards
        sharding = reshard_after_forward is not None and dp > 1 and model.training
        sharded = parallelized(meta_copy(model), plan, tp_mesh).to_empty(device="cpu")
        buffers = dict(model.named_buffers())
        generator = torch.Generator().manual_seed(dist.get_rank())
        with torch.no_grad():
            for name, b in sharded.named_buffers():
                b.copy_(buffers[name])
            for p in sharded.parameters():
                local = local_part(p)
                local.copy_(torch.randn(local.shape, generator=generator) * 0.02)
        sharded.train(model.training)
        if lora is not None:
            sharded = tensor_parallel_lora(sharded, *lora)
        if sharding:
            assert reshard_after_forward is not None
            return fully_sharded(sharded, parallel, precision, dp_mesh, reshard_after_forward)
        return sharded

    return RankSetup(wrap, tp=tp, applies_lora=lora is not None)
