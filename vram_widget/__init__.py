"""vram_widget: how much accelerator memory one training step of a torch.nn.Module needs.

Re-exports only. Names are imported on first use (PEP 562), so that the estimating stage
(plain numpy) can be imported without torch.

The package is grouped by pipeline stage, and imports run one way (an import-linter contract):
``_display`` (figures, widget, command line) -> ``_profiling`` (everything that runs the model:
the profiler, its recorder, the CUDA emulation, ``measure``) -> ``_estimating`` (the profile
table and every estimate from it, no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._estimating.options import (
    Category,
    Device,
    Mode,
    OptimizerImplementation,
    OptimizerName,
    Phase,
    Precision,
)

if TYPE_CHECKING:
    from ._display.show import show_memory
    from ._display.widget import MemoryWidget
    from ._estimating.accelerator import AcceleratorExtras
    from ._estimating.estimator import LayerTable, MemoryEstimate
    from ._estimating.gpus import GPUS, Gpu
    from ._estimating.layouts import Layout, LayoutPlan, RefusedLayout
    from ._estimating.levers import Levers
    from ._estimating.loading import LoadEstimate
    from ._estimating.profile import ModelProfile
    from ._estimating.profile_source import ProfilingError
    from ._estimating.recipe import (
        Accelerator,
        Float8,
        Generation,
        LeverSettings,
        Optimizer,
        ParallelSettings,
        Recipe,
        RecipeSettingIgnored,
        Step,
        Weights,
    )
    from ._estimating.tradeoff import Frontier
    from ._profiling.disk_cache import CacheWarning
    from ._profiling.measure import measure
    from ._profiling.measurement import Measurement
    from ._profiling.profiler import profile_model
    from ._profiling.subject import InputShapeWarning

_LAZY = {
    "AcceleratorExtras": "._estimating.accelerator",
    "CacheWarning": "._profiling.disk_cache",
    "GPUS": "._estimating.gpus",
    "Gpu": "._estimating.gpus",
    "Frontier": "._estimating.tradeoff",
    "Layout": "._estimating.layouts",
    "LayoutPlan": "._estimating.layouts",
    "Levers": "._estimating.levers",
    "RefusedLayout": "._estimating.layouts",
    "LayerTable": "._estimating.estimator",
    "LoadEstimate": "._estimating.loading",
    "MemoryEstimate": "._estimating.estimator",
    "InputShapeWarning": "._profiling.subject",
    "Measurement": "._profiling.measurement",
    "measure": "._profiling.measure",
    "ModelProfile": "._estimating.profile",
    "ProfilingError": "._estimating.profile_source",
    "Recipe": "._estimating.recipe",
    "RecipeSettingIgnored": "._estimating.recipe",
    "Step": "._estimating.recipe",
    "Optimizer": "._estimating.recipe",
    "LeverSettings": "._estimating.recipe",
    "ParallelSettings": "._estimating.recipe",
    "Generation": "._estimating.recipe",
    "Accelerator": "._estimating.recipe",
    "Weights": "._estimating.recipe",
    "Float8": "._estimating.recipe",
    "profile_model": "._profiling.profiler",
    "MemoryWidget": "._display.widget",
    "show_memory": "._display.show",
}

__all__ = [
    "GPUS",
    "Accelerator",
    "AcceleratorExtras",
    "CacheWarning",
    "Category",
    "Device",
    "Float8",
    "Frontier",
    "Generation",
    "Gpu",
    "InputShapeWarning",
    "LayerTable",
    "Layout",
    "LayoutPlan",
    "LeverSettings",
    "Levers",
    "LoadEstimate",
    "Measurement",
    "MemoryEstimate",
    "MemoryWidget",
    "Mode",
    "ModelProfile",
    "Optimizer",
    "OptimizerImplementation",
    "OptimizerName",
    "ParallelSettings",
    "Phase",
    "Precision",
    "ProfilingError",
    "Recipe",
    "RecipeSettingIgnored",
    "RefusedLayout",
    "Step",
    "Weights",
    "measure",
    "profile_model",
    "show_memory",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
