"""The Recipe of a step and its sub-records, one small module per concern.

No torch here: a Recipe is plain data that every stage reads.
"""

from .float8 import Float8, Float8Recipe
from .generation import Generation
from .ignored import RecipeSettingIgnored
from .levers import LeverSettings
from .optimizer import Optimizer
from .parallel import ParallelSettings
from .recipe import KEYWORD_FIELDS, Recipe
from .step import Accelerator, Step
from .weights import WeightFormat, Weights

__all__ = [
    "KEYWORD_FIELDS",
    "Accelerator",
    "Float8",
    "Float8Recipe",
    "Generation",
    "LeverSettings",
    "Optimizer",
    "ParallelSettings",
    "Recipe",
    "RecipeSettingIgnored",
    "Step",
    "WeightFormat",
    "Weights",
]
