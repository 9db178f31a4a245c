"""``measure`` across processes: data-parallel ranks (DDP, ZeRO, FSDP, tensor parallel) and
pipeline stages, each on its own gloo rank on the CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._estimating.compiled import CompileScope
from .._estimating.options import (
    Mode,
    Precision,
    Strategy,
    parse_optimizer_choice,
    parse_option,
)
from .._estimating.recipe.float8 import Float8
from .._estimating.recipe.weights import parse_weights
from .._estimating.sharding import (
    Parallel,
)

if TYPE_CHECKING:
    from .distributed import RankSetup
from .measure_session import _measure, _model_device
from .measurement import Measurement
from .step import (
    ModelInputs,
    check_model,
    model_levers,
)


def _measure_ranks(
    parallel: Parallel,
    timeout_s: float,
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], Any] | None,
    optimizer: Any,
    precision: Any,
    grad_accumulation: int,
    levers: dict[str, Any],
    tp_setup: RankSetup | None = None,
    mode: Mode = Mode.TRAIN,
    compiled: tuple[CompileScope | None, float | None] = (None, None),
    loss_chunks: int | None = None,
    float8: Float8 | None = None,
) -> Measurement:
    """``measure`` on ``parallel.gpus`` gloo ranks (``distributed.run_ranks``): each wraps
    its copy (converted to float8 training first, where ``float8`` asks) as the strategy's
    library does, or shards it by ``tp_setup``'s plan (and runs torchtune's chunked loss on
    the sharded copy with ``loss_chunks``)."""
    from .distributed import SETUPS, run_ranks

    if _model_device(model).type != "cpu":
        raise ValueError(
            f"measure(gpus={parallel.gpus}) runs its ranks on the CPU with gloo; this model "
            "is on CUDA, whose ranks (NCCL, one GPU each) are not supported yet"
        )
    check_model(model)
    # the settings' own errors here, before any rank starts
    parse_optimizer_choice(optimizer)
    parse_option(Precision, precision, "precision")
    setup = tp_setup or SETUPS.get(parallel.strategy)
    ep = tp_setup is not None and tp_setup.expert_parallel
    if setup is None:
        raise ValueError(
            f"measure cannot set up strategy {parallel.strategy.value!r} yet; it runs "
            + ", ".join(repr(s.value) for s in SETUPS)
        )

    def rank_step(_rank: int, _world: int) -> Measurement:
        return _measure(
            model, inputs, loss_fn, optimizer, precision, mode, grad_accumulation,
            setup=setup, parallel=parallel, compiled=compiled, loss_chunks=loss_chunks,
            float8=float8, **levers,
        )[0]  # fmt: skip

    ranks = run_ranks(rank_step, parallel.gpus, timeout_s)
    worst = max(ranks, key=lambda m: m.peak_bytes)
    return dataclasses.replace(
        worst,
        gpus=parallel.gpus,
        # tp alone and ep: no data-parallel strategy; dp x tp: FSDP2's over the tp groups
        strategy=parallel.strategy if tp_setup is None or 1 < tp_setup.tp < parallel.gpus else None,
        tp=tp_setup.tp if tp_setup is not None else 1,
        ep=parallel.gpus if ep else 1,
        rank_peak_bytes=tuple(m.peak_bytes for m in ranks),
    )


def _measure_pipeline(
    model: torch.nn.Module, inputs: Any, settings: dict[str, Any], timeout_s: float
) -> Measurement:
    """``measure`` with ``pp > 1``: each stage on its own gloo rank
    (``pipeline_parallel.measure_stage``), or with ``gpus = dp x pp x tp`` on ``dp x tp``
    ranks each, sharded by the model's plan over ``tp`` (``pipeline_tensor_parallel``) and
    by FSDP2 over ``dp`` (``pipeline_fsdp``); the layout, the plan and the settings checked
    first, the question asked the same as the estimate's (``stage_question``)."""
    from .._estimating.recipe import Recipe
    from .._estimating.recipe.pipeline import (
        check_pipeline_parallel,
        check_pipeline_parallel_settings,
        pipeline_checkpoint_layers,
        pipeline_stages_per_rank,
        stage_question,
    )
    from .distributed import run_ranks
    from .pipeline_parallel import check_pipeline_model, measure_stage

    batch = ModelInputs.from_user(inputs).batch_size()
    asked = {k: v for k, v in settings.items() if v is not None or k == "optimizer"}
    asked.pop("weights", None)
    recipe = Recipe.from_keywords(batch_size=batch, **asked)
    if settings["weights"] is not None and parse_weights(settings["weights"]).quantized:
        recipe = recipe.with_(weights=settings["weights"])
    par = recipe.parallel
    check_pipeline_parallel(par, batch)
    check_pipeline_parallel_settings(recipe)
    stages_per_rank = pipeline_stages_per_rank(par)
    check_pipeline_model(model, inputs, par.pp, par.pp_split, stages_per_rank)
    if par.tp > 1:
        from .tensor_parallel import resolve_plan

        resolve_plan(model, par.tp)  # a model without a plan, a tp not dividing it
    lv = recipe.levers
    levers = model_levers(model, lv.checkpoint, None, 1, checkpoint_policy=lv.checkpoint_policy)
    names = [name for name, _m in model.named_modules()]
    checkpoint = pipeline_checkpoint_layers(levers.checkpoint, names)
    if _model_device(model).type != "cpu":
        raise ValueError(
            f"measure(pp={par.pp}) runs its ranks on the CPU with gloo; this model is on CUDA"
        )
    question = stage_question(recipe, checkpoint)

    def rank_step(_rank: int, _world: int) -> tuple[int, int]:
        return measure_stage(model, inputs, question)

    ranks = run_ranks(rank_step, par.gpus, timeout_s)
    worst = max(range(len(ranks)), key=lambda r: ranks[r][1])
    return Measurement(
        peak_bytes=ranks[worst][1],
        resident_bytes=ranks[worst][0],
        device="cpu",
        precision=question.precision,
        optimizer=question.optimizer,
        mode=recipe.step.mode,
        batch_size=batch,
        gpus=par.gpus,
        rank_peak_bytes=tuple(peak for _resident, peak in ranks),
        pp=par.pp,
        tp=par.tp,
        strategy=par.strategy if question.dp > 1 else None,
    )


def _tensor_parallel_setup(
    model: torch.nn.Module, settings: dict[str, Any], gpus: int, strategy: Any, mode: Any
) -> RankSetup | None:
    """The rank setup of ``tp > 1`` (``tensor_parallel.rank_setup``), its layout and plan
    checked before any rank starts; None for ``tp=1``."""
    from .._estimating.levers import parse_lora_dtype, resolve_lora
    from .._estimating.recipe.parallel import (
        ParallelSettings,
        check_tensor_parallel,
        check_tensor_parallel_lora,
    )
    from .tensor_parallel import rank_setup, resolve_plan

    tp = settings["tp"]
    if tp == 1 and settings["tp_plan"] is None:
        return None
    par = ParallelSettings(
        gpus=gpus, strategy=strategy, tp=tp, gpus_per_node=settings["gpus_per_node"]
    )
    check_tensor_parallel(par)
    if tp == 1:
        raise ValueError("tp_plan is the plan of tp > 1 ranks: give tp=... too")
    if parse_option(Mode, mode, "mode") is Mode.GENERATE:
        raise ValueError("mode='generate' is measured on one device (gpus=1), without tp")
    if parse_weights(settings["weights"]).quantized:
        raise ValueError(
            f"tp={tp} with weights: not measured with tensor parallelism yet; leave tp at 1 "
            "for these"
        )
    if settings["loss_chunks"] is not None and gpus != tp:
        raise ValueError(
            f"loss_chunks with tp={tp} on gpus={gpus}: the chunked loss with FSDP2 over "
            f"tensor-parallel ranks is not measured yet; it is with tp alone (gpus={tp})"
        )
    rank, targets = resolve_lora(settings["lora_rank"], settings["lora_targets"])
    lora = None
    if rank is not None:
        check_tensor_parallel_lora(tp, gpus, settings["tp_plan"])
        lora = (rank, targets, parse_lora_dtype(settings["lora_dtype"]))
    # zero2 / zero3 / hsdp over dp = gpus / tp groups of tensor-parallel ranks
    # (check_tensor_parallel); hsdp reshards after the forward as zero3 does
    reshard = {Strategy.ZERO2: False, Strategy.ZERO3: True, Strategy.HSDP: True}.get(par.strategy)
    return rank_setup(resolve_plan(model, tp, settings["tp_plan"]), tp, reshard, lora)


def _expert_parallel_setup(
    model: torch.nn.Module, settings: dict[str, Any], gpus: int, strategy: Any
) -> RankSetup:
    """The rank setup of ``ep > 1`` (``expert_parallel.rank_setup``), its layout and plan
    checked before any rank starts."""
    from .._estimating.recipe.parallel import ParallelSettings, check_expert_parallel
    from .expert_parallel import rank_setup, resolve_ep_plan

    ep = settings["ep"]
    par = ParallelSettings(gpus=gpus, strategy=strategy, tp=settings["tp"] or 1, ep=ep)
    check_expert_parallel(par)
    refused = [k for k in ("lora_rank",) if settings[k] is not None]
    refused += ["weights"] if parse_weights(settings["weights"]).quantized else []
    refused += ["mode='generate'"] if settings.get("new_tokens") is not None else []
    if refused:
        raise ValueError(
            f"ep={ep} with {', '.join(refused)}: not measured with expert parallelism yet; "
            "leave ep at 1 for these"
        )
    return rank_setup(resolve_ep_plan(model, ep))
