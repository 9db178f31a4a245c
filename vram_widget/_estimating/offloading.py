"""Activation offloading (``offload_activations``): the lever as asked, checked before any
run, and put in the :class:`Levers` that key its profiling run.

No torch here. Two forms, each applied on the torch side by ``_profiling/offloading.py``
around the model's forward (as torchtune's recipes apply theirs: ``with
self.activations_handling_ctx: logits = self._model(**batch)``, torchtune 0.6.1
``recipes/full_finetune_single_device.py``):

* ``"torchtune"`` (or ``True``): torchtune's ``OffloadActivations()`` with its defaults
  (``use_pin_memory=True``, ``use_streams=True``, ``max_fwd_stash_size=5``,
  ``min_offload_size=1024``; torchtune 0.6.1 ``training/_activation_offloading.py``): each
  tensor autograd saves in the forward that is at least 1024 bytes and is no
  ``nn.Parameter`` or ``nn.Buffer`` is copied to pinned host memory and brought back in the
  backward; the output projection runs under its ``NoOpManager``
  (``get_act_offloading_ctx_manager``), so what it saves stays on the device.
* ``"save_on_cpu"``: ``torch.autograd.graph.save_on_cpu()`` (``pin_memory=False``, torch's
  default): every saved tensor, parameters included, copied to the host and back.

An estimate with offloading reports the device's peak as ever (``peak_bytes``) and the host
memory the offloaded copies take at their peak apart (``MemoryEstimate.host_bytes``).
Offloading moves tensors from an accelerator to the host: a ``device="cpu"`` profile (whose
tensors are on the host already) and a step that saves nothing for backward
(``mode="inference"`` or ``"generate"``) are refused by name.
"""

from __future__ import annotations

import dataclasses
import enum

from .levers import Levers
from .options import Device, Mode
from .sharding import Parallel

__all__ = ["Offload", "offload_levers", "resolve_offload"]


class Offload(enum.StrEnum):
    """How saved activations are offloaded to host memory."""

    TORCHTUNE = "torchtune"  # torchtune's OffloadActivations, NoOpManager on the output
    SAVE_ON_CPU = "save_on_cpu"  # torch.autograd.graph.save_on_cpu()


_FORMS = (
    "offload_activations takes None or False (off), True or 'torchtune' (torchtune's "
    "OffloadActivations with its defaults, the output projection kept on the device), or "
    "'save_on_cpu' (torch.autograd.graph.save_on_cpu: every saved tensor)"
)


def resolve_offload(value: object) -> Offload | None:
    """``offload_activations`` in its canonical form (None: off), or a ValueError /
    TypeError naming the valid forms.

    Examples
    --------
    >>> resolve_offload(True), resolve_offload("save_on_cpu"), resolve_offload(False)
    (<Offload.TORCHTUNE: 'torchtune'>, <Offload.SAVE_ON_CPU: 'save_on_cpu'>, None)
    >>> resolve_offload("nvme")
    Traceback (most recent call last):
    ...
    ValueError: offload_activations='nvme': offload_activations takes None or False (off), ...
    """
    if value is None or value is False:
        return None
    if value is True:
        return Offload.TORCHTUNE
    if not isinstance(value, str):
        raise TypeError(f"offload_activations={value!r} ({type(value).__name__}): {_FORMS}")
    try:
        return Offload(value)
    except ValueError:
        raise ValueError(f"offload_activations={value!r}: {_FORMS}") from None


def offload_levers(
    levers: Levers, value: object, mode: Mode, device: Device, parallel: Parallel
) -> Levers:
    """``levers`` with ``offload_activations`` applied, or a ValueError naming why it is
    not: a profile of the CPU (nothing to offload to: its tensors are in host memory
    already), a mode without a backward (nothing saved), or data parallelism (not estimated
    yet).

    Examples
    --------
    >>> from vram_widget._estimating.sharding import SINGLE_DEVICE
    >>> offload_levers(Levers(), True, Mode.TRAIN, Device.CUDA, SINGLE_DEVICE).describe()
    "saved activations offloaded to the host (torchtune's OffloadActivations)"
    >>> offload_levers(Levers(), True, Mode.INFERENCE, Device.CUDA, SINGLE_DEVICE)
    Traceback (most recent call last):
    ...
    ValueError: offload_activations='torchtune' with mode='inference': ...
    """
    offload = resolve_offload(value)
    if offload is None:
        return levers
    if mode is not Mode.TRAIN:
        raise ValueError(
            f"offload_activations={offload.value!r} with mode={mode.value!r}: offloading "
            "moves the tensors autograd saves for the backward, and a step without a "
            "backward saves none; use mode='train', or leave offload_activations=None"
        )
    if device is not Device.CUDA:
        raise ValueError(
            f"offload_activations={offload.value!r} on a device={device.value!r} profile: "
            "offloading copies saved activations from the accelerator to host memory, and "
            "on the CPU they are in host memory already (save_on_cpu's .to('cpu') of a CPU "
            "tensor is the tensor itself); profile with device='cuda'"
        )
    if parallel.distributed:
        raise ValueError(
            f"offload_activations={offload.value!r} with strategy="
            f"{parallel.strategy.value!r} on {parallel.gpus} GPUs: not estimated yet (it "
            "is on one GPU, gpus=1)"
        )
    return dataclasses.replace(levers, offload_activations=offload.value)
