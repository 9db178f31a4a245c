"""What is profiled: the model with its example inputs, loss and device (:class:`Subject`),
the raw trace one recorded run returns (:class:`RawTrace`), and the checks of the inputs
made before any run (input sizes, sequence axes, position tables, devices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._estimating.communication import Collective
from .._estimating.levers import Levers
from .._estimating.options import (
    Device,
    Precision,
)
from .._estimating.table import (
    ModuleRows,
)
from .nf4_torchao import fake_nf4_weight, is_nf4_weight
from .quantized import (
    fake_quantized,
    is_quantized_param,
)
from .step import (
    ModelInputs,
    storage_dtype,
)
from .tensor_parallel import (
    is_dtensor,
    local_shard_like,
)
from .torchao_weights import fake_torchao_weight, is_torchao_weight

LOSS_ROW_NAME = "(loss)"
OPTIMIZER_ROW_NAME = "(optimizer)"


class InputShapeWarning(UserWarning):
    """``input_size`` may hold a batch dimension: the profile is for the shape as given.

    Silence it with ``warnings.filterwarnings("ignore", category=InputShapeWarning)`` where
    the leading dimension is meant (a sequence of 32 frames, say)."""


# Leading dimensions of an ``input_size`` that look like a batch size (1 and powers of two)
_COMMON_BATCH_SIZES = frozenset({1, *(2**k for k in range(1, 13))})


@dataclass(frozen=True)
class RawTrace:
    """What the recorder saw in one run at one batch size."""

    batch_size: int
    event_storage: np.ndarray  # int64
    event_bytes: np.ndarray  # int64, signed
    event_module: np.ndarray  # int32
    event_phase: np.ndarray  # int8
    event_op: np.ndarray  # int32 index into op_names (-1: none)
    op_names: tuple[str, ...]  # "aten.addmm", or the autograd node in backward
    storage_category: np.ndarray  # int8, per storage id
    storage_module: np.ndarray  # int32, per storage id (row that allocated it; -1 resident)
    storage_resident: np.ndarray  # bool
    storage_bytes: np.ndarray  # int64 (size at allocation or registration)
    flops_forward: np.ndarray  # int64 per row
    flops_backward: np.ndarray  # int64 per row
    output_shapes: tuple[tuple[int, ...] | None, ...]
    workspace_storages: np.ndarray  # int64 storage ids of measured kernel workspaces
    backward_start: int  # index of the first backward event (train), else len
    optimizer_at: int  # index where the optimizer step's events are spliced in (train)
    uses_matmul: bool
    # generation: where each forward starts (prefill, decode steps), then the end
    step_starts: tuple[int, ...] = ()
    # generation: the FLOPs per row counted before each of those points (steps x rows)
    step_flops: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    # activation offloading: the host bytes its copies took at their peak (0: none)
    host_peak_bytes: int = 0
    # torch.compile: why a compiled graph ran node by node instead of as Inductor's
    # generated code (compiled_inductor.py), one line each; () where none did
    compile_fallbacks: tuple[str, ...] = ()
    # the probe signature of each workspace storage that is a kernel's scratch (None: an
    # output placeholder or retained casts), in ``workspace_storages`` order
    workspace_signatures: tuple[Any, ...] = ()
    # a parallel rank's collectives, in order (``Profiler.record_collectives``; None: not
    # recorded)
    collectives: tuple[Collective, ...] | None = None


@dataclass
class Subject:
    """The model and example inputs being profiled, and how to rebuild them at any batch."""

    model: torch.nn.Module
    inputs: ModelInputs | None
    input_size: tuple[int, ...] | None
    loss_fn: Callable[[Any], Any] | None
    device: Device
    rows: ModuleRows = field(init=False)
    _row_of: dict[int, int] = field(init=False)
    _params: list[tuple[str, torch.nn.Parameter, int]] = field(init=False)
    _buffers: list[tuple[str, torch.Tensor, int]] = field(init=False)
    fallback_reason: str | None = None
    # names of the parameters a traced training step gave a gradient, per levers (set by
    # that step; the optimizer state is made for these only)
    params_with_grad: dict[Levers, set[str]] = field(default_factory=dict)
    # input name ("[0]" positional, or the keyword) -> its dim that is the sequence
    seq_axes: dict[str, int] = field(default_factory=dict)
    # parameters that keep their own dtype whatever the precision (PEFT's adapters, which it
    # keeps in fp32 on an fp16 / bf16 base)
    fixed_dtypes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        names, types, depths, mods = [], [], [], []
        for name, mod in self.model.named_modules():  # dedups shared modules: first name wins
            names.append(name)
            types.append(type(mod).__name__)
            depths.append(0 if name == "" else name.count(".") + 1)
            mods.append(mod)
        self._row_of = {id(m): i for i, m in enumerate(mods)}
        n = len(mods) + 2
        param_count = np.zeros(n, np.int64)
        trainable = np.zeros(n, np.int64)
        buffer_count = np.zeros(n, np.int64)
        self._params = []
        seen: set[int] = set()
        for row, mod in enumerate(mods):
            prefix = names[row] + "." if names[row] else ""
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen:
                    continue  # tied weight: counted once, at its first owner
                seen.add(id(p))
                self._params.append((prefix + pname, p, row))
                param_count[row] += p.numel()
                if p.requires_grad:
                    trainable[row] += p.numel()
        self._buffers = []
        seen_buffers: set[int] = set()
        for row, mod in enumerate(mods):
            prefix = names[row] + "." if names[row] else ""
            for bname, b in mod.named_buffers(recurse=False):
                if b is None or id(b) in seen_buffers:
                    continue
                seen_buffers.add(id(b))
                self._buffers.append((prefix + bname, b, row))
                buffer_count[row] += b.numel()
        self.rows = ModuleRows(
            names=(*names, LOSS_ROW_NAME, OPTIMIZER_ROW_NAME),
            types=(*types, "loss", "optimizer"),
            depths=np.asarray([*depths, 0, 0], dtype=np.int32),
            param_count=param_count,
            trainable_param_count=trainable,
            buffer_count=buffer_count,
        )

    @property
    def loss_row(self) -> int:
        return len(self.rows.names) - 2

    @property
    def optimizer_row(self) -> int:
        return len(self.rows.names) - 1

    # -- building the fake (or real fallback) state ----------------------------------------
    def _dtype(self, t: torch.Tensor, precision: Precision) -> torch.dtype:
        return storage_dtype(precision) if t.is_floating_point() else t.dtype

    def make_state(
        self,
        precision: Precision,
        real: bool,
        device: str = "cpu",
        param_dtype: torch.dtype | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Parameters and buffers as new leaf tensors in the precision's dtype (floating
        parameters in ``param_dtype`` where given: a wrapper's cast, FSDP2's
        MixedPrecisionPolicy): fake tensors (call inside the fake mode), meta tensors
        (``device="meta"``), or real CPU copies for the fallback."""
        params: dict[str, torch.Tensor] = {}
        for name, p, _row in self._params:
            dtype = p.dtype if name in self.fixed_dtypes else self._dtype(p, precision)
            if param_dtype is not None and name not in self.fixed_dtypes and p.is_floating_point():
                dtype = param_dtype
            if is_quantized_param(p):  # bitsandbytes' stored form (quantized.py)
                params[name] = fake_quantized(p, dtype)
                continue
            if is_torchao_weight(p):  # torchao's tensor subclass (torchao_weights.py)
                params[name] = fake_torchao_weight(p, dtype)
                continue
            if is_nf4_weight(p):  # torchao's NF4Tensor, as torchtune's QLoRA (nf4_torchao.py)
                params[name] = fake_nf4_weight(p, dtype)
                continue
            if is_dtensor(p):  # a tensor-parallel rank's shard (tensor_parallel.py)
                params[name] = local_shard_like(p, dtype, real, device)
                continue
            if real:
                t = p.detach().to(device="cpu", dtype=dtype, copy=True)
            else:
                t = torch.empty_strided(tuple(p.shape), p.stride(), dtype=dtype, device=device)
            params[name] = t.requires_grad_(p.requires_grad)
        buffers: dict[str, torch.Tensor] = {}
        for name, b, _row in self._buffers:
            dtype = self._dtype(b, precision)
            if real:
                buffers[name] = b.detach().to(device="cpu", dtype=dtype, copy=True)
            else:
                buffers[name] = torch.empty_strided(
                    tuple(b.shape), b.stride(), dtype=dtype, device=device
                )
        return params, buffers

    def describe_inputs(self) -> str:
        """The inputs' shapes as a person reads them, with the batch and sequence dimensions
        named: ``"batch × 3 × 224 × 224"``, or ``"input_ids: batch × seq int64, labels:
        batch × seq int64 (seq = 128)"``."""
        seq = f" (seq = {self.seq_len})" if self.seq_axes else ""
        if self.inputs is None:
            assert self.input_size is not None
            dims: list[Any] = ["batch", *self.input_size]
            for dim in self.seq_axes.values():
                dims[dim] = "seq"
            return _shape_text(tuple(dims)) + seq
        n = self.inputs.batch_size()

        def one(name: str, t: torch.Tensor) -> str:
            dims: list[Any] = list(t.shape)
            if dims and dims[0] == n:
                dims[0] = "batch"
            if name in self.seq_axes:
                dims[self.seq_axes[name]] = "seq"
            text = _shape_text(tuple(dims)) if dims else "scalar"
            dtype = str(t.dtype).removeprefix("torch.")
            return text if t.is_floating_point() else f"{text} {dtype}"

        tensors = self.inputs.named_tensors()
        if len(tensors) == 1 and not self.inputs.kwargs:
            return one(*tensors[0]) + seq
        return ", ".join(f"{k}: {one(k, v)}" for k, v in tensors) + seq

    @property
    def seq_len(self) -> int | None:
        """The example's sequence length (None without a sequence axis)."""
        if not self.seq_axes:
            return None
        name, dim = next(iter(self.seq_axes.items()))
        return _dim_size(self.inputs, self.input_size, name, dim)

    def make_inputs(
        self, batch_size: int, precision: Precision, real: bool, seq_len: int | None = None
    ) -> ModelInputs:
        """The example batch resized to ``batch_size`` along dim 0 (and to ``seq_len`` along
        the sequence axes), floats in the storage dtype (fake tensors inside the fake mode, or
        real CPU tensors: the example's values tiled)."""
        half = storage_dtype(precision)
        if self.inputs is None:
            assert self.input_size is not None
            shape = [batch_size, *self.input_size]
            if seq_len is not None:
                for dim in self.seq_axes.values():
                    shape[dim] = seq_len
            if real:
                gen = torch.Generator().manual_seed(0)
                return ModelInputs((torch.randn(shape, generator=gen).to(half),), {})
            return ModelInputs((torch.empty(shape, dtype=half),), {})
        n = self.inputs.batch_size()

        def resize(name: str, t: torch.Tensor) -> torch.Tensor:
            dtype = half if t.is_floating_point() else t.dtype
            sizes = list(t.shape)
            if t.dim() > 0 and t.shape[0] == n:
                sizes[0] = batch_size
            seq_dim = self.seq_axes.get(name)
            if seq_len is not None and seq_dim is not None:
                sizes[seq_dim] = seq_len
            if not real:
                return torch.empty(sizes, dtype=dtype)
            src = t.detach().to("cpu")
            for dim, size in enumerate(sizes):  # tile the example's values to the new sizes
                if size != src.shape[dim]:
                    reps = [1] * src.dim()
                    reps[dim] = -(-size // src.shape[dim])
                    src = src.repeat(*reps).narrow(dim, 0, size)
            return src.to(dtype).clone()

        return self.inputs.map_named(resize)


def _shape_text(dims: tuple[Any, ...]) -> str:
    return " × ".join(str(d) for d in dims)


def _describe(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)


def _changed_by_run(tensors: list[torch.Tensor], before: list[tuple[Any, ...]]) -> bool:
    """Whether a run left shared fake tensors otherwise than it found them: tensor hooks a
    forward registered (``self.w.register_hook(...)``), which would pile up run after run,
    or metadata it changed (``.data =``, ``requires_grad_``)."""
    for t, described in zip(tensors, before, strict=True):
        if getattr(t, "_backward_hooks", None) or getattr(t, "_post_accumulate_grad_hooks", None):
            return True
        if _describe(t) != described:
            return True
    return False


@contextlib.contextmanager
def _preserved_model_state(model: torch.nn.Module) -> Iterator[None]:
    """Restore every module's training flag and the global RNG state, whatever happens."""
    flags = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _check_input_size(input_size: Any) -> tuple[int, ...]:
    try:
        dims = tuple(input_size)
    except TypeError:
        dims = (input_size,)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ValueError(
            f"input_size must be the shape of one sample, a tuple of positive ints such as "
            f"(3, 224, 224); got {input_size!r}"
        )
    return dims


# Hugging Face's token inputs: dim 1 of each is the sequence where they share one length
# (tokenizer outputs, and the labels of a causal LM).
_TOKEN_INPUTS = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "position_ids",
    "labels",
    "decoder_input_ids",
)


def find_seq_axes(
    inputs: ModelInputs | None, input_size: tuple[int, ...] | None, seq_axis: Any
) -> tuple[dict[str, int], str]:
    """The sequence dimension of each input (``{}``: none), and why there is none where
    the automatic search found token inputs of different lengths.

    ``seq_axis``: None (find Hugging Face token inputs: dim 1 of the 2-D integer tensors named
    in ``_TOKEN_INPUTS``, or of 2-D integer positional tensors, where they share one length),
    False (none), an int (that dim of every batched input that has it) or a dict of input
    names (``"[0]"`` for the first positional) to dims.
    """
    if seq_axis is False:
        return {}, "seq_axis=False"
    # batched input name -> its ndim (input_size: the one float input)
    if inputs is None:
        assert input_size is not None
        ndims = {"[0]": 1 + len(input_size)}
        tensors: dict[str, torch.Tensor] = {}
    else:
        n = inputs.batch_size()
        tensors = {k: t for k, t in inputs.named_tensors() if t.dim() > 0 and t.shape[0] == n}
        ndims = {k: t.dim() for k, t in tensors.items()}
    shapes = _shapes_text(inputs, input_size)
    if seq_axis is None:
        if inputs is None:
            return {}, "input_size= has no automatic sequence axis (give seq_axis=)"
        found = {
            k: 1
            for k, t in tensors.items()
            if t.dim() == 2
            and not t.is_floating_point()
            and (k in _TOKEN_INPUTS or k.startswith("["))
        }
        if len({int(tensors[k].shape[1]) for k in found}) > 1:
            return {}, (
                f"the token inputs have different lengths ({shapes}): one sequence axis is "
                "supported; pass seq_axis={name: dim, ...} for the inputs that share it"
            )
        return found, "no token inputs (input_ids, ...) found; pass seq_axis= to name one"
    if isinstance(seq_axis, bool) or not isinstance(seq_axis, (int, dict)):
        raise TypeError(
            f"seq_axis must be None (find token inputs), False (none), a dim (int) or a dict "
            f"of input names to dims; got {seq_axis!r}"
        )
    if isinstance(seq_axis, int):
        if seq_axis < 1:
            raise ValueError(
                f"seq_axis={seq_axis}: dim 0 is the batch; the sequence is a later dim of the "
                f"inputs ({shapes})"
            )
        axes = {k: seq_axis for k, ndim in ndims.items() if ndim > seq_axis}
        if not axes:
            raise ValueError(f"seq_axis={seq_axis}: no batched input has dim {seq_axis} ({shapes})")
    else:
        axes = {}
        for k, dim in seq_axis.items():
            if k not in ndims:
                raise ValueError(
                    f"seq_axis names input {k!r}, which is not a batched input; the inputs "
                    f"are {shapes}"
                )
            ndim = ndims[k]
            if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim < ndim:
                raise ValueError(
                    f"seq_axis[{k!r}] = {dim!r}: give a dim from 1 to {ndim - 1} of {k} "
                    f"(dim 0 is the batch); the inputs are {shapes}"
                )
            axes[k] = dim
    lengths = {k: _dim_size(inputs, input_size, k, d) for k, d in axes.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise ValueError(
            f"the sequence axes have different lengths ({listed}): one sequence axis is "
            "supported; name only the inputs that share it"
        )
    return axes, ""


def _dim_size(
    inputs: ModelInputs | None, input_size: tuple[int, ...] | None, name: str, dim: int
) -> int:
    if inputs is None:
        assert input_size is not None
        return input_size[dim - 1]
    return int(dict(inputs.named_tensors())[name].shape[dim])


def _shapes_text(inputs: ModelInputs | None, input_size: tuple[int, ...] | None) -> str:
    if inputs is None:
        return f"input_size={input_size}"
    return ", ".join(f"{k}: {tuple(t.shape)}" for k, t in inputs.named_tensors())


def position_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence a model with learned absolute positions can take: its config's
    ``max_position_embeddings`` where an ``nn.Embedding`` of that many rows holds them
    (GPT-2's ``wpe``, BERT's ``position_embeddings``; a real step past it indexes out of
    range, which fake tensors do not check). Rotary or relative positions (Llama, T5) have no
    such table, and no limit here."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    tables = (m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return limit if any(t.num_embeddings == limit for t in tables) else None


def _check_position_table(subject: Subject, limit: int | None) -> None:
    """An example longer than the model's learned position table is refused before any run:
    a real step would index past the table (fake tensors do not check the index), and the
    estimate would be for a step that cannot run. The same limit ``estimate(seq_len=...)``
    enforces."""
    length = subject.seq_len
    if limit is None or length is None or length <= limit:
        return
    name, dim = next(iter(subject.seq_axes.items()))
    raise ValueError(
        f"the inputs' sequence length {length:,} ({name}, dim {dim}) is beyond the model's "
        f"{limit:,} learned positions (config.max_position_embeddings; GPT-2's n_positions): "
        f"a real step would index past its position table. Give inputs of at most {limit:,} "
        "tokens (estimate(seq_len=...) then varies the length up to the limit)"
    )


# Config fields of a length at which attention changes form: Mistral's and Qwen2's sliding
# window, Llama 4's chunked attention (transformers' configs). Hugging Face materializes the
# mask once the key length reaches it (masking_utils._ignore_causal_mask_sdpa: "if
# local_attention_size is not None and kv_length >= local_attention_size: return False").
_WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")


def attention_window(model: torch.nn.Module) -> int | None:
    """The smallest length at which the model's attention changes form, if it has one."""
    config = getattr(model, "config", None)
    sizes = [getattr(config, name, None) for name in _WINDOW_FIELDS]
    windows = [v for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(windows, default=None)


def _check_devices(model: torch.nn.Module, inputs: ModelInputs) -> None:
    """The example inputs must be where the model's parameters and buffers are, as the user's
    real step needs them: a CPU model fed CUDA tensors (or ``cuda:1`` tensors to a ``cuda:0``
    model) would fail there, so say so now rather than profile a step that cannot run.

    The profile itself runs on fake CPU tensors of the same shapes, so the meta device (no
    data: shapes only) matches anything, a model spread over several devices (pipeline
    stages, CPU offload) is not checked, and 0-dim CPU tensors may go with any device, as in
    PyTorch's own ops (``TensorIteratorConfig::allow_cpu_scalars``, on for binary ops: "a
    scalar CPU argument, such as from ``cuda_tensor + 5``", aten/src/ATen/native/cuda/Loops.cuh)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1:
        return
    (model_device,) = devices
    if model_device.type == "meta":
        return
    named = [(f"inputs[{i}]", v) for i, v in enumerate(inputs.args)]
    named += [(f"inputs[{k!r}]", v) for k, v in inputs.kwargs.items()]
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.device == model_device:
            continue
        if t.device.type == "meta" or (t.dim() == 0 and t.device.type == "cpu"):
            continue
        raise ValueError(
            f"{name} is on device {str(t.device)!r}, but the model's parameters and buffers "
            f"are on {str(model_device)!r}: a real step would fail there. Move the inputs "
            f"with .to({str(model_device)!r}) (or the model to {str(t.device)!r})"
        )
