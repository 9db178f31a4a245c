"""The Recipe: one frozen value for one training (or inference) setup, grouped by concern."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, cast

from .float8 import Float8, parse_float8
from .generation import Generation
from .levers import LeverSettings
from .optimizer import Optimizer
from .parallel import ParallelSettings
from .step import Accelerator, Step
from .weights import Weights, parse_weights

_T = TypeVar("_T")


class Default:
    """A keyword's documented default, told apart from the same value given explicitly.

    ``estimate(recipe=r)`` takes its settings from ``r``; ``estimate(recipe=r,
    precision="fp32")`` asks for fp32, which ``r`` must hold. Signatures use
    :func:`default` so that both read ``precision='fp32'`` in the documentation; its
    ``repr`` is the value's.
    """

    __slots__ = ("value",)
    value: object

    def __init__(self, value: object) -> None:
        object.__setattr__(self, "value", value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("a Default is frozen")

    def __repr__(self) -> str:
        return repr(self.value)


def default(value: _T) -> _T:
    """``value`` as a keyword's default (a :class:`Default`), typed as the value itself.

    Examples
    --------
    >>> default("fp32")
    'fp32'
    >>> isinstance(default("fp32"), Default)
    True
    """
    return cast(_T, Default(value))


def given(value: object) -> object:
    """The value a keyword holds: its default's value where it was not given.

    Examples
    --------
    >>> given(default(4)), given(5)
    (4, 5)
    """
    return value.value if isinstance(value, Default) else value


# Each flat keyword of ``ModelProfile.estimate`` -> (the Recipe's sub-record, its field).
# ``optimizer`` is the whole Optimizer record (a name may carry its implementation).
KEYWORD_FIELDS: dict[str, tuple[str, str]] = {
    "batch_size": ("step", "batch_size"),
    "seq_len": ("step", "seq_len"),
    "precision": ("step", "precision"),
    "mode": ("step", "mode"),
    "outputs": ("step", "outputs"),
    "loss_scaled": ("step", "loss_scaled"),
    "carried_scalars": ("step", "carried_scalars"),
    "optimizer": ("optimizer", ""),
    "optimizer_in_backward": ("optimizer", "in_backward"),
    "set_to_none": ("optimizer", "set_to_none"),
    "clip_grad_norm": ("optimizer", "clip_grad_norm"),
    "param_groups": ("optimizer", "param_groups"),
    "context_bytes": ("accelerator", "context_bytes"),
    "lazy_loading": ("accelerator", "lazy_loading"),
    "compute_capability": ("accelerator", "compute_capability"),
    "expandable_segments": ("accelerator", "expandable_segments"),
    "checkpoint": ("levers", "checkpoint"),
    "checkpoint_policy": ("levers", "checkpoint_policy"),
    "trainable": ("levers", "trainable"),
    "grad_accumulation": ("levers", "grad_accumulation"),
    "lora_rank": ("levers", "lora_rank"),
    "lora_targets": ("levers", "lora_targets"),
    "lora_dtype": ("levers", "lora_dtype"),
    "loss_chunks": ("levers", "loss_chunks"),
    "offload_activations": ("levers", "offload_activations"),
    "compile": ("levers", "compile"),
    "activation_memory_budget": ("levers", "activation_memory_budget"),
    "gpus": ("parallel", "gpus"),
    "strategy": ("parallel", "strategy"),
    "rank": ("parallel", "rank"),
    "gpus_per_node": ("parallel", "gpus_per_node"),
    "fsdp_units": ("parallel", "fsdp_units"),
    "tp": ("parallel", "tp"),
    "tp_plan": ("parallel", "tp_plan"),
    "pp": ("parallel", "pp"),
    "pp_schedule": ("parallel", "pp_schedule"),
    "microbatches": ("parallel", "microbatches"),
    "pp_split": ("parallel", "pp_split"),
    "stages_per_rank": ("parallel", "stages_per_rank"),
    "ep": ("parallel", "ep"),
    "cp": ("parallel", "cp"),
    "new_tokens": ("generation", "new_tokens"),
    "kv_cache": ("generation", "kv_cache"),
    "kv_bits": ("generation", "kv_bits"),
    "residual_length": ("generation", "residual_length"),
    "q_group_size": ("generation", "q_group_size"),
    "weights": ("weights", ""),
    "float8": ("float8", ""),
    "float8_all_gather": ("float8", "all_gather"),
}

# Settings that were replaced, and what replaces them: a clear error names the new form.
REPLACED_SETTINGS = {
    "base_quantization": "weights (weights='nf4', 'fp4' or 'int8': bitsandbytes' storage of "
    "the Linear weights)",
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides one step's memory besides the model: one frozen value.

    Each concern is a small record of its own: :class:`Step` (batch, sequence length,
    precision, mode), :class:`Optimizer` (name and implementation), :class:`LeverSettings`
    (checkpointing, trainable subsets, LoRA, gradient accumulation), :class:`Weights`
    (bitsandbytes' quantized base weights), :class:`Float8` (torchao's float8 training of
    the Linear layers), :class:`ParallelSettings` (data-parallel ranks
    and strategy), :class:`Generation` (new tokens, the KV cache) and :class:`Accelerator` (compute
    capability, allocator settings).
    ``ModelProfile.estimate(recipe=...)``, its searches and ``measure(recipe=...)`` take
    one; their flat keywords build one with :meth:`from_keywords`.

    Examples
    --------
    >>> r = Recipe.from_keywords(batch_size=8, precision="bf16", optimizer="adamw-fused")
    >>> r.step.batch_size, r.step.precision.value, r.optimizer.implementation.value
    (8, 'bf16', 'fused')
    >>> r.with_(batch_size=16, gpus=4).parallel.gpus
    4
    >>> Recipe().with_(flavour=1)
    Traceback (most recent call last):
    ...
    TypeError: unknown recipe setting 'flavour'; valid settings are batch_size, ...
    """

    step: Step = dataclasses.field(default_factory=Step)
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    levers: LeverSettings = dataclasses.field(default_factory=LeverSettings)
    parallel: ParallelSettings = dataclasses.field(default_factory=ParallelSettings)
    generation: Generation = dataclasses.field(default_factory=Generation)
    weights: Weights = dataclasses.field(default_factory=Weights)
    float8: Float8 = dataclasses.field(default_factory=Float8)
    accelerator: Accelerator = dataclasses.field(default_factory=Accelerator)
    # settings of the config this Recipe was read from that change memory but are not
    # estimated (``from_training_arguments``, ``from_torchtune``), each with what it changes;
    # every estimate from this Recipe lists them in ``MemoryEstimate.ignored``
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.ignored, list):
            object.__setattr__(self, "ignored", tuple(self.ignored))

    @classmethod
    def from_training_arguments(cls, args: object, gpus: int = 1, model: object = None) -> Recipe:
        """The Recipe of Hugging Face ``Trainer``'s step with these ``TrainingArguments``.

        Parameters
        ----------
        args : transformers.TrainingArguments, dict, str or path
            The arguments, their ``to_dict()``, the JSON ``args.to_json_string()`` writes,
            or a file holding it.
        gpus : int
            Data-parallel ranks (the world size is not in the arguments); needed > 1 with
            ``fsdp``.
        model : transformers.PreTrainedModel or peft.PeftModel, optional
            The model handed to the Trainer, which the arguments do not describe: its
            ``config.quantization_config`` (a ``BitsAndBytesConfig``: ``load_in_4bit`` /
            ``load_in_8bit``, ``bnb_4bit_quant_type``, ``bnb_4bit_use_double_quant``,
            ``bnb_4bit_compute_dtype``, ``bnb_4bit_quant_storage``, ``llm_int8_threshold``,
            ``llm_int8_skip_modules``) gives ``weights``; PEFT's ``LoraConfig`` ``r`` and
            ``target_modules`` give ``lora_rank`` and ``lora_targets``; weights held in
            bf16 / fp16 give that precision. Other quantization methods are refused by name.

        Notes
        -----
        Read: the micro-batch, accumulation, ``bf16`` / ``fp16`` (autocast over the weights'
        own dtype: ``"amp-bf16"`` / ``"amp-fp16"``; a model loaded in bf16 is ``"bf16"``,
        which the arguments cannot tell), ``optim`` (every ``OptimizerNames`` value mapped,
        ``training_arguments.OPTIM_NAMES``), activation checkpointing and FSDP. Settings with
        no effect on the step's memory (``training_arguments.NO_MEMORY_EFFECT``) are read
        past; one that changes memory without being estimated is refused by name (DeepSpeed,
        GaLore, reentrant checkpointing...) or listed in :attr:`ignored` and in a
        :class:`~vram_widget.RecipeSettingIgnored` warning (``torch_compile``, ``tf32``...).
        The step is the Trainer's: the model's outputs freed before the backward, the
        backward on accelerate's scaled copy of the loss, ``clip_grad_norm_`` with
        ``max_grad_norm`` and the optimizer's two parameter groups (``outputs="freed"``,
        ``loss_scaled``, ``clip_grad_norm``, ``param_groups="decay-split"``; docs: the guide
        on the Trainer and torchtune).

        Examples
        --------
        >>> r = Recipe.from_training_arguments(
        ...     {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        ...      "bf16": True, "optim": "adamw_torch_fused", "gradient_checkpointing": True})
        >>> r.step.batch_size, r.step.precision.value, r.get("grad_accumulation")
        (4, 'amp-bf16', 2)
        >>> r.optimizer.implementation.value, r.levers.checkpoint
        ('fused', 'auto')
        """
        from .training_arguments import read_training_arguments

        return read_training_arguments(args, gpus=gpus, model=model)

    @classmethod
    def from_torchtune(cls, config: object, gpus: int = 1) -> Recipe:
        """The Recipe of a torchtune recipe config (a dict, a YAML file or an OmegaConf
        ``DictConfig``): see :mod:`~vram_widget._estimating.recipe.torchtune`.

        Parameters
        ----------
        config : dict, str, path or omegaconf.DictConfig
        gpus : int
            Ranks of a distributed recipe (FSDP2's ``fully_shard``); 1: a single device.

        Examples
        --------
        >>> r = Recipe.from_torchtune({"batch_size": 4, "dtype": "bf16",
        ...     "optimizer": {"_component_": "torch.optim.AdamW", "fused": True},
        ...     "enable_activation_checkpointing": True})
        >>> r.step.precision.value, r.optimizer.implementation.value, r.levers.checkpoint
        ('bf16', 'fused', 'auto')
        """
        from .torchtune import read_torchtune

        return read_torchtune(config, gpus=gpus)

    @classmethod
    def from_torchtitan(cls, config: object, gpus: int | None = None) -> Recipe:
        """The Recipe of a torchtitan job config (its TOML file, or the dict it parses to):
        see :mod:`~vram_widget._estimating.recipe.torchtitan`.

        Parameters
        ----------
        config : dict, str or path
            The sections of torchtitan's ``JobConfig`` (``[training]``, ``[optimizer]``,
            ``[activation_checkpoint]``, ``[parallelism]``...), as torchtitan 0.2's
            ``--job.config_file`` takes them.
        gpus : int, optional
            The world size (not in the config). None: the product of the parallelism
            degrees, ``data_parallel_shard_degree = -1`` counting as 1.

        Notes
        -----
        Read: the micro-batch, sequence length and accumulation (``global_batch_size``),
        the dtype and mixed precision, the optimizer and its implementation, activation
        checkpointing and its selective option (``checkpoint_policy``), and the
        data-parallel, tensor- and pipeline-parallel degrees with the pipeline's schedule
        and micro-batches (``gpus``, ``strategy``, ``tp``, ``pp``, ``pp_schedule``,
        ``microbatches``). The context and expert degrees, the model's name, its
        converters, ``compile`` and unknown
        sections or keys are listed in :attr:`ignored`; ``enable_cpu_offload`` and the
        ``memory_budget`` mode are refused by name.

        Examples
        --------
        >>> r = Recipe.from_torchtitan({
        ...     "training": {"local_batch_size": 4, "seq_len": 1024},
        ...     "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}})
        >>> r.step.batch_size, r.step.seq_len, r.step.precision.value
        (4, 1024, 'amp-bf16')
        >>> r.levers.checkpoint, r.levers.checkpoint_policy, r.optimizer.implementation.value
        ('auto', 'op', 'fused')
        """
        from .torchtitan import read_torchtitan

        return read_torchtitan(config, gpus=gpus)

    def with_(self, **settings: Any) -> Recipe:
        """A copy with these flat settings changed (the keywords of
        ``ModelProfile.estimate``: ``batch_size``, ``precision``, ``optimizer``, ``gpus``...),
        each put in its sub-record; the others stay.

        Examples
        --------
        >>> Recipe().with_(optimizer="sgd", grad_accumulation=4).levers.grad_accumulation
        4
        """
        groups: dict[str, dict[str, Any]] = {}
        for key, value in settings.items():
            if key in REPLACED_SETTINGS:
                raise TypeError(f"{key} was replaced by {REPLACED_SETTINGS[key]}")
            if key not in KEYWORD_FIELDS:
                valid = ", ".join(KEYWORD_FIELDS)
                raise TypeError(f"unknown recipe setting {key!r}; valid settings are {valid}")
            group, field = KEYWORD_FIELDS[key]
            groups.setdefault(group, {})[field] = value
        changes: dict[str, Any] = {}
        for group, fields in groups.items():
            record = getattr(self, group)
            if group == "optimizer" and "" in fields:
                record = record.named(fields.pop(""))
            if group == "weights":  # the whole record, from any form parse_weights reads
                changes[group] = parse_weights(fields.pop(""))
                continue
            if group == "float8":  # the whole record: True, a recipe name or a Float8
                if "" in fields:
                    record = parse_float8(fields.pop(""))
                changes[group] = dataclasses.replace(record, **fields)
                continue
            changes[group] = dataclasses.replace(record, **fields)
        return dataclasses.replace(self, **changes)

    def get(self, key: str) -> Any:
        """The value of one flat setting (``recipe.get("batch_size")``).

        Examples
        --------
        >>> Recipe().get("strategy")
        <Strategy.DDP: 'ddp'>
        """
        group, field = KEYWORD_FIELDS[key]
        record = getattr(self, group)
        return record if not field else getattr(record, field)

    @classmethod
    def from_keywords(cls, recipe: Recipe | None = None, **keywords: Any) -> Recipe:
        """The Recipe that flat keywords mean, on top of ``recipe`` where one is given.

        A keyword left at its :func:`default` is not given: without ``recipe`` the default
        applies, with one the recipe's value does. A keyword given explicitly must agree
        with ``recipe``: one that asks for something else than the recipe holds is a
        ValueError naming both, even where it asks for the keyword's default.

        Examples
        --------
        >>> base = Recipe.from_keywords(precision="bf16")
        >>> Recipe.from_keywords(base, batch_size=1, precision="bf16") == base
        True
        >>> Recipe.from_keywords(base, precision=default("fp32")) == base
        True
        >>> Recipe.from_keywords(base, precision="fp32")
        Traceback (most recent call last):
        ...
        ValueError: precision='fp32' conflicts with the recipe's step.precision='bf16': ...
        """
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a vram_widget.Recipe, got {type(recipe).__name__}")
        explicit = {k: v for k, v in keywords.items() if not isinstance(v, Default)}
        if recipe is None:
            return cls().with_(**{k: given(v) for k, v in keywords.items()})
        for key, value in explicit.items():
            wanted = recipe.with_(**{key: value}).get(key)
            held = recipe.get(key)
            if wanted != held:
                group, field = KEYWORD_FIELDS[key]
                where = group if not field else f"{group}.{field}"
                raise ValueError(
                    f"{key}={value!r} conflicts with the recipe's {where}={_show(held)}: pass "
                    f"the setting in one place (recipe.with_({key}=...))"
                )
        return recipe


def _show(value: object) -> str:
    """A held value as a person typed it: ``'bf16'`` for an enum member."""
    if isinstance(value, Optimizer):
        if value.name is None:
            return "None"
        suffix = "" if value.implementation is None else f"-{value.implementation.value}"
        return repr(f"{value.name.value}{suffix}")
    if isinstance(value, Weights) and value == Weights(value.format):
        return _show(value.format)
    if isinstance(value, Float8) and value == Float8(value.recipe):
        return _show(value.recipe)
    inner = getattr(value, "value", value)
    return repr(inner)
