"""Models named by a string: a Hugging Face Hub id (``"org/name"``) or a local directory that
holds a ``config.json``.

Only the config is read: ``transformers.AutoConfig.from_pretrained`` resolves one file,
``config.json`` (``CONFIG_NAME``), through ``transformers.utils.hub.cached_file``, which calls
``huggingface_hub.hf_hub_download`` for that single file (transformers 5,
``configuration_utils.PreTrainedConfig._get_config_dict``); no weights are downloaded. The
model is then built from the config on the meta device (shapes only, so a 70B model builds
in a second), in float32: the estimate's ``precision`` decides the dtypes the step runs in,
not the config's ``dtype``.

Which class is built:

* ``config.architectures[0]`` where transformers has a class of that name (the task the
  checkpoint was saved for: ``LlamaForCausalLM``, ``BertForMaskedLM``, ...);
* else ``AutoModelForCausalLM.from_config``, and where the model type has no causal-LM head
  (an encoder), ``AutoModel.from_config`` -- as ``vram-widget --transformers TYPE`` builds;
* an architecture that is not in transformers but in the repository's own code
  (``config.auto_map``) only with ``trust_remote_code=True``.

Encoder-decoder models (``config.is_encoder_decoder``: T5, BART, Whisper) and models whose
forward takes no ``input_ids`` (vision, audio) are refused by name: their example inputs are
not one sequence of token ids. The example batch is ``input_ids`` of ``seq_len`` tokens, and
``labels`` (the same ids) where the class is a language-model head, so the model computes its
own loss as in training; any other head's loss is the mean of its first output.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # torch is imported on first use: the command line's parser needs none
    import torch

__all__ = [
    "DEFAULT_SEQ_LEN",
    "HubModel",
    "build_from_config",
    "check_model_name",
    "default_seq_len",
    "hub_model",
    "model_or_name",
    "token_inputs",
]

# Tokens per sample of a model named by string or built from a config, where none is asked
# (bounded by the config's max_position_embeddings). The sequence axis is found on these
# inputs, so estimate(seq_len=...) varies it afterwards.
DEFAULT_SEQ_LEN = 128

HUB_ID_FORM = (
    "a Hugging Face Hub model id ('org/name' or 'name': letters, digits, '-', '_', '.'; "
    "at most 96 characters each) or a local directory holding a config.json"
)

# Class-name endings of language-model heads that take ``labels`` of the input's shape (the
# mapping names of transformers' auto classes, for classes outside those mappings: remote code).
_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForPreTraining")


@dataclasses.dataclass(frozen=True)
class HubModel:
    """A model built from a named config, with its example batch.

    Attributes
    ----------
    model
        The module, on the meta device.
    inputs
        ``input_ids`` (and ``labels`` for a language-model head), batch 1.
    label
        The name as given and the class built, with where the class came from:
        ``"gpt2: GPT2LMHeadModel (config.architectures)"``.
    """

    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    label: str


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "a model named by string is built with the optional dependency transformers: "
            "pip install transformers"
        ) from None
    return transformers


def check_model_name(name: str) -> str:
    """Refuse, before any network call, a name that is neither a directory nor a Hub id.

    Returns
    -------
    str
        ``"directory"`` or ``"hub"``.

    Raises
    ------
    ValueError
        A directory without ``config.json``, or a string in no valid form.

    Examples
    --------
    >>> check_model_name("openai-community/gpt2")
    'hub'
    >>> check_model_name("no/such/place")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: model 'no/such/place' is neither an existing directory nor a Hub id: give ...
    """
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(
                f"directory {name!r} holds no config.json: give a directory a model was saved "
                "to (model.config.save_pretrained(path) writes it), or a Hub model id"
            )
        return "directory"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(
            f"model {name!r} is neither an existing directory nor a Hub id: give {HUB_ID_FORM}"
        ) from None
    return "hub"


def _hub_error(exc: BaseException) -> BaseException | None:
    """The huggingface_hub error behind a failed config load (transformers wraps it in an
    OSError ``from`` it), or None."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RepositoryNotFoundError | EntryNotFoundError | OfflineModeIsEnabled):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _config_missing_in_cache(name: str) -> bool:
    """Whether the Hub said this repository has no config.json (hf_hub_download records a
    missing file in its cache, ``_CACHED_NO_EXIST``); read locally, no network."""
    from huggingface_hub import _CACHED_NO_EXIST, try_to_load_from_cache

    try:
        return try_to_load_from_cache(name, "config.json") is _CACHED_NO_EXIST
    except Exception:  # a cache that cannot be read says nothing either way
        return False


def _load_error(name: str, exc: BaseException) -> Exception:
    """A clear error, saying what to do, for a config that could not be loaded."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
    )

    hub = _hub_error(exc)
    if isinstance(hub, GatedRepoError):
        return PermissionError(
            f"model {name!r} is gated: accept its licence on https://huggingface.co/{name}, then "
            "log in with `hf auth login` (or set HF_TOKEN to a token of that account)"
        )
    if isinstance(hub, LocalEntryNotFoundError | OfflineModeIsEnabled):
        return ConnectionError(
            f"cannot fetch the config.json of {name!r}: no network (or HF_HUB_OFFLINE=1) and it "
            "is not in the Hugging Face cache; connect once to cache it, or pass a local "
            "directory that holds it"
        )
    if isinstance(hub, EntryNotFoundError) or _config_missing_in_cache(name):
        return ValueError(
            f"{name!r} has no config.json: it is not a transformers model repository (a "
            "dataset, a Space, or weights in another format); give a model id or a directory "
            "holding a config.json"
        )
    if hub is not None:  # RepositoryNotFoundError (a private repository answers the same)
        return OSError(
            f"no model {name!r} on the Hugging Face Hub: check the id (as on its page, "
            "https://huggingface.co/org/name), log in with `hf auth login` if it is private, or "
            "pass a local directory holding a config.json"
        )
    text = str(exc)
    if "trust_remote_code" in text:
        return _remote_code_error(name, "its config class")
    if isinstance(exc, ValueError) and ("Unrecognized model" in text or "model type" in text):
        return ValueError(
            f"the config.json of {name!r} names no model type this transformers "
            f"({_transformers().__version__}) knows (its model_type is missing or unknown): "
            "upgrade transformers, or, where the repository ships its own code, pass "
            "trust_remote_code=True"
        )
    return OSError(f"cannot load the config.json of {name!r}: {type(exc).__name__}: {exc}")


def _remote_code_error(name: str, what: str) -> ValueError:
    return ValueError(
        f"{name!r} needs trust_remote_code=True (--trust-remote-code): {what} is not in "
        "transformers but in the repository's own Python files (config.auto_map), and "
        "trust_remote_code=True downloads and runs that code on this machine; read it first"
    )


def load_config(name: str, trust_remote_code: bool = False) -> Any:
    """``AutoConfig.from_pretrained(name)``: config.json only, errors made clear."""
    transformers = _transformers()
    check_model_name(name)
    from .fake import quiet_third_party

    try:
        with quiet_third_party():
            return transformers.AutoConfig.from_pretrained(
                name, trust_remote_code=trust_remote_code
            )
    except Exception as exc:  # every failure is turned into one that says what to do
        raise _load_error(name, exc) from None


def _lm_head(cls: type) -> bool:
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    ):
        for value in mapping.values():
            names.update((value,) if isinstance(value, str) else value)
    return cls.__name__ in names or cls.__name__.endswith(_LM_SUFFIXES)


def _remote_auto_class(config: Any) -> str | None:
    auto_map = getattr(config, "auto_map", None) or {}
    for auto in ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModel"):
        if auto in auto_map:
            return auto
    return None


def build_from_config(
    config: Any, name: str | None = None, trust_remote_code: bool = False
) -> tuple[torch.nn.Module, str]:
    """Build a transformers model from its config on the meta device.

    Parameters
    ----------
    config
        A ``PretrainedConfig``.
    name
        How the user named it (for messages), or None for a config built from a model type.
    trust_remote_code
        Whether an architecture of the repository's own code (``config.auto_map``) may be
        built (its code is downloaded and run).

    Returns
    -------
    (module, how)
        ``how`` names the class and where it came from:
        ``"GPT2LMHeadModel (config.architectures)"`` or ``"BertModel (AutoModel)"``.

    Raises
    ------
    ValueError
        An encoder-decoder model, a model that takes no ``input_ids``, or remote code
        without ``trust_remote_code=True``; each named.

    Examples
    --------
    >>> from transformers import GPT2Config
    >>> model, how = build_from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2))
    >>> how, model.device.type
    ('GPT2LMHeadModel (AutoModelForCausalLM)', 'meta')
    """
    import torch

    transformers = _transformers()
    label = str(name or getattr(config, "model_type", None) or "config")
    architectures = getattr(config, "architectures", None) or []
    arch = architectures[0] if architectures else None
    cls = getattr(transformers, arch, None) if arch else None
    remote = _remote_auto_class(config)
    if arch and cls is None and remote is not None and not trust_remote_code:
        raise _remote_code_error(label, f"its architecture {arch}")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{label!r} ({arch or config.model_type}) is an encoder-decoder model: a model named "
            "by a string or a model type is fed one sequence of token ids, which covers "
            "decoder-only and encoder-only models; build this one yourself and pass its "
            "inputs (input_ids, decoder_input_ids or labels) with inputs={...}"
        )
    # The meta device: shapes only; the profile runs on fake tensors and never needs weights.
    with torch.device("meta"):
        if cls is not None and isinstance(cls, type) and hasattr(cls, "_from_config"):
            # _from_config is what the Auto classes' from_config calls: it sets the attention
            # implementation as they do (transformers' modeling_utils.PreTrainedModel)
            model = cls._from_config(config, dtype=torch.float32)
            how = f"{cls.__name__} (config.architectures)"
        elif remote is not None and trust_remote_code:
            auto = getattr(transformers, remote)
            model = auto.from_config(config, trust_remote_code=True, dtype=torch.float32)
            how = f"{type(model).__name__} ({remote}, trust_remote_code)"
        else:
            try:
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                how = f"{type(model).__name__} (AutoModelForCausalLM)"
            except ValueError:
                # No causal-LM head for this type (an encoder): the bare model.
                model = transformers.AutoModel.from_config(config, dtype=torch.float32)
                how = f"{type(model).__name__} (AutoModel)"
    if "input_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{label!r} builds {type(model).__name__}, whose forward takes no input_ids (a "
            "vision or audio model): a model named by a string is fed token ids; build it "
            "yourself and pass inputs={...} or input_size=(...)"
        )
    return model, how


def default_seq_len(config: Any) -> int:
    """``DEFAULT_SEQ_LEN``, or the config's ``max_position_embeddings`` where that is less.

    Examples
    --------
    >>> from transformers import GPT2Config
    >>> default_seq_len(GPT2Config(n_positions=64)), default_seq_len(GPT2Config())
    (64, 128)
    """
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        return min(DEFAULT_SEQ_LEN, limit)
    return DEFAULT_SEQ_LEN


def token_inputs(
    model: torch.nn.Module, seq_len: int, labels: bool = True
) -> dict[str, torch.Tensor]:
    """An example batch of one sample: ``input_ids`` of ``seq_len`` tokens, and ``labels``
    (the same ids) where ``labels`` is asked and the model is a language-model head, so that
    the model computes its own loss as in training.

    Examples
    --------
    >>> from transformers import GPT2Config
    >>> model, _ = build_from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2))
    >>> sorted((k, tuple(v.shape)) for k, v in token_inputs(model, 16).items())
    [('input_ids', (1, 16)), ('labels', (1, 16))]
    """
    import torch

    ids = torch.zeros(1, seq_len, dtype=torch.long)
    takes_labels = "labels" in inspect.signature(model.forward).parameters
    if labels and takes_labels and _lm_head(type(model)):
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids}


def _check_seq_len(seq_len: Any) -> None:
    if seq_len is None:
        return
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a whole number of tokens >= 1; got {seq_len!r}")


def hub_model(name: str, seq_len: int | None = None, trust_remote_code: bool = False) -> HubModel:
    """Build the model a Hub id or a local directory names, with its example batch.

    Parameters
    ----------
    name
        ``"org/name"`` on the Hugging Face Hub (only its config.json is fetched), or a
        directory holding a config.json.
    seq_len
        Tokens per sample of the example batch (default: ``DEFAULT_SEQ_LEN``, or the
        config's ``max_position_embeddings`` where that is less).
    trust_remote_code
        Whether to build an architecture from the repository's own code.

    Returns
    -------
    HubModel

    Examples
    --------
    >>> import tempfile
    >>> from transformers import GPT2Config
    >>> folder = tempfile.mkdtemp()
    >>> config = GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"])
    >>> config.save_pretrained(folder)
    >>> built = hub_model(folder, seq_len=16)
    >>> built.label.endswith("GPT2LMHeadModel (config.architectures)"), sorted(built.inputs)
    (True, ['input_ids', 'labels'])
    """
    _check_seq_len(seq_len)
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be True or False; got {trust_remote_code!r}")
    config = load_config(name, trust_remote_code)
    from .fake import quiet_third_party

    with quiet_third_party():  # what transformers logs while the model is built
        model, how = build_from_config(config, name, trust_remote_code)
    length = default_seq_len(config) if seq_len is None else seq_len
    return HubModel(model, token_inputs(model, length), f"{name}: {how}")


def model_or_name(
    model: Any,
    input_size: Any,
    inputs: Any,
    seq_len: Any = None,
    trust_remote_code: Any = False,
) -> tuple[torch.nn.Module, Any, str]:
    """``profile_model``'s model: a module as given, or a string built by :func:`hub_model`.

    Returns
    -------
    (model, inputs, model_name)
        For a module, ``inputs`` as given and its class name; for a string, the built model,
        its token batch and ``HubModel.label``.

    Raises
    ------
    ValueError
        ``input_size`` or ``inputs`` with a string (its inputs are token ids of ``seq_len``),
        ``seq_len`` or ``trust_remote_code`` with a module; and what :func:`hub_model` raises.
    """
    if not isinstance(model, str | os.PathLike):
        if seq_len is not None or trust_remote_code:
            given = "seq_len" if seq_len is not None else "trust_remote_code"
            raise ValueError(
                f"{given}= is for a model named by a string (a Hub id or a directory); for a "
                "module, give inputs=<an example batch> of the length to profile"
            )
        # not checked here: profile_model's check_model says what a non-module is
        return cast("torch.nn.Module", model), inputs, type(model).__name__
    name = os.fspath(model)
    if input_size is not None or inputs is not None:
        given = "input_size" if input_size is not None else "inputs"
        raise ValueError(
            f"{given}= does not go with a model named by a string ({name!r}): it is fed "
            "input_ids (and labels) of seq_len tokens; give seq_len=N for another length, or "
            "build the model yourself and pass it with inputs={...}"
        )
    built = hub_model(name, seq_len=seq_len, trust_remote_code=trust_remote_code)
    return built.model, built.inputs, built.label
