"""The chunked output and loss (``loss_chunks=k``) applied to a Hugging Face causal LM's step
the way torchtune's recipes apply it, on fake tensors (the profile) and on real ones
(``measure``).

torchtune (0.6.1) splits the decoder's normed last hidden states into k chunks along the
sequence and applies the output projection to each (``TransformerDecoder.chunked_output``:
``[self.output(chunk) for chunk in last_hidden_state.chunk(self.num_output_chunks, dim=1)]``,
torchtune/modules/transformer.py), then its recipe shifts the labels by one position,
appending its loss's ``ignore_index`` instead of slicing the logits
(``_loss_step``: ``labels = torch.hstack((labels[..., 1:], self.ignore_labels_cache[:
labels.shape[0]]))``, recipes/full_finetune_single_device.py), and computes
``CEWithChunkedOutputLoss`` over the list (torchtune/modules/loss/ce_chunked_output_loss.py):
the labels chunked the same way, each chunk's ``F.cross_entropy(logits.float(), labels,
ignore_index=-100, reduction="sum")`` added up, divided by ``(labels != ignore_index).sum()``,
so one chunk of logits is upcast to fp32 at a time. The recipe then drops the logits before
the backward (``del logits``): the Recipe's ``outputs="freed"``.

Applied here to a Hugging Face causal LM: its body (``model.base_model``, which ends with the
final norm) on the inputs less ``labels``, its output projection
(``model.get_output_embeddings()``, the same module and so the same tied weight) on each
chunk, the labels shifted as torchtune's recipe shifts them (Hugging Face's own
``ForCausalLMLoss`` shifts them the same way: ``labels = nn.functional.pad(labels, (0, 1),
value=ignore_index); shift_labels = labels[..., 1:]``, transformers/loss/loss_utils.py), and
torchtune's own ``CEWithChunkedOutputLoss``. transformers (5.x) has no chunked loss of its
own: ``logits_to_keep`` keeps the last positions' logits for generation, which a training
loss cannot use. torchtune's recipe keeps its column of ignored labels for the whole run
(``ignore_labels_cache``, batch x 1 int64); here it is made in each step, 8 bytes a sample.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from .._estimating.chunked_loss import check_chunkable, check_loss_chunks
from .step import ModelInputs

__all__ = [
    "ChunkedOutput",
    "checked_loss_chunks",
    "chunked_loss_refusal",
    "chunked_step",
    "torchtune_chunked_loss",
]

# Where torchtune keeps the loss, relative to its package (0.6.1)
_LOSS_FILE = ("modules", "loss", "ce_chunked_output_loss.py")
# Hugging Face's label value that the loss ignores (ForCausalLMLoss's ignore_index=-100,
# transformers/loss/loss_utils.py; CEWithChunkedOutputLoss's default ignore_index=-100)
IGNORE_INDEX = -100
# keywords of a causal LM's forward that its body does not take: the loss's labels, and the
# positions whose logits to keep (the chunks are the whole sequence's)
_HEAD_ONLY = ("labels", "logits_to_keep")


def _loss_file() -> pathlib.Path | None:
    """torchtune's ``ce_chunked_output_loss.py``, found without importing torchtune (None
    where torchtune is not installed). ``find_spec`` of a top-level package does not run its
    ``__init__``."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))).joinpath(*_LOSS_FILE)
    return path if path.is_file() else None


@functools.cache
def torchtune_chunked_loss() -> type[torch.nn.Module]:
    """torchtune's ``CEWithChunkedOutputLoss`` class, loaded from its own file.

    The file alone is loaded (``importlib.util.spec_from_file_location``), not the
    ``torchtune`` package: torchtune 0.6.1's ``__init__`` imports a torchao module that
    newer torchao releases moved, so ``import torchtune`` fails beside them; the loss's file
    imports only torch.

    Examples
    --------
    >>> torchtune_chunked_loss().__name__  # doctest: +SKIP
    'CEWithChunkedOutputLoss'
    """
    path = _loss_file()
    if path is None:
        raise ImportError(
            "loss_chunks is applied by torchtune's own CEWithChunkedOutputLoss, and torchtune "
            "is not installed: pip install torchtune"
        )
    spec = importlib.util.spec_from_file_location("_vram_widget_torchtune_chunked_loss", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss: type[torch.nn.Module] = module.CEWithChunkedOutputLoss
    return loss


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside PEFT's wrapper (``PeftModel.get_base_model``), else
    ``model``."""
    get_base = getattr(model, "get_base_model", None)
    inner = get_base() if callable(get_base) else None
    return inner if isinstance(inner, torch.nn.Module) else model


def _causal_lm_names() -> frozenset[str]:
    """The class names of transformers' causal LMs (``AutoModelForCausalLM``'s mapping)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return frozenset()
    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def chunked_loss_refusal(
    model: torch.nn.Module, inputs: ModelInputs | None, loss_fn: Callable[[Any], Any] | None
) -> str:
    """Why ``loss_chunks`` cannot be applied to this model, inputs and loss ("" where it
    can): it needs a Hugging Face causal LM whose output projection is a ``Linear``, labels
    among the example inputs, no ``loss_fn`` (the chunked loss replaces the model's), and
    torchtune installed.

    Examples
    --------
    >>> print(chunked_loss_refusal(torch.nn.Linear(2, 2), None, None))
    Linear is not a Hugging Face causal LM (one of AutoModelForCausalLM's classes)
    """
    inner = _unwrapped(model)
    name = type(inner).__name__
    if name not in _causal_lm_names():
        return f"{name} is not a Hugging Face causal LM (one of AutoModelForCausalLM's classes)"
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear):
        return f"{name}'s output projection (get_output_embeddings()) is not a Linear"
    if getattr(inner, "base_model", inner) is inner:
        return f"{name} has no body apart from its output projection (base_model)"
    if loss_fn is not None:
        return "a loss_fn of your own is given, and the chunked loss replaces the model's loss"
    if inputs is None or not isinstance(inputs.kwargs.get("labels"), torch.Tensor):
        return (
            "the example inputs hold no labels for the cross-entropy (give inputs="
            "{'input_ids': ids, 'labels': ids}, as for the model's own loss)"
        )
    if _loss_file() is None:
        return "torchtune, whose CEWithChunkedOutputLoss applies it, is not installed"
    return ""


def checked_loss_chunks(
    model: torch.nn.Module,
    inputs: ModelInputs,
    loss_fn: Callable[[Any], Any] | None,
    loss_chunks: object,
) -> int | None:
    """``loss_chunks`` checked against the model, its inputs (the labels' length) and the
    loss as ``ModelProfile.estimate`` checks them (a ValueError / TypeError naming the
    problem and the valid forms), before a real step runs.

    Examples
    --------
    >>> checked_loss_chunks(torch.nn.Linear(2, 2), ModelInputs((), {}), None, None) is None
    True
    """
    labels = inputs.kwargs.get("labels")
    length = labels.shape[1] if isinstance(labels, torch.Tensor) and labels.dim() > 1 else None
    chunks = check_loss_chunks(loss_chunks, length)
    if chunks is not None:
        check_chunkable(chunks, chunked_loss_refusal(model, inputs, loss_fn))
    return chunks


@dataclasses.dataclass
class ChunkedOutput:
    """What the chunked forward returns: the logits, one tensor per chunk of the sequence,
    and the labels the loss takes (as the example gave them, unshifted)."""

    logits: list[torch.Tensor]
    labels: torch.Tensor


def _body_arguments(model: torch.nn.Module, inputs: ModelInputs) -> dict[str, Any]:
    """The inputs as the keyword arguments of the causal LM's forward, less those its body
    does not take (``labels``, ``logits_to_keep``)."""
    signature = inspect.signature(model.forward)
    bound = signature.bind(*inputs.args, **inputs.kwargs)
    named: dict[str, Any] = {}
    for key, value in bound.arguments.items():
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[key] = value
    return {k: v for k, v in named.items() if k not in _HEAD_ONLY}


def chunked_step(
    model: torch.nn.Module, loss_chunks: int
) -> tuple[Callable[..., ChunkedOutput], Callable[[ChunkedOutput], torch.Tensor]]:
    """The forward and the loss of ``model``'s step with its output and loss in
    ``loss_chunks`` chunks (module docstring), for ``training_iteration``.

    The forward takes the causal LM's own inputs (labels included); the loss is torchtune's
    ``CEWithChunkedOutputLoss(num_output_chunks=loss_chunks)`` on the labels shifted as
    torchtune's recipe shifts them. ``model`` is used as it is (its modules run, nothing
    is changed); check it with :func:`chunked_loss_refusal` first.
    """
    inner = _unwrapped(model)
    body: torch.nn.Module = getattr(inner, "base_model")  # noqa: B009 (a Module attribute)
    head: torch.nn.Module = getattr(inner, "get_output_embeddings")()  # noqa: B009
    loss_module = torchtune_chunked_loss()(num_output_chunks=loss_chunks, ignore_index=IGNORE_INDEX)

    def forward(*args: Any, **kwargs: Any) -> ChunkedOutput:
        inputs = ModelInputs(args, kwargs)
        out = body(**_body_arguments(inner, inputs))
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        del out
        # torchtune's TransformerDecoder.chunked_output
        logits = [head(chunk) for chunk in hidden.chunk(loss_chunks, dim=1)]
        return ChunkedOutput(logits, kwargs["labels"])

    def loss(output: ChunkedOutput) -> torch.Tensor:
        labels = output.labels
        # torchtune's _loss_step: the next token's label, the last position ignored
        ignored = torch.full(
            (labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device
        )
        shifted = torch.hstack((labels[..., 1:], ignored))
        del ignored
        result: torch.Tensor = loss_module(output.logits, shifted)
        return result

    return forward, loss
