"""Expert parallelism: one rank's share of a mixture-of-experts model's experts, sharded by
transformers' own expert-parallel plan on PyTorch's fake process group.

``ep`` ranks share one batch; each holds the dense modules whole and ``num_experts / ep``
experts: the layout of ``DistributedConfig(enable_expert_parallel=True)`` (transformers/
distributed/configuration_utils.py, ``_resolve_parallelism``: ``ep_size = tp_size`` with no
tensor-parallel rule). The plan is the model's ``base_model_ep_plan`` as
``_resolve_parallel_plans`` resolves it (transformers/distributed/mixin.py), applied by
``apply_expert_parallelism`` (transformers/distributed/expert_parallel.py) with the one 1-D
mesh as both its expert and its batch-sharing ("tp") mesh, as ``maybe_distribute_model``
passes ``mesh_manager.get_mesh("tp")`` and ``get_mesh("ep")``: ``grouped_gemm`` shards the
expert weights on dim 0 (``MoEParamShard``), ``ep_dispatch_experts`` installs ``AutoEP``.
(Resolving with ``tp_plan={}``, as ``enable_expert_parallel`` does, raises "has no tp_plan"
in transformers 5.24, so the tensor-parallel part of the resolved plans is left unapplied.)

Token routing is data dependent. In training ``AutoEP`` runs ``AllToAllEP``: each rank takes
its ``1/ep`` slice of the shared tokens, and reads the all-to-all's split sizes back to the
host (``torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()`` in
``AllToAllEP._dispatch_tokens``), which a fake tensor cannot answer. Those host reads are
answered here by :class:`RoutedCounts` with the sizes of a chosen routing: ``"balanced"``
(every rank's experts receive ``tokens * top_k / ep`` token-slots) or ``"worst"`` (every
token's picks go to the estimated rank's experts, as many as it holds). Inference runs
``AllReduceEP`` (every rank's experts see the whole batch, masked): no host read, no routing
dependence.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "RoutedCounts",
    "Routing",
    "expert_parallelized",
    "resolve_ep_plan",
    "routed_sizes",
]

Routing = str  # "balanced" | "worst"

DISPATCH_STYLE = "ep_dispatch_experts"


def _num_experts(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_ep_plan(model: torch.nn.Module, ep: int) -> dict[str, str]:
    """The model's expert-parallel plan, expanded to module and parameter names, checked
    before any profiling.

    Raises
    ------
    ValueError
        For a model without experts or an expert-parallel plan, or an ``ep`` that does not
        divide its number of experts.
    """
    resolve: Any = getattr(model, "_resolve_parallel_plans", None)
    plan = dict(getattr(model, "ep_plan", None) or {}) if resolve is not None else {}
    if not plan or DISPATCH_STYLE not in plan.values():
        raise ValueError(
            f"ep={ep}: {type(model).__name__} has no experts to split (no "
            "config.base_model_ep_plan with an 'ep_dispatch_experts' rule); expert "
            "parallelism is for Hugging Face mixture-of-experts models that have one "
            "(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...)"
        )
    experts = _num_experts(model)
    if experts is not None and experts % ep:
        raise ValueError(
            f"ep={ep} does not divide the model's {experts} experts; use an ep that divides "
            f"{experts}"
        )
    from transformers.distributed.configuration_utils import DistributedConfig

    _tp, expanded, _fsdp = resolve(DistributedConfig(tp_size=ep, ep_size=ep))
    return dict(expanded)


def routed_sizes(
    tokens: int, top_k: int, ep: int, local_experts: int, routing: Routing
) -> list[int]:
    """The all-to-all split sizes rank 0 reads back, ``send`` (to each rank) then ``recv``
    (from each rank), in (token, expert) pairs, for ``tokens`` shared tokens.

    Each rank dispatches its ``Shard(0)`` slice of the tokens (``torch.chunk``'s sizes:
    ``ceil(tokens / ep)`` each, the last ones short). ``"balanced"``: each rank spreads its
    pairs evenly over the ranks (the first ones one more where they do not divide).
    ``"worst"``: every token sends to rank 0 as many of its ``top_k`` picks as rank 0 has
    experts, the rest spread evenly over the others.

    Examples
    --------
    >>> routed_sizes(16, 2, 2, 2, "balanced")  # 8 tokens a rank, 16 pairs, 8 to each rank
    [8, 8, 8, 8]
    >>> routed_sizes(16, 2, 2, 2, "worst")  # every pair to rank 0
    [16, 0, 16, 16]
    """
    chunk = -(-tokens // ep)
    slices = [max(0, min(chunk, tokens - r * chunk)) for r in range(ep)]

    def spread(pairs: int, over: int) -> list[int]:
        return [pairs // over + (1 if i < pairs % over else 0) for i in range(over)]

    if routing == "balanced":
        send = spread(slices[0] * top_k, ep)
        recv = [spread(n * top_k, ep)[0] for n in slices]
        return send + recv
    kept = min(top_k, local_experts)
    rest = spread(slices[0] * (top_k - kept), ep - 1) if ep > 1 else []
    send = [slices[0] * kept, *rest]
    return send + [n * kept for n in slices]


class RoutedCounts(TorchDispatchMode):
    """Answers the host reads of one ``AllToAllEP`` dispatch (``aten._local_scalar_dense``,
    one per split size) with ``sizes``, in order; any other read is refused."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = list(sizes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            if not self.sizes:
                raise RuntimeError(
                    "expert parallelism: the experts' dispatch read more values back than "
                    "the all-to-all's split sizes; this transformers version's EP dispatch "
                    "is not estimated"
                )
            return self.sizes.pop(0)
        return func(*args, **(kwargs or {}))


def _routed(forward: Any, ep: int, local_experts: int, routing: Routing) -> Any:
    @functools.wraps(forward)
    def routed(hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
        with RoutedCounts(routed_sizes(tokens, top_k, ep, local_experts, routing)):
            return forward(hidden_states, top_k_index, top_k_weights)

    return routed


def expert_parallelized(
    model: torch.nn.Module, plan: dict[str, str], mesh: Any, routing: Routing
) -> torch.nn.Module:
    """``model`` (a copy: changed in place) with its experts sharded over ``mesh`` by
    transformers' ``apply_expert_parallelism``, each dispatch's split sizes those of
    ``routing`` (:func:`routed_sizes`)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    ep = mesh.size()
    sharded = apply_expert_parallelism(model, mesh, mesh, plan)
    modules = dict(sharded.named_modules())
    for name, style in plan.items():
        if style == DISPATCH_STYLE:
            experts = modules[name]
            experts.forward = _routed(experts.forward, ep, experts.num_experts, routing)
    return sharded


def rank_setup(plan: dict[str, str]) -> Any:
    """How a real expert-parallel rank of ``measure(gpus=k, ep=k)`` shards its copy: the
    plan applied by ``apply_expert_parallelism`` on a 1-D CPU mesh of the gloo group's
    ranks (its expert mesh and its batch-sharing mesh, as :func:`expert_parallelized`), to
    a meta copy of the model (each rank holds its experts only), then materialized
    (``to_empty``) with the model's own values: the dense parameters and buffers whole, the
    experts' ``Shard(0)`` slice of this rank. The router's weights decide the routing, so
    they are the model's, never a fill. Each collective drops its buffers on the rank's own
    thread (``distributed._collectives_release_on_caller``)."""
    from .distributed import RankSetup
    from .tensor_parallel import local_part

    def wrap(model: torch.nn.Module, _parallel: Any, _precision: Any) -> torch.nn.Module:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        from .step import meta_copy

        world, rank = dist.get_world_size(), dist.get_rank()
        mesh = init_device_mesh("cpu", (world,))
        sharded = apply_expert_parallelism(meta_copy(model), mesh, mesh, plan)
        sharded = sharded.to_empty(device="cpu")
        given = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, b in sharded.named_buffers():
                b.copy_(buffers[name])
            for name, p in sharded.named_parameters():
                local, whole = local_part(p), given[name].detach()
                if local.shape != whole.shape:  # grouped_gemm: Shard(0), whole experts
                    whole = whole.chunk(world, dim=0)[rank]
                local.copy_(whole)
        sharded.train(model.training)
        return sharded

    return RankSetup(wrap, expert_parallel=True)
