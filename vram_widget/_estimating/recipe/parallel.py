"""How a training step is spread over data-parallel ranks, as asked (``sharding`` resolves
it into a :class:`~vram_widget._estimating.sharding.Parallel`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..options import Strategy, parse_option
from ..sharding import DEFAULT_GPUS_PER_NODE


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """Data-parallel ranks and the strategy that shares the step among them.

    Attributes
    ----------
    gpus : int
        Data-parallel ranks (1: one device, no wrapper).
    strategy : Strategy
        ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"hsdp"``.
    rank : int, optional
        The rank to estimate where ranks differ; None: the worst.
    gpus_per_node : int
        GPUs per node (``"hsdp"`` shards within one).
    fsdp_units : str or tuple of str, optional
        FSDP2's units besides the root; None: each repeated block.
    tp : int
        Tensor-parallel ranks among ``gpus`` (1: none); ``gpus = data-parallel x tp``.
    tp_plan : dict, optional
        Module patterns -> ``torch.distributed.tensor.parallel`` styles; None: the
        model's own plan (a Hugging Face model's ``base_model_tp_plan``).

    Examples
    --------
    >>> ParallelSettings(gpus=8, strategy="zero3").strategy
    <Strategy.ZERO3: 'zero3'>
    """

    gpus: int = 1
    strategy: Strategy = Strategy.DDP
    rank: int | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    fsdp_units: object = None
    tp: int = 1
    tp_plan: object = dataclasses.field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", parse_option(Strategy, self.strategy, "strategy"))
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be a whole number of ranks >= 1, got {self.tp!r}")
        if isinstance(self.fsdp_units, list):
            object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units))


def check_tensor_parallel(parallel: ParallelSettings) -> None:
    """A clear error for a tensor-parallel layout that is not estimated (yet).

    Examples
    --------
    >>> check_tensor_parallel(ParallelSettings(gpus=4, tp=2))
    Traceback (most recent call last):
    ...
    ValueError: tp=2 on gpus=4 asks for 2 data-parallel ranks of tp=2 each; ...
    """
    tp, gpus = parallel.tp, parallel.gpus
    if tp == 1:
        return
    if tp > gpus or gpus % tp:
        raise ValueError(
            f"tp={tp} with gpus={gpus}: gpus is the world size, data-parallel x tensor-parallel "
            f"ranks, so tp must divide it; give gpus={tp} for tensor parallelism alone"
        )
    if gpus != tp:
        raise ValueError(
            f"tp={tp} on gpus={gpus} asks for {gpus // tp} data-parallel ranks of tp={tp} each; "
            f"data parallelism over tensor-parallel ranks is not estimated yet: give gpus={tp}"
        )
    if parallel.strategy is not Strategy.DDP:
        raise ValueError(
            f"tp={tp} with strategy={parallel.strategy.value!r}: tensor parallelism does not "
            "compose with a data-parallel strategy yet; leave strategy at its default"
        )


def tensor_parallel_refusals(recipe: Any) -> list[str]:
    """The settings of ``recipe`` (a :class:`~vram_widget.Recipe`) not estimated with
    ``tp > 1`` yet, by name: those not checked against real tensor-parallel ranks
    (activation checkpointing, a frozen subset, accumulation and the precisions are).

    Examples
    --------
    >>> from vram_widget._estimating.recipe import Recipe
    >>> tensor_parallel_refusals(Recipe.from_keywords(gpus=2, tp=2, lora_rank=8))
    ['lora_rank']
    """
    lv, step, optimizer = recipe.levers, recipe.step, recipe.optimizer
    asked = {
        "lora_rank": lv.lora_rank is not None,
        "weights": recipe.weights.quantized,
        "float8": recipe.float8.recipe is not None,
        "compile": lv.compile not in (None, False),
        "loss_chunks": lv.loss_chunks is not None,
        "offload_activations": lv.offload_activations not in (None, False),
        "optimizer_in_backward": optimizer.in_backward,
        "mode='generate'": step.mode.value == "generate",
    }
    return [name for name, on in asked.items() if on]


def check_tensor_parallel_settings(recipe: Any) -> None:
    """A ValueError naming the settings :func:`tensor_parallel_refusals` finds."""
    refused = tensor_parallel_refusals(recipe)
    if refused and recipe.parallel.tp > 1:
        raise ValueError(
            f"tp={recipe.parallel.tp} with {', '.join(refused)}: not estimated with tensor "
            "parallelism yet (activation checkpointing, trainable, grad_accumulation and "
            "every precision are); leave tp at 1 for these"
        )
