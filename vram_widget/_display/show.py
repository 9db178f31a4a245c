"""The notebook's entry point: :func:`show_memory` checks the settings it is given (those
that need no profile, before the model is run), profiles the model once and opens a
:class:`~.widget.MemoryWidget` on the profile."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import traitlets

from .._estimating.chunked_loss import check_loss_chunks
from .._estimating.compiled import CompileScope, parse_activation_memory_budget
from .._estimating.levers import NO_LEVERS
from .._estimating.offloading import offload_levers
from .._estimating.options import Device, Mode
from .._estimating.recipe import Recipe
from .._estimating.sharding import SINGLE_DEVICE
from .widget import SETTINGS, MemoryWidget
from .widget_compile import compile_choice
from .widget_controls import OFFLOAD_OFF
from .widget_kv_cache import check_kv_cache_forms
from .widget_parallel import check_rank_forms
from .widget_pipeline import check_pipeline_forms
from .widget_recipe import recipe_settings
from .widget_settings import check_optimizer_settings as _check_optimizer_settings
from .widget_settings import check_policy_value as _check_policy_value
from .widget_settings import gpu_settings as _gpu_settings
from .widget_settings import offload_choice

__all__ = ["show_memory"]


def show_memory(
    model: Any,
    input_size: Any = None,
    inputs: Any = None,
    loss_fn: Any = None,
    device: str = "cuda",
    seq_axis: Any = None,
    cache: Any = True,
    recipe: Recipe | None = None,
    trust_remote_code: bool = False,
    **initial_settings: Any,
) -> MemoryWidget:
    """Profile ``model`` once and show an interactive memory / FLOPs widget.

    Parameters
    ----------
    model : torch.nn.Module or str
        The model to estimate (any device, including meta), or a Hugging Face Hub id or a
        local directory holding a config.json (see :func:`vram_widget.profile_model`: built
        from the config alone, profiled at the ``seq_len`` setting, by default 128 tokens).
    input_size : tuple of int, optional
        The shape of one sample (no batch dimension).
    inputs : Tensor, tuple or dict of Tensors, optional
        An example batch (dim 0 is the batch); give this or ``input_size``.
    loss_fn : callable, optional
        Maps the model's output to a scalar loss (see :func:`vram_widget.profile_model`).
    device : {"cuda", "cpu"}
        Whose kernels the estimate is for.
    seq_axis : None, False, int or dict, optional
        The sequence dimension the "sequence length" slider varies (see
        :func:`vram_widget.profile_model`; None finds Hugging Face token inputs).
    cache : bool or path, optional
        Whether the profile is read from and written to the on-disk cache (see
        :func:`vram_widget.profile_model`).
    recipe : Recipe, optional
        A whole setup (:class:`~vram_widget.Recipe`, e.g. from
        ``Recipe.from_training_arguments``): its settings start the controls, those with no
        control (``lora_targets``, ``lora_dtype``, ``context_bytes``, ``lazy_loading``,
        ``fsdp_units``) are held for every estimate, and what its config sets but the
        estimate leaves out is listed in the summary. A setting given here too must agree.
    trust_remote_code : bool, optional
        For a model named by a string whose architecture is the repository's own code: True
        downloads and runs that code (see :func:`vram_widget.profile_model`).
    **initial_settings
        Starting values of the controls: ``batch_size`` (int >= 1), ``seq_len`` (tokens
        per sample, where the profile has a sequence axis; default: the example's),
        ``precision``
        ({"fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"}), ``optimizer`` (a name of
        ``optimizer_names()``, an implementation suffix included: ``"adamw-fused"``; or
        ``"none"``/None), ``optimizer_in_backward`` (bool: each parameter stepped in the
        backward; one GPU, one micro-batch), ``set_to_none`` (bool: False keeps the
        gradients between steps, ``zero_grad(set_to_none=False)``), ``weights`` (None or
        a format: "int8", "nf4", "nf4-dq", "fp4", "int8-torchao", "int4-torchao",
        "nf4-torchao") and ``float8`` (None, True, "tensorwise" or "rowwise"; setting
        one clears the other), ``mode``
        ({"train", "inference", "generate"}: generation
        where the model has ``generate()``, the sequence slider then the prompt's length),
        ``new_tokens`` (int >= 1, the tokens a generation adds after the prompt),
        ``kv_cache`` (None, the model's own cache, or ``"quantized"``: transformers'
        ``QuantizedCache`` with optimum-quanto, estimated while ``new_tokens`` stays within
        its ``residual_length``, 128) and ``kv_bits`` (4 or 2; its dropdown shows in mode
        generate), ``gpu``
        (a GPU name of the catalog, ``"H100"``, ``"custom"``, or a capacity in any form
        ``MemoryEstimate.fits`` takes: ``"80GiB"``, ``"80G"``, ``"24 GB"`` (10**9) or bytes,
        which selects the custom size), ``custom_gib`` (float), ``depth``
        (module grouping depth, int >= 0), ``show_frontier`` (bool: open the batch x
        sequence-length panel, where the profile has a sequence axis), the memory levers
        ``checkpoint`` ("off", "auto" or a class name), ``checkpoint_policy`` ("off",
        "full", "op" or an int k: every k-th block; a policy with ``checkpoint`` "off"
        checkpoints the "auto" blocks), ``trainable`` (comma-separated parameter-name
        patterns, "" for all), ``grad_accumulation`` (int >= 1), ``lora_rank`` (0 for
        none) and ``loss_chunks`` (None, or k >= 1: the output and cross-entropy in k
        chunks, for a Hugging Face causal LM with labels), ``offload_activations`` ("off",
        "torchtune" or "save_on_cpu", or estimate's None, False or True: the saved
        activations offloaded to host memory; training on one GPU of a CUDA profile),
        ``compile`` ("off", "model" or "blocks", or estimate's None, False or True:
        the training step as ``torch.compile`` runs it, profiled at each batch size, so
        the searches over the batch are not shown with it) and ``activation_memory_budget``
        (float in [0, 1], 1.0 the partitioner's default; with ``compile`` on only),
        ``expandable_segments`` (bool, CUDA profiles), and the data-parallel ``gpus``
        (int >= 1), ``strategy`` ({"ddp", "zero1", "zero2", "zero3", "hsdp"}) and
        ``gpus_per_node`` (int >= 1: hsdp shards within a node; its box shows with that
        strategy), ``tp`` ({1, 2, 4, 8}: tensor-parallel ranks among ``gpus``, by the
        model's own plan; its control is off where the model has none), and ``pp`` ({1, 2,
        4, 8}: pipeline stages of a Hugging Face decoder on a CPU profile, one a GPU, with
        ``gpus`` = ``dp`` x ``pp`` x ``tp``: ``dp > 1`` with ``strategy`` "zero2" or
        "zero3" only; moving the control keeps ``dp`` under those and sets it to 1 under
        the others, and giving ``pp`` without ``gpus`` sets ``dp`` to 1), ``pp_schedule``
        ({"gpipe", "1f1b", "interleaved-1f1b"}), ``microbatches`` (int >= 1, or None:
        ``pp``) and ``stages_per_rank`` (int >= 2 with "interleaved-1f1b", or None: 2), and
        ``ep`` (int >= 1: expert-parallel ranks of a model with experts, dividing their
        number; its control shows for such a model) and ``cp`` (int >= 1: context-parallel
        ranks of a ``device="cuda"`` profile of an SDPA model, dividing ``seq_len``;
        UNCONFIRMED against a real CUDA run), each the whole world: given without
        ``gpus``, ``gpus`` is ``pp x tp x ep x cp``, as moving their controls sets it.

    Returns
    -------
    MemoryWidget
        The widget (an ``ipywidgets.VBox``; its traits are the settings, ``.estimate`` the
        current :class:`~vram_widget.MemoryEstimate`, ``.figure`` the ``go.FigureWidget``).

    Raises
    ------
    TypeError
        For a setting name that is not one of the controls (before profiling), for a
        ``checkpoint_policy``, ``loss_chunks`` or ``offload_activations`` of no valid type
        (before profiling), and for
        inputs :func:`vram_widget.profile_model` refuses with a TypeError, and for an
        ``optimizer_in_backward`` or ``set_to_none`` that is not a bool (before profiling).
    ValueError
        For a ``gpu`` in no capacity form, or an unknown or ambiguous GPU name (before
        profiling; every form ``MemoryEstimate.fits`` takes is valid), for a setting
        value the control refuses (``batch_size=0``, ``pp=3``: before profiling), for an
        unknown optimizer or a
        refused way of stepping it (in the backward with ``set_to_none=False``, with
        ``grad_accumulation`` > 1 or with ``gpus`` > 1; before profiling), and for inputs
        :func:`vram_widget.profile_model` refuses (a sequence past the model's position
        table, no example input); each message names the problem and the valid forms.
    ProfilingError
        Where the model cannot be run on fake tensors or in the CPU fallback, as
        :func:`vram_widget.profile_model` raises it.

    Examples
    --------
    >>> import torch
    >>> from vram_widget import show_memory, zoo
    >>> w = show_memory(zoo.mlp(), input_size=(784,), device="cpu", batch_size=64)
    >>> w.batch_size = 128          # what the slider does
    >>> w.estimate.batch_size
    128
    >>> w.figure.data[0].name
    'resident'
    >>> show_memory(zoo.mlp(), input_size=(784,), gpu="A100")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: GPU 'A100' is ambiguous: it names 'A100 80GB' (80 GiB), 'A100 40GB' (40 GiB); ...
    >>> w = show_memory(zoo.mlp(), input_size=(784,), device="cpu", optimizer="adamw-fused",
    ...                 optimizer_in_backward=True)
    >>> w.estimate.optimizer_implementation, w.estimate.levers.in_backward
    ('fused', 'adamw-fused')
    >>> w = show_memory(zoo.causal_decoder(), inputs=torch.zeros(2, 16, dtype=torch.long),
    ...                 device="cpu", checkpoint_policy=1)
    >>> w.checkpoint, w.estimate.levers.describe()
    ('auto', 'checkpointing 2 module(s) (every 1st block)')
    """
    from .._profiling.profiler import profile_model

    from_recipe = recipe_settings(recipe) if recipe is not None else None
    if from_recipe is not None:
        for name, value in from_recipe.controls.items():
            if name in initial_settings and not _agrees(name, initial_settings[name], value):
                raise ValueError(
                    f"{name}={initial_settings[name]!r} conflicts with the recipe's "
                    f"{value!r}: give the setting in one place"
                )
        initial_settings = {**from_recipe.controls, **initial_settings}
    # settings that need no profile are checked before the model is run
    for name in initial_settings:
        if name not in SETTINGS:
            raise TypeError(f"unknown setting {name!r}; valid settings are {', '.join(SETTINGS)}")
    if "gpu" in initial_settings:
        _gpu_settings(initial_settings["gpu"])
    _check_optimizer_settings(initial_settings)
    _check_lever_forms(initial_settings, device)
    check_pipeline_forms(initial_settings)
    check_rank_forms(initial_settings)
    check_kv_cache_forms(initial_settings)
    profile = profile_model(
        model,
        input_size=input_size,
        inputs=inputs,
        loss_fn=loss_fn,
        device=device,
        seq_axis=seq_axis,
        precisions=(initial_settings.get("precision", "fp32"),),  # the first one asked
        cache=cache,
        **_named_model_keywords(model, initial_settings, trust_remote_code),
    )
    try:
        if from_recipe is None:
            return MemoryWidget(profile, **initial_settings)
        return MemoryWidget(
            profile,
            fixed_settings=from_recipe.fixed,
            ignored=from_recipe.ignored,
            **initial_settings,
        )
    except traitlets.TraitError as exc:  # a control's own check of its starting value
        raise ValueError(f"invalid setting: {exc}") from None


def _agrees(name: str, given: object, control_value: object) -> bool:
    """Whether a setting given to :func:`show_memory` is a recipe's control value (any
    form of ``offload_activations`` estimate takes: True is "torchtune")."""
    forms = {"offload_activations": offload_choice, "compile": compile_choice}
    if name in forms:
        try:
            given = forms[name](given)
        except (TypeError, ValueError):
            return False
    return given == control_value


def _check_lever_forms(settings: Mapping[str, Any], device: object = Device.CUDA.value) -> None:
    """The forms of ``checkpoint_policy``, ``loss_chunks``, ``offload_activations``,
    ``compile`` and ``activation_memory_budget``, checked before the model is run (their
    bounds are the model's: the widget checks those), and offloading where the device or
    the mode refuses it."""
    try:
        if "checkpoint_policy" in settings:
            _check_policy_value(settings["checkpoint_policy"])
        if "loss_chunks" in settings:
            check_loss_chunks(settings["loss_chunks"])
        if "offload_activations" in settings:
            _check_offload(settings["offload_activations"], settings.get("mode"), device)
        if "compile" in settings:
            compile_choice(settings["compile"])
        if "activation_memory_budget" in settings:  # a control of its own: any scope
            parse_activation_memory_budget(settings["activation_memory_budget"], CompileScope.MODEL)
    except TypeError as exc:
        raise TypeError(f"invalid setting: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"invalid setting: {exc}") from None


def _check_offload(value: object, mode: object, device: object) -> None:
    """``offload_activations`` in a form the control holds, and not on a CPU profile or in
    a mode without a backward (``offload_levers`` says why); an unknown device or mode is
    left to the profiler's and the control's own checks."""
    choice = offload_choice(value)
    if choice == OFFLOAD_OFF:
        return
    modes = {m.value: m for m in Mode}
    devices = {d.value: d for d in Device}
    run_mode = modes.get(str(mode if mode is not None else Mode.TRAIN.value))
    target = devices.get(str(getattr(device, "value", device)))
    if run_mode is not None and target is not None:
        offload_levers(NO_LEVERS, choice, run_mode, target, SINGLE_DEVICE)


def _named_model_keywords(
    model: Any, settings: dict[str, Any], trust_remote_code: bool
) -> dict[str, Any]:
    """profile_model's keywords for a model named by a string: the sequence slider's start
    is the example's length (a module takes neither keyword)."""
    if not isinstance(model, str | os.PathLike):
        return {"trust_remote_code": True} if trust_remote_code else {}
    keywords: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if isinstance(settings.get("seq_len"), int):
        keywords["seq_len"] = settings["seq_len"]
    return keywords
