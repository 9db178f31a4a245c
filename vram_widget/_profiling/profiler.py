"""The profiler: runs one training step and one inference pass of a model on fake tensors
(or, as a fallback, on real CPU tensors at a tiny batch) under the recorder, and returns raw
traces. Everything torch-specific about profiling is here; the table, the estimator and the
widget only see numpy arrays.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call

from .._estimating.options import (
    Device,
    Mode,
    OptimizerName,
    Precision,
    parse_option,
)
from .._estimating.profile import ModelProfile
from .._estimating.profile_source import ProfilingError
from .chunked_loss import chunked_loss_refusal
from .compiled import fsdp_blocks_refusal
from .data_dependent import graph_randomness
from .disk_cache import cached_source
from .fake import (
    new_fake_mode,
    quiet_fake_tensor_log,
    quiet_third_party,
)
from .generation import cache_config_of, generation_limit
from .hub import model_or_name
from .repeated import (
    BlockStack,
    reduced_copy,
)
from .source_runs import SourceRuns
from .step import (
    ModelInputs,
    check_forward_accepts,
    check_model,
    checkpoint_auto,
    paused_gc,
)
from .step_profiler import (
    Profiler,
)
from .sub_profiles import SubProfiles
from .subject import (
    _COMMON_BATCH_SIZES,
    InputShapeWarning,
    Subject,
    _check_devices,
    _check_input_size,
    _check_position_table,
    _preserved_model_state,
    _shape_text,
    attention_window,
    find_seq_axes,
    position_limit,
)
from .tensor_parallel import local_part


class _Source(SourceRuns, SubProfiles):
    """Profiles one precision and mode (or one optimizer) when the table first asks."""

    def _reduced_source(self, stack: BlockStack, n: int) -> _Source:
        """The source of a meta copy of the model with ``n`` blocks of its stack."""
        if n not in self._reduced:
            subject = self.profiler.subject
            few = Subject(
                reduced_copy(subject.model, stack, n),
                subject.inputs,
                subject.input_size,
                subject.loss_fn,
                subject.device,
            )
            few.seq_axes = dict(subject.seq_axes)
            source = _Source(Profiler(few), cache=False)
            source.use_repeated = False
            self._reduced[n] = source
        return self._reduced[n]

    def _sub_profile(
        self, model: torch.nn.Module, cache: object, seq_len: int | None = None
    ) -> ModelProfile:
        """A deferred profile of a meta copy of the model (LoRA's, the quantized one) with
        the same inputs, loss, device and sequence axis; the parent profile ran the model
        already, so no run is made here. With ``seq_len``, the example at that length
        (its values tiled, ``Subject.make_inputs``)."""
        subject = self.profiler.subject
        input_size, inputs = subject.input_size, subject.inputs
        if seq_len is not None and inputs is not None:
            n = inputs.batch_size()
            inputs = subject.make_inputs(n, Precision.FP32, real=True, seq_len=seq_len)
        elif seq_len is not None and input_size is not None:
            sizes = [1, *input_size]
            for dim in subject.seq_axes.values():
                sizes[dim] = seq_len
            input_size = tuple(sizes[1:])
        return profile_model(
            model,
            input_size=input_size,
            inputs=inputs,
            loss_fn=subject.loss_fn,
            device=subject.device.value,
            seq_axis=dict(subject.seq_axes) or False,
            precisions=(),
            cache=cache,
        )


def profile_model(
    model: torch.nn.Module | str | os.PathLike[str],
    input_size: Any = None,
    inputs: Any = None,
    loss_fn: Callable[[Any], Any] | None = None,
    device: str = "cuda",
    seq_axis: Any = None,
    *,
    precisions: Any = None,
    cache: Any = True,
    seq_len: int | None = None,
    trust_remote_code: bool = False,
) -> ModelProfile:
    """Profile one training step and one inference pass of ``model`` on fake tensors.

    The model is run on fake tensors (no real memory, so any model size profiles), at a few
    small batch sizes; every allocation and free is recorded with the module and phase it
    happened in, and fitted to ``a + b * batch``. The model itself is left exactly as it was:
    parameters, gradients, device, dtype, training flags, hooks and the global RNG state.

    Parameters
    ----------
    model : torch.nn.Module or str
        Any module, on any device, including the meta device; nothing is moved or allocated
        there (parameters and buffers are profiled as fake CPU tensors of their shapes). Or a
        Hugging Face Hub id (``"org/name"``) or a local directory holding a ``config.json``:
        only the config is read, and the model is built from it on the meta device, with the
        class ``config.architectures`` names (else ``AutoModelForCausalLM``, else
        ``AutoModel``), fed ``input_ids`` (and ``labels``, for a language-model head) of
        ``seq_len`` tokens; ``input_size`` and ``inputs`` are then refused. The profile's
        ``model_name`` says which class was built (``vram_widget._profiling.hub``).
    input_size : tuple of int, optional
        The shape of one sample, without the batch dimension; the input is one float tensor.
    inputs : Tensor, tuple of Tensors or dict of keyword Tensors, optional
        An example batch (dim 0 is the batch). Give this or ``input_size``. Only shapes and
        dtypes are read: on the model's device, or on the meta device; a batch on another
        real device than the model's (which its real step would reject) is a ValueError.
    loss_fn : callable, optional
        Maps the model's output to a scalar loss. Default: ``output.loss`` when present, else
        the first floating tensor of the output, ``.float().mean()``.
    device : {"cuda", "cpu"}
        Whose kernels and defaults the estimate is for. ``"cuda"`` emulates CUDA's kernel
        choices (fused dropout masks, flash / memory-efficient attention, foreach optimizers,
        CUDA autocast lists, 512-byte allocator blocks); ``"cpu"`` reproduces a CPU step.
    seq_axis : None, False, int or dict, optional
        The sequence dimension, which ``estimate(seq_len=...)`` varies. None finds Hugging
        Face token inputs (dim 1 of ``input_ids``, ``attention_mask``, ``token_type_ids``,
        ``position_ids``, ``labels``, ``decoder_input_ids`` as 2-D integer tensors, or of
        2-D integer positional tensors) where they share one length; an int is that dim of
        every batched input that has it; a dict maps input names (``"[0]"`` for the first
        positional) to dims; False means none.
    precisions : sequence of str, optional
        The precisions whose training step, inference pass and Adam step are profiled now
        (each other setting is profiled on its first estimate). The default, None,
        profiles nothing up front: one unrecorded fake training step and inference forward
        (fp32, nothing recorded) check that the model runs, so that a model or input that
        cannot run is refused here, and each setting is profiled on its first estimate (an
        estimate in bf16 runs no fp32 profile). Where that check fails, fp32 is profiled
        now, as ``("fp32",)`` does, and raises the error (or falls back to a real run) as
        it did. ``()`` defers every run without the check; ``("bf16",)`` runs bf16 alone.
    cache : bool or path, optional
        Whether profiles are read from and written to the on-disk cache: True (the user
        cache directory, ``$VRAM_WIDGET_CACHE_DIR`` where set, off where
        ``$VRAM_WIDGET_CACHE`` is ``0``), False, or a cache directory. A second process
        that profiles the same model, inputs, loss and device with the same library
        versions runs nothing; what is in the key is listed in
        ``vram_widget._profiling.disk_cache``. A ``loss_fn`` whose state cannot be hashed (a
        bound method, a closure over a tensor) is not cached.
    seq_len : int, optional
        For a model named by a string: tokens per sample of the example batch (default 128,
        or the config's ``max_position_embeddings`` where that is less); ``estimate(seq_len=)``
        varies it afterwards.
    trust_remote_code : bool, optional
        For a model named by a string whose architecture is the repository's own code
        (``config.auto_map``), not transformers': True downloads and runs that code.

    Returns
    -------
    ModelProfile
        Call ``.estimate(batch_size, precision, optimizer, mode)`` on it.

    Examples
    --------
    >>> from vram_widget import profile_model, zoo
    >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    >>> profile.param_count
    669706
    >>> est = profile.estimate(batch_size=32, optimizer="adam")
    >>> # exp_avg and exp_avg_sq per parameter, plus a 4-byte step per tensor (6 tensors)
    >>> est.optimizer_state_bytes == 2 * 4 * profile.param_count + 6 * 4
    True
    """
    model, inputs, model_name = model_or_name(model, input_size, inputs, seq_len, trust_remote_code)
    check_model(model)
    target = parse_option(Device, device, "device")
    eager = () if precisions is None else _parse_precisions(precisions)
    if inputs is None and input_size is None:
        raise ValueError(
            "give the example input: input_size=(...) for one sample's shape, "
            "or inputs=<an example batch>"
        )
    if inputs is not None and input_size is not None:
        raise ValueError("give input_size or inputs, not both")
    model_inputs = None
    size = None
    if inputs is not None:
        model_inputs = ModelInputs.from_user(inputs)
        model_inputs.batch_size()  # raises a clear error when no tensor has a batch dim
        _check_devices(model, model_inputs)
    else:
        size = _check_input_size(input_size)
    check_forward_accepts(model, model_inputs or ModelInputs((None,), {}))
    seq_axes, no_seq_reason = find_seq_axes(model_inputs, size, seq_axis)
    subject = Subject(model, model_inputs, size, loss_fn, target, seq_axes=seq_axes)
    seq_len_limit = position_limit(model) if seq_axes else None
    _check_position_table(subject, seq_len_limit)
    profiler = Profiler(subject)
    inner = _Source(profiler, cache)
    source = cached_source(
        inner,
        cache,
        model,
        _named_values(model_inputs),
        size,
        loss_fn,
        target.value,
        seq_axes,
    )
    auto_blocks, hf_auto = checkpoint_auto(model, subject.rows.names[:-2], subject.rows.types[:-2])
    generates, limit, cache_implementation = generation_limit(model)
    profile = ModelProfile(
        subject.rows,
        target,
        source,
        model_name=model_name,
        input_shape=subject.describe_inputs(),
        seq_len=subject.seq_len,
        no_seq_reason=no_seq_reason,
        seq_len_limit=seq_len_limit,
        seq_window=attention_window(model) if seq_axes else None,
        generates=generates,
        generation_limit=limit,
        cache_implementation=cache_implementation,
        cache_config=cache_config_of(model),
        param_names=tuple(name for name, _p, _row in subject._params),
        # a tensor-parallel rank's DTensor holds its local shard: FSDP2 and DDP see that
        param_shapes=tuple(tuple(local_part(p).shape) for _name, p, _row in subject._params),
        param_trainable=tuple(p.requires_grad for _name, p, _row in subject._params),
        checkpoint_blocks=auto_blocks,
        hf_checkpointing=hf_auto,
        loss_chunks_refusal=chunked_loss_refusal(model, model_inputs, loss_fn),
        compile_fsdp_refusal=fsdp_blocks_refusal(model),
    )
    if precisions is None and not _made_before(source) and not inner.check_runs():
        # the check cannot tell: the fp32 profile says whether (and how) the model runs
        eager = (Precision.FP32,)
    # Training and inference, and Adam, in the precisions the first estimate asks for.
    try:
        for precision in eager:
            profile.timeline(precision, Mode.TRAIN)
            profile.timeline(precision, Mode.INFERENCE)
            profile.optimizer_trace(precision, OptimizerName.ADAM)
    except ProfilingError:
        # A kernel that runs in some dtypes only (the CUDA grouped GEMM of mixture-of-experts
        # layers: bf16) fails fp32 alone. The profile serves the precisions that run, and
        # an estimate in fp32 raises that error; where none runs, the model cannot be run.
        if not _another_precision_runs(profile):
            raise
    profile.fallback_reason = subject.fallback_reason
    knobs = graph_randomness(model)
    if knobs:
        where = ", ".join(f"{type(o).__name__}.{n}={v:g}" for o, n, v, _off in knobs[:3])
        warnings.warn(
            f"{type(model).__name__} drops random layers in training ({where}): the training "
            "estimate is for the step in which no layer is dropped, the worst case",
            UserWarning,
            stacklevel=2,
        )
    if size is not None:
        _warn_if_batch_in_input_size(subject)
    return profile


def _named_values(inputs: ModelInputs | None) -> list[tuple[str, Any]]:
    """Every example input by name (``"[i]"`` positional), tensors or not."""
    if inputs is None:
        return []
    return [*((f"[{i}]", v) for i, v in enumerate(inputs.args)), *inputs.kwargs.items()]


def _parse_precisions(precisions: Any) -> tuple[Precision, ...]:
    """``profile_model``'s ``precisions=``: one precision or a sequence of them."""
    if isinstance(precisions, str | Precision):
        precisions = (precisions,)
    try:
        items = tuple(precisions)
    except TypeError:
        raise TypeError(
            "precisions must be a sequence of precisions such as ('fp32',) or ('bf16',), "
            f"or () to profile on the first estimate; got {precisions!r}"
        ) from None
    return tuple(dict.fromkeys(parse_option(Precision, p, "precision") for p in items))


def _made_before(source: object) -> bool:
    """Whether the on-disk cache holds runs of this profile: a process profiled the same
    model, inputs, loss and device before, so it runs (``DiskCachedSource.made_before``)."""
    made_before = getattr(source, "made_before", None)
    return made_before is not None and bool(made_before())


def _another_precision_runs(profile: ModelProfile) -> bool:
    for precision in (Precision.BF16, Precision.FP16):
        try:
            profile.timeline(precision, Mode.TRAIN)
            profile.timeline(precision, Mode.INFERENCE)
        except ProfilingError:
            continue
        return True
    return False


def _warn_if_batch_in_input_size(subject: Subject) -> None:
    """Warn where ``input_size`` starts with a common batch size and the model would also run
    on one sample without that dimension: then the user more likely gave a batch's shape."""
    size = subject.input_size
    if size is None or len(size) < 2 or size[0] not in _COMMON_BATCH_SIZES:
        return
    if not _forward_runs(subject, size[1:]):
        return
    warnings.warn(
        f"input_size={size} is read as the shape of ONE sample (inputs: batch × "
        f"{_shape_text(size)}), but it starts with {size[0]}, a common batch size, and the "
        f"model also runs on samples of shape {size[1:]}. If {size[0]} is the batch, pass "
        f"input_size={size[1:]}. (Silence with warnings.filterwarnings('ignore', "
        "category=vram_widget.InputShapeWarning).)",
        InputShapeWarning,
        stacklevel=3,
    )


def _forward_runs(subject: Subject, sample_shape: tuple[int, ...]) -> bool:
    """Whether one fake inference forward of the model runs on samples of this shape."""
    probe = Subject(subject.model, None, sample_shape, None, subject.device)
    fake_mode = new_fake_mode()
    with (
        _preserved_model_state(subject.model),
        paused_gc(),
        quiet_fake_tensor_log(),
        quiet_third_party(),
        fake_mode,
        torch.no_grad(),
    ):
        params, buffers = probe.make_state(Precision.FP32, real=False)
        (x,) = probe.make_inputs(2, Precision.FP32, real=False).args
        subject.model.eval()
        try:
            functional_call(subject.model, {**params, **buffers}, (x,), tie_weights=True)
        except Exception:
            return False
    return True


__all__ = [
    "profile_model",
]
