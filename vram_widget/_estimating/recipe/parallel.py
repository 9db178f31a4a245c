"""How a training step is spread over data-parallel ranks, as asked (``sharding`` resolves
it into a :class:`~vram_widget._estimating.sharding.Parallel`)."""

from __future__ import annotations

import dataclasses

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", parse_option(Strategy, self.strategy, "strategy"))
        if isinstance(self.fsdp_units, list):
            object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units))
