"""What one step is: its batch, its sequence length, its precision and its mode; and the
settings of the device it runs on that change the answer without a new profile."""

from __future__ import annotations

import dataclasses

from ..options import Mode, Precision, StepOutputs, parse_batch_size, parse_option


@dataclasses.dataclass(frozen=True)
class Step:
    """The step being estimated.

    Attributes
    ----------
    batch_size : int
        Samples per step (per rank, per micro-batch), >= 1.
    seq_len : int, optional
        Tokens per sample where the model has a sequence axis; None: the example's length.
    precision : Precision
        ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"amp-bf16"`` or ``"amp-fp16"``.
    mode : Mode
        ``"train"``, ``"inference"`` or ``"generate"``.
    outputs : StepOutputs
        ``"kept"``: the model's outputs stay alive to the end of a training step (the
        output of ``output = model(x)`` is held through the backward, the optimizer step
        and ``zero_grad``); ``"freed"``: dropped once the loss is computed, before the
        backward, as Hugging Face's ``Trainer`` and torchtune's recipes do (with a large
        vocabulary the logits are gigabytes). A structural setting: profiled once more.
    loss_scaled : bool
        The backward runs on a new scalar, ``loss / grad_accumulation``, while the loss
        itself stays referenced through the backward, as Hugging Face's ``Trainer`` does
        through accelerate (``Accelerator.backward``: ``loss = loss /
        self.gradient_accumulation_steps; loss.backward()``): one more scalar. False: the
        backward runs on the loss. Profiled once more.
    carried_scalars : bool
        The training loop holds each micro-batch's loss until the next micro-batch's
        backward has run, and the gradient norm until the next step's clipping, so a step
        starts with the previous one's (Hugging Face ``Trainer``'s ``tr_loss_step`` and
        ``grad_norm`` loop variables): two scalars. False: the step's loss goes before the
        next forward and nothing outlives the step. Profiled once more.

    Examples
    --------
    >>> Step(batch_size=8, precision="bf16").precision
    <Precision.BF16: 'bf16'>
    >>> Step(outputs="freed").outputs
    <StepOutputs.FREED: 'freed'>
    """

    batch_size: int = 1
    seq_len: int | None = None
    precision: Precision = Precision.FP32
    mode: Mode = Mode.TRAIN
    outputs: StepOutputs = StepOutputs.KEPT
    loss_scaled: bool = False
    carried_scalars: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", parse_batch_size(self.batch_size))
        object.__setattr__(self, "precision", parse_option(Precision, self.precision, "precision"))
        object.__setattr__(self, "mode", parse_option(Mode, self.mode, "mode"))
        object.__setattr__(self, "outputs", parse_option(StepOutputs, self.outputs, "outputs"))
        for flag in ("loss_scaled", "carried_scalars"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """Settings of the target device that the estimate reads without profiling again.

    Attributes
    ----------
    compute_capability : (major, minor), optional
        The target GPU's (``torch.cuda.get_device_capability()``); it sizes the cuBLAS
        workspace and picks the CUDA context's row (``accelerator.cuda_context``). None:
        (9, 0), an H100.
    expandable_segments : bool
        The CUDA caching allocator's ``expandable_segments:True``.
    context_bytes : int, optional
        The CUDA context's device memory, given (``torch.cuda.mem_get_info`` before and
        after the first CUDA call measures it); None: the figure of
        ``accelerator.cuda_context``'s table for ``compute_capability`` and
        ``lazy_loading``.
    lazy_loading : bool
        ``CUDA_MODULE_LOADING=LAZY``, torch's default since 1.13 (pytorch/pytorch#86509);
        False: eager loading, whose context holds every kernel of the loaded libraries.

    Examples
    --------
    >>> Accelerator(compute_capability=(8, 0)).compute_capability
    (8, 0)
    """

    compute_capability: tuple[int, int] | None = None
    expandable_segments: bool = False
    context_bytes: int | None = None
    lazy_loading: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.compute_capability, list):
            object.__setattr__(self, "compute_capability", tuple(self.compute_capability))
