"""The chunked output and loss lever (``loss_chunks=k``), as torchtune applies it: checked
against the profiled model before any run, and put in the :class:`Levers` that key its run.

No torch here. With ``loss_chunks=k`` the decoder body's last hidden states are split into k
chunks along the sequence (``Tensor.chunk(k, dim=1)``, torchtune's
``TransformerDecoder.chunked_output``), the output projection is applied to each chunk, and
torchtune's ``CEWithChunkedOutputLoss`` upcasts one chunk of logits to fp32 at a time while it
sums the cross-entropy over them (torchtune 0.6.1, ``modules/loss/ce_chunked_output_loss.py``).
The step is applied on the torch side by ``_profiling/chunked_loss.py``, on fake tensors for
the estimate and on real ones for ``measure``: one more profiling run per setting, cached.
"""

from __future__ import annotations

import dataclasses

from .levers import Levers
from .sharding import Parallel

__all__ = ["CHUNKING_UNKNOWN", "check_chunkable", "check_loss_chunks", "chunked_loss_levers"]

# What a profile that was not told how its model's output is projected says when asked to
# chunk it (a profile made by ``profile_model`` says whether the model can be chunked).
CHUNKING_UNKNOWN = "this profile does not record how its model's output is projected"

_VALID = (
    "loss_chunks takes None (the model's own output and loss) or an integer k >= 1 no "
    "larger than the sequence length (torchtune's num_output_chunks: 8 in its recipes)"
)


def check_loss_chunks(loss_chunks: object, seq_len: int | None = None) -> int | None:
    """``loss_chunks`` validated: None, or an int k with 1 <= k <= ``seq_len`` (a chunk per
    sequence position at most).

    Examples
    --------
    >>> check_loss_chunks(8, seq_len=128), check_loss_chunks(None)
    (8, None)
    >>> check_loss_chunks(0)
    Traceback (most recent call last):
    ...
    ValueError: loss_chunks=0: loss_chunks takes None (the model's own output and loss) or ...
    >>> check_loss_chunks(16, seq_len=8)
    Traceback (most recent call last):
    ...
    ValueError: loss_chunks=16 splits a sequence of 8 positions into more chunks than ...
    """
    if loss_chunks is None:
        return None
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int):
        raise TypeError(f"loss_chunks={loss_chunks!r} ({type(loss_chunks).__name__}): {_VALID}")
    if loss_chunks < 1:
        raise ValueError(f"loss_chunks={loss_chunks}: {_VALID}")
    if seq_len is not None and loss_chunks > seq_len:
        raise ValueError(
            f"loss_chunks={loss_chunks} splits a sequence of {seq_len} positions into more "
            f"chunks than it has positions: {_VALID}"
        )
    return loss_chunks


def check_chunkable(loss_chunks: int, refusal: str) -> None:
    """Raise a ValueError naming ``refusal`` (why the model cannot be chunked) and what can
    be, unless it is "".

    Examples
    --------
    >>> check_chunkable(4, "")
    >>> check_chunkable(4, "Linear is not a causal LM")
    Traceback (most recent call last):
    ...
    ValueError: loss_chunks=4 cannot be applied: Linear is not a causal LM; ...
    """
    if refusal:
        raise ValueError(
            f"loss_chunks={loss_chunks} cannot be applied: {refusal}; the chunked output and "
            "loss (torchtune's CEWithChunkedOutputLoss) applies to a Hugging Face causal LM "
            "(...ForCausalLM, GPT2LMHeadModel) with labels in its inputs and without a "
            "loss_fn; leave loss_chunks=None for the model's own loss"
        )


def chunked_loss_levers(
    levers: Levers,
    loss_chunks: object,
    refusal: str,
    seq_len: int | None,
    parallel: Parallel,
) -> Levers:
    """``levers`` with ``loss_chunks`` where the model can take it.

    ``refusal`` is why the profiled model cannot be chunked ("" where it can: a Hugging Face
    causal LM with an output projection, labels in its inputs and no ``loss_fn`` of the
    user's); ``seq_len`` the step's sequence length. Refused by name: a model that cannot
    be chunked, a bad k, and a data-parallel strategy (not estimated yet).

    Examples
    --------
    >>> from vram_widget._estimating.sharding import SINGLE_DEVICE
    >>> chunked_loss_levers(Levers(), 4, "", 64, SINGLE_DEVICE).loss_chunks
    4
    >>> chunked_loss_levers(Levers(), 4, "it is not a causal LM", 64, SINGLE_DEVICE)
    Traceback (most recent call last):
    ...
    ValueError: loss_chunks=4 cannot be applied: it is not a causal LM; ...
    """
    chunks = check_loss_chunks(loss_chunks, seq_len)
    if chunks is None:
        return levers
    check_chunkable(chunks, refusal)
    if parallel.distributed:
        raise ValueError(
            f"loss_chunks={chunks} with strategy={parallel.strategy.value!r} on "
            f"{parallel.gpus} GPUs: not estimated yet (it is on one GPU, gpus=1)"
        )
    return dataclasses.replace(levers, loss_chunks=chunks)
