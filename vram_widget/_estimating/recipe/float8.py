"""Float8 training: the ``nn.Linear`` layers swapped for torchao's ``Float8Linear`` by
``torchao.float8.convert_to_float8_training``, with one of torchao's recipes.

- ``"tensorwise"`` (also ``True``): torchao's default, ``Float8LinearConfig()``: dynamic
  per-tensor scales, e4m3 input and weight, e5m2 gradients (torchao/float8/config.py,
  ``Float8LinearConfig.from_recipe_name``: ``TENSORWISE -> Float8LinearConfig()``; the
  dtypes filled in by ``Float8LinearConfig.__post_init__``).
- ``"rowwise"``: ``Float8LinearConfig.from_recipe_name("rowwise")``: per-row (axiswise)
  scales, e4m3 everywhere, scales rounded down to powers of two
  (``round_scales_to_power_of_2=True``; same function, ``ROWWISE`` branch).

The high-precision weights stay the parameters (``Float8Linear.from_float`` assigns the
original ``mod.weight``), so their gradients and the optimizer's state are the
precision's; float8 adds the casts of the input, the weight and the output gradient.

``all_gather`` (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``, torchtitan's
``float8.enable_fsdp_float8_all_gather``): under FSDP2 each converted weight is a
``WeightWithDynamicFloat8CastTensor`` (torchao/float8/float8_linear.py,
``Float8Linear.from_float``) whose ``fsdp_pre_all_gather`` casts the local shard to float8
(its amax all-reduced over the mesh) and whose ``fsdp_post_all_gather`` wraps the gathered
bytes and the scale in a ``Float8TrainingTensor`` (torchao/float8/fsdp_utils.py): the
all-gather moves, and the unsharded weight holds, one byte per value plus a float32 scale,
and the forward and backward do not cast that weight again (``tensor_already_casted_to_fp8``,
float8_linear.py).
"""

from __future__ import annotations

import dataclasses

from ..options import StrEnum, parse_option


class Float8Recipe(StrEnum):
    """torchao's float8 training recipes (``torchao.float8.Float8LinearRecipeName``)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


# Names that mean "no float8 training"
_OFF = ("none", "off", "false", "no")


def float8_recipe(value: object) -> Float8Recipe | None:
    """A recipe as given: True (torchao's default, ``"tensorwise"``), ``"tensorwise"``,
    ``"rowwise"``; None, False or ``"none"``: no float8.

    Examples
    --------
    >>> float8_recipe(True), float8_recipe("ROWWISE"), float8_recipe(False)
    (<Float8Recipe.TENSORWISE: 'tensorwise'>, <Float8Recipe.ROWWISE: 'rowwise'>, None)
    >>> float8_recipe("blockwise")
    Traceback (most recent call last):
    ...
    ValueError: unknown float8 recipe 'blockwise'; valid values are True, 'tensorwise' ...
    """
    if value is None or value is False:
        return None
    if value is True:
        return Float8Recipe.TENSORWISE
    if isinstance(value, str) and value.strip().lower() in _OFF:
        return None
    try:
        return parse_option(Float8Recipe, value, "float8 recipe")
    except ValueError:
        raise ValueError(
            f"unknown float8 recipe {value!r}; valid values are True, 'tensorwise' "
            "(torchao's default) and 'rowwise' (or None / False for no float8)"
        ) from None


@dataclasses.dataclass(frozen=True)
class Float8:
    """Float8 training of the ``nn.Linear`` layers by torchao.

    Attributes
    ----------
    recipe : Float8Recipe, optional
        ``"tensorwise"`` or ``"rowwise"``; None: no float8 training.
    all_gather : bool
        FSDP2 all-gathers the converted weights in float8 (torchao's
        ``enable_fsdp_float8_all_gather``; the flat keyword ``float8_all_gather``):
        ``"tensorwise"`` only, as torchao asserts. False: torchao's default, the weights
        gathered in their own dtype and cast after.
    filter_fqns : tuple of str
        Layers left in high precision: a ``nn.Linear`` whose qualified name contains one of
        these strings is not converted (torchtitan's ``float8.filter_fqns``, a substring
        match: torchtitan/components/quantization/utils.py, ``module_filter_fn``). Empty:
        torchao's own default, every ``nn.Linear`` (``convert_to_float8_training`` with
        ``module_filter_fn=None``, torchao/float8/float8_linear_utils.py).

    Examples
    --------
    >>> Float8("rowwise").recipe
    <Float8Recipe.ROWWISE: 'rowwise'>
    >>> Float8(True, filter_fqns="lm_head").filter_fqns
    ('lm_head',)
    >>> Float8(True, all_gather=True).describe()
    'float8 tensorwise (torchao Float8Linear; all-gathered in float8 by FSDP2)'
    """

    recipe: Float8Recipe | None = None
    filter_fqns: tuple[str, ...] = ()
    all_gather: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", float8_recipe(self.recipe))
        _check_all_gather(self.recipe, self.all_gather)
        fqns = self.filter_fqns
        if isinstance(fqns, str):
            fqns = (fqns,)
        if not isinstance(fqns, list | tuple) or not all(isinstance(f, str) for f in fqns):
            raise TypeError(f"filter_fqns must be a string or a list of strings, got {fqns!r}")
        object.__setattr__(self, "filter_fqns", tuple(fqns))

    @property
    def enabled(self) -> bool:
        """Whether any layer trains in float8."""
        return self.recipe is not None

    def describe(self) -> str:
        """The setting as one line ("" when off).

        Examples
        --------
        >>> Float8("rowwise", filter_fqns=("output",)).describe()
        "float8 rowwise (torchao Float8Linear; kept in high precision: 'output')"
        """
        if self.recipe is None:
            return ""
        kept = ""
        if self.filter_fqns:
            kept = "; kept in high precision: " + ", ".join(map(repr, self.filter_fqns))
        if self.all_gather:
            kept += "; all-gathered in float8 by FSDP2"
        return f"float8 {self.recipe.value} (torchao Float8Linear{kept})"


def _check_all_gather(recipe: Float8Recipe | None, all_gather: object) -> None:
    """``all_gather``'s own errors: a bool, with float8 on, and the tensorwise recipe."""
    if not isinstance(all_gather, bool):
        raise TypeError(f"float8_all_gather must be True or False, got {all_gather!r}")
    if not all_gather:
        return
    if recipe is None:
        raise ValueError(
            "float8_all_gather=True all-gathers the float8-trained Linear weights in float8, "
            "and float8 is off: give float8='tensorwise' (or True) too"
        )
    if recipe is not Float8Recipe.TENSORWISE:
        # torchao/float8/config.py, Float8LinearConfig.__post_init__: "float8 all-gather
        # only supports tensorwise" (assert not self.enable_fsdp_float8_all_gather)
        raise ValueError(
            f"float8_all_gather=True with float8={recipe.value!r}: torchao all-gathers "
            "float8 weights with the 'tensorwise' recipe only (Float8LinearConfig: "
            "'enable_fsdp_float8_all_gather only supports tensorwise scaling "
            "granularity'); use float8='tensorwise', or float8_all_gather=False"
        )


def parse_float8(value: object) -> Float8:
    """``float8=`` as given: a :class:`Float8`, True, ``"tensorwise"``, ``"rowwise"``, or
    None / False (off).

    Examples
    --------
    >>> parse_float8(True).recipe.value, parse_float8(None).enabled
    ('tensorwise', False)
    """
    if isinstance(value, Float8):
        return value
    if value is None or isinstance(value, bool | str | Float8Recipe):
        return Float8(float8_recipe(value))
    raise TypeError(
        f"float8 must be True, 'tensorwise', 'rowwise', None or a vram_widget Float8; got "
        f"{type(value).__name__}"
    )
