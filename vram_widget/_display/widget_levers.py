"""The widget's memory levers as ``estimate`` takes them: the lever traits' checks, their
arguments, the levers a step runs with (how the optimizer steps, the chunked loss), and the
checkpoint / policy pair that moves together, and activation offloading (the
``offload_activations`` trait's "off", "torchtune" and "save_on_cpu", estimate's None,
"torchtune" and "save_on_cpu").

The checkpoint and its policy are two traits and one setting: a policy with checkpointing off
checkpoints the "auto" blocks (as ``estimate(checkpoint_policy=...)`` alone does) and the
checkpoint trait says so; checkpointing off turns the policy off
(:func:`~.widget_settings.paired_checkpoint`). A control's value a trait refuses keeps the
last state, and the headline says why (:meth:`LeversMixin._set_from_control`).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import traitlets

from .._estimating.chunked_loss import check_chunkable, check_loss_chunks, chunked_loss_levers
from .._estimating.compiled import compile_levers
from .._estimating.levers import Levers
from .._estimating.offloading import offload_levers
from .._estimating.options import Device, Mode
from .._estimating.recipe import Optimizer
from .._estimating.sharding import SINGLE_DEVICE, resolve_parallel
from .._estimating.stepping import stepping_levers
from .widget_settings import check_policy_value as _check_policy_value
from .widget_settings import checkpoint_arg as _checkpoint_arg
from .widget_settings import offload_arg
from .widget_settings import paired_checkpoint as _paired_checkpoint
from .widget_settings import policy_arg as _policy_arg
from .widget_settings import trainable_arg as _trainable_arg

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = [
    "CHECKPOINT_PAIR",
    "LEVER_TRAITS",
    "STEPPING_SETTINGS",
    "LeversMixin",
]

LEVER_TRAITS = ("checkpoint", "checkpoint_policy", "trainable", "grad_accumulation", "lora_rank")
"""The traits ``ModelProfile.levers`` takes (``_lever_settings``)."""
CHECKPOINT_PAIR = ("checkpoint", "checkpoint_policy")
"""The two traits that move together (:func:`~.widget_settings.paired_checkpoint`)."""
STEPPING_SETTINGS = ("optimizer_in_backward", "set_to_none")
"""How the optimizer steps (estimate's keywords, the widget's traits)."""


class LeversMixin:
    """The lever traits' checks and arguments of :class:`~.widget.MemoryWidget`."""

    @traitlets.validate(
        "checkpoint", "checkpoint_policy", "trainable", "grad_accumulation", "lora_rank"
    )
    def _valid_levers(self: MemoryWidget, proposal: dict[str, Any]) -> Any:
        value = proposal["value"]
        try:
            if proposal["trait"].name == "checkpoint_policy":
                _check_policy_value(value)
            self._profile.levers(**self._lever_settings(**{proposal["trait"].name: value}))
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None
        return value

    @traitlets.validate("loss_chunks")
    def _valid_loss_chunks(self: MemoryWidget, proposal: dict[str, Any]) -> int | None:
        value = proposal["value"]
        try:
            chunks = check_loss_chunks(value, self.seq_len or self._profile.seq_len)
            if chunks is not None:
                check_chunkable(chunks, self._profile.loss_chunks_refusal)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None
        return chunks

    @traitlets.validate("offload_activations")
    def _valid_offload(self: MemoryWidget, proposal: dict[str, Any]) -> str:
        """``offload_activations`` (in the trait's form: :class:`~.widget_settings.OffloadTrait`),
        refused on a profile of the CPU, whose saved tensors are in host memory already (a
        mode or a data parallelism it is refused with: the estimate says why)."""
        choice = str(proposal["value"])  # in its form already (OffloadTrait)
        try:
            if offload_arg(choice) is not None and self._profile.device is not Device.CUDA:
                offload_levers(Levers(), choice, Mode.TRAIN, self._profile.device, SINGLE_DEVICE)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None
        return choice

    def _lever_settings(self: MemoryWidget, **proposed: Any) -> dict[str, Any]:  # type: ignore[misc]
        """The lever traits (or ``proposed`` values for some) as ``estimate`` takes them;
        a proposed checkpoint or policy with its partner as the pair will move it."""
        raw = {name: proposed.get(name, getattr(self, name)) for name in LEVER_TRAITS}
        moved = next((n for n in CHECKPOINT_PAIR if n in proposed), None)
        checkpoint, policy = _paired_checkpoint(raw["checkpoint"], raw["checkpoint_policy"], moved)
        if _checkpoint_arg(raw["checkpoint"]) is None:
            checkpoint = raw["checkpoint"]  # a policy alone means "auto": estimate says so
        return {
            "checkpoint": _checkpoint_arg(checkpoint),
            "checkpoint_policy": _policy_arg(policy),
            "trainable": _trainable_arg(raw["trainable"]),
            "grad_accumulation": raw["grad_accumulation"],
            "lora_rank": raw["lora_rank"] or None,
        }

    def _stepping_settings(self: MemoryWidget) -> dict[str, Any]:  # type: ignore[misc]
        """How the optimizer steps, as ``estimate`` takes it (only where not torch's
        default, so the other settings' searches see the keywords they always did)."""
        return {
            **({"optimizer_in_backward": True} if self.optimizer_in_backward else {}),
            **({"set_to_none": False} if not self.set_to_none else {}),
        }

    def _levers(self: MemoryWidget) -> Levers:  # type: ignore[misc]
        return self._profile.levers(**self._lever_settings())

    def _step_levers(self: MemoryWidget) -> Levers | None:  # type: ignore[misc]
        """The levers with activation offloading, how the optimizer steps (in the
        backward, gradients kept), the chunked loss and ``torch.compile``, as the estimate
        runs them; None for a combination the estimate refuses (it says why, before any
        profiling)."""
        levers = self._levers()
        offload = offload_arg(self.offload_activations)
        if offload is not None:  # refused on the CPU, in inference and across GPUs
            try:
                parallel = resolve_parallel(
                    self.gpus, self.strategy, gpus_per_node=self.gpus_per_node
                )
                levers = offload_levers(
                    levers, offload, Mode(self.mode), self._profile.device, parallel
                )
            except ValueError:
                return None
        if self.mode != Mode.TRAIN.value:
            return levers
        try:
            record = Optimizer.parse(self._settings()["optimizer"])
            record = Optimizer(
                record.name,
                record.implementation,
                in_backward=self.optimizer_in_backward,
                set_to_none=self.set_to_none,
            )
            parallel = resolve_parallel(self.gpus, self.strategy, gpus_per_node=self.gpus_per_node)
            levers = stepping_levers(
                levers, record, record.resolved_implementation(self._profile.device), parallel
            )
            levers = chunked_loss_levers(
                levers,
                self.loss_chunks,
                self._profile.loss_chunks_refusal,
                self.seq_len or self._profile.seq_len,
                parallel,
            )
            compiled = self._compile_settings()
            return compile_levers(
                levers,
                compiled.get("compile"),
                compiled.get("activation_memory_budget"),
                Mode.TRAIN,
                parallel,
            )
        except ValueError:
            return None

    def _pair_checkpoint(self: MemoryWidget, moved: str | None) -> tuple[str, Any] | None:  # type: ignore[misc]
        """Move the checkpoint / policy pair's partner after ``moved`` (None: at the start):
        a policy with checkpointing off checkpoints the "auto" blocks, checkpointing off
        turns the policy off. Returns the partner's name and old value where it moved."""
        if moved is not None and moved not in CHECKPOINT_PAIR:
            return None
        checkpoint, policy = _paired_checkpoint(self.checkpoint, self.checkpoint_policy, moved)
        for name, value in (("checkpoint", checkpoint), ("checkpoint_policy", policy)):
            old = getattr(self, name)
            if value != old:
                self._pairing = True
                try:
                    setattr(self, name, value)
                finally:
                    self._pairing = False
                return name, old
        return None

    def _set_from_control(self: MemoryWidget, name: str, value: Any) -> None:  # type: ignore[misc]
        """A control's value for ``name``: a value the trait refuses keeps the last state,
        and the status and headline say why (the controls show the kept value)."""
        if self._syncing:
            return
        try:
            setattr(self, name, value)
        except traitlets.TraitError as exc:
            why = f"{name} = {value!r} refused: {exc}; kept {name} = {getattr(self, name)!r}"
            self._error = why
            self._status.value = f"<span style='color:#b00'>{html.escape(why)}</span>"
            self._sync_controls()
            self._render_headline(at_rest=self._at_rest_pending is None)
