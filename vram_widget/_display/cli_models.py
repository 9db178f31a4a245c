"""How the command line's model is named, built and fed (``vram-widget MODEL``).

A zoo name, a ``package.module:callable``, a Hugging Face model type built from a config on
the meta device, or a Hub id or local directory whose config.json is built the same way
(``--hf``, :mod:`vram_widget._profiling.hub`); each kind has its default example inputs.
Every problem found here is a usage error (``parser.error``): it happens before any
profiling.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from .._profiling.hub import DEFAULT_SEQ_LEN, build_from_config, check_model_name, token_inputs

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "DEFAULT_SEQ_LEN",
    "ModelSpec",
    "build_model",
    "config_pairs",
    "hub_name",
    "model_spec",
    "resolve_model",
    "transformers_type",
]

DEFAULT_MODEL = "resnet18"
CALLABLE_FORM = "package.module:callable (a function that takes no arguments)"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model named on the command line, not yet built.

    Attributes
    ----------
    label
        How the user named it (zoo name, ``module:callable``, transformers type or Hub id).
    kind
        ``"zoo"``, ``"callable"``, ``"transformers"`` or ``"hub"``.
    build
        Returns the module (may raise: the caller turns that into a usage error).
    """

    label: str
    kind: str
    build: Callable[[], Any]


def _zoo_names() -> list[str]:
    from .. import zoo

    return list(zoo.ZOO)


def model_spec(value: str) -> ModelSpec:
    """Parse a model argument: a zoo name or ``package.module:callable``.

    Parameters
    ----------
    value
        The argument as typed.

    Returns
    -------
    ModelSpec

    Raises
    ------
    argparse.ArgumentTypeError
        Unknown zoo name, a module that cannot be imported (named in the message), or a
        missing or non-callable attribute; the message gives the valid forms.
    """
    if ":" not in value:
        from .. import zoo

        if value in zoo.ZOO:
            entry = zoo.ZOO[value]
            return ModelSpec(value, "zoo", entry.build)
        raise argparse.ArgumentTypeError(
            f"unknown model {value!r}: give a zoo name ({', '.join(zoo.ZOO)}) or {CALLABLE_FORM}"
        )
    module_name, _, attr = value.partition(":")
    if not module_name or not attr:
        raise argparse.ArgumentTypeError(f"bad model {value!r}: the form is {CALLABLE_FORM}")
    try:
        with _cwd_importable():
            module = importlib.import_module(module_name)
    except Exception as exc:  # any failure inside the user's module is theirs to see
        raise argparse.ArgumentTypeError(
            f"cannot import module {module_name!r} (from {value!r}): "
            f"{type(exc).__name__}: {exc}; the form is {CALLABLE_FORM}"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise argparse.ArgumentTypeError(
                f"module {module_name!r} has no attribute {attr!r} (from {value!r}); "
                f"the form is {CALLABLE_FORM}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a {type(target).__name__}, not callable; the form is {CALLABLE_FORM}"
        )
    return ModelSpec(value, "callable", target)


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    # ``python -m`` puts the current directory on sys.path but a console script does not, so
    # ``vram-widget mymodels:build`` would not find ./mymodels.py; add it for the import only,
    # leaving the caller's sys.path as it was (main() also runs in-process, e.g. in tests).
    cwd = os.getcwd()
    added = "" not in sys.path and cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise argparse.ArgumentTypeError(
            "--transformers needs the optional dependency transformers: pip install transformers"
        ) from None
    return transformers


def transformers_type(value: str) -> str:
    """Validate a Hugging Face model type (``gpt2``, ``llama``, ``bert``, ...).

    Raises
    ------
    argparse.ArgumentTypeError
        When transformers is not installed, or the type is not one of its model types (the
        message suggests close matches).
    """
    names = list(_transformers().CONFIG_MAPPING.keys())
    if value in names:
        return value
    close = difflib.get_close_matches(value, names, n=5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown transformers model type {value!r}: give a model type of "
        f"transformers.AutoConfig.for_model, e.g. gpt2, llama, bert, t5 "
        f"({len(names)} in all){hint}"
    )


def hub_name(value: str) -> str:
    """Validate ``--hf``: a directory holding a config.json, or a Hub id in its valid form
    (checked here, before any network call).

    Raises
    ------
    argparse.ArgumentTypeError
        Naming the valid forms.
    """
    try:
        check_model_name(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _config_value(text: str) -> Any:
    """int, float, bool (``true``/``false``) or str, in that order of preference."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def config_pairs(value: str) -> dict[str, Any]:
    """Parse ``--config k=v,k=v`` into a dict of int, float, bool or str values.

    Examples
    --------
    >>> config_pairs("n_layer=2,scale_attn_weights=false,layer_norm_epsilon=1e-5")
    {'n_layer': 2, 'scale_attn_weights': False, 'layer_norm_epsilon': 1e-05}
    """
    pairs: dict[str, Any] = {}
    for item in value.split(","):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise argparse.ArgumentTypeError(
                f"bad config pair {item!r} in {value!r}: the form is key=value,key=value "
                f"(e.g. n_layer=2,n_embd=64; values are int, float, true/false or str)"
            )
        pairs[key] = _config_value(text.strip())
    return pairs


def _config_keys(config_class: type) -> list[str]:
    """The keys a Hugging Face config class defines: its default instance's attributes, the
    aliases of its ``attribute_map`` (GPT-2's ``hidden_size`` for ``n_embd``) and its
    ``__init__``'s named parameters."""
    keys = set(vars(config_class()))
    keys |= set(getattr(config_class, "attribute_map", {}) or {})
    for name, param in inspect.signature(config_class).parameters.items():
        if name != "self" and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            keys.add(name)
    return sorted(k for k in keys if not k.startswith("_"))


def check_config_keys(model_type: str, config: dict[str, Any]) -> None:
    """Refuse a ``--config`` key that the model type's config class does not define.

    ``AutoConfig.for_model`` keeps an unknown keyword as a plain attribute that no layer
    reads, so ``gpt2 --config n_layers=2`` (GPT-2's key is ``n_layer``) would build the full
    12-layer model without a word.

    Raises
    ------
    argparse.ArgumentTypeError
        Naming the key, a close match where there is one, and the valid form.
    """
    config_class = _transformers().CONFIG_MAPPING[model_type]
    known = _config_keys(config_class)
    for key in config:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise argparse.ArgumentTypeError(
            f"--config key {key!r} is not a field of {config_class.__name__} ({model_type})"
            f"{hint} The form is key=value,key=value with the config's own field names"
        )


def _transformers_spec(model_type: str, config: dict[str, Any]) -> ModelSpec:
    def build() -> Any:
        hf_config = _transformers().AutoConfig.for_model(model_type, **config)
        # on the meta device: a causal-LM head where the type has one, else the bare model
        return build_from_config(hf_config)[0]

    label = model_type + "".join(f",{k}={v}" for k, v in config.items())
    return ModelSpec(label, "transformers", build)


def _hub_spec(name: str, trust_remote_code: bool) -> ModelSpec:
    def build() -> Any:
        from .._profiling.hub import hub_model

        # the example batch is made again at --seq-len by model_inputs
        return hub_model(name, trust_remote_code=trust_remote_code).model

    return ModelSpec(name, "hub", build)


def resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSpec:
    """The model the arguments name (MODEL, --model or --transformers with --config), not yet
    built; ``DEFAULT_MODEL`` where none is named (``args.model_assumed`` says so)."""
    if args.model is not None and args.model_option is not None:
        parser.error("give the model once: as MODEL or as --model, not both")
    spec: ModelSpec | None = args.model or args.model_option
    args.model_assumed = False
    if args.trust_remote_code and args.hf is None:
        parser.error("--trust-remote-code goes with --hf ID (a Hub model id or a directory)")
    if args.hf is not None:
        if spec is not None or args.transformers is not None:
            parser.error("give one model: MODEL/--model, --transformers TYPE or --hf ID")
        if args.config:
            parser.error(
                "--config is the config of --transformers TYPE; --hf ID reads its config.json"
            )
        if args.input_size is not None:
            parser.error(
                "--input-size does not go with --hf: the model is fed input_ids (and labels) "
                "of --seq-len tokens; give --seq-len N"
            )
        return _hub_spec(args.hf, args.trust_remote_code)
    if args.transformers is not None:
        if spec is not None:
            parser.error("give MODEL/--model or --transformers, not both")
        config: dict[str, Any] = {}
        for pairs in args.config or ():
            config.update(pairs)
        try:
            check_config_keys(args.transformers, config)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
        return _transformers_spec(args.transformers, config)
    if args.config:
        parser.error("--config is the config of --transformers TYPE; give --transformers too")
    if spec is None:
        args.model_assumed = True
        return model_spec(DEFAULT_MODEL)
    return spec


def build_model(parser: argparse.ArgumentParser, spec: ModelSpec) -> nn.Module:
    """Build the named model (on the meta device for --transformers); a failure is a usage
    error naming the argument."""
    from torch import nn

    from .._profiling.fake import quiet_third_party

    try:
        with quiet_third_party():  # what libraries log while the model is built
            model = spec.build()
    except Exception as exc:  # the user's code or config: report it as a bad argument
        if spec.kind == "hub":  # hub_model's errors say what to do already
            parser.error(f"--hf {spec.label}: {exc}")
        what = "--transformers/--config" if spec.kind == "transformers" else "MODEL"
        parser.error(f"{what}: building {spec.label!r} failed: {type(exc).__name__}: {exc}")
    if not isinstance(model, nn.Module):
        parser.error(
            f"MODEL: {spec.label!r} returned a {type(model).__name__}, not a torch.nn.Module; "
            f"the form is {CALLABLE_FORM} returning an nn.Module"
        )
    return model


def check_positions(parser: argparse.ArgumentParser, args: argparse.Namespace, model: Any) -> None:
    """Refuse, before profiling, a sequence longer than the model's position table, and a
    generation the model cannot run (the profile would refuse both, later)."""
    from .._profiling.generation import generation_limit
    from .._profiling.subject import position_limit

    length = args.seq_len
    if length is not None:
        limit = position_limit(model)
        if limit is not None and length > limit:
            parser.error(
                f"--seq-len {length} is beyond the model's {limit} learned positions "
                f"(config.max_position_embeddings): a real step would index past its position "
                f"table; give --seq-len N with N <= {limit}"
            )
    if args.new_tokens is None:
        return
    generates, limit, _cache = generation_limit(model)
    if not generates:
        parser.error(
            "--mode generate needs a model that generates with a cache of past keys and "
            "values (a Hugging Face model with generate(), e.g. --transformers gpt2); "
            "--mode inference is one forward"
        )
    prompt = effective_seq_len(args, model)
    if limit is not None and prompt is not None and prompt + args.new_tokens > limit:
        parser.error(
            f"a prompt of --seq-len {prompt} tokens plus --new-tokens {args.new_tokens} is "
            f"{prompt + args.new_tokens} positions, beyond the model's limit of {limit} "
            f"(config.max_position_embeddings): give --seq-len + --new-tokens <= {limit}"
        )


def effective_seq_len(args: argparse.Namespace, model: Any = None) -> int | None:
    """Tokens per sample: --seq-len, or DEFAULT_SEQ_LEN for a --transformers model, or for an
    --hf model the same bounded by its config's max_position_embeddings."""
    if args.seq_len is None and args.hf is not None:
        from .._profiling.hub import default_seq_len

        return default_seq_len(getattr(model, "config", None))
    if args.seq_len is None and args.transformers is not None:
        return DEFAULT_SEQ_LEN
    length: int | None = args.seq_len
    return length


def model_inputs(
    parser: argparse.ArgumentParser, args: argparse.Namespace, spec: ModelSpec, model: nn.Module
) -> dict[str, Any]:
    """Keyword arguments of profile_model: ``input_size=`` or ``inputs=``."""
    if args.input_size is not None:
        return {"input_size": args.input_size}
    if spec.kind == "zoo":
        from .. import zoo

        # Batch 2, not 1: the profile fits every allocation to a + b * batch and reads only
        # shapes, so the example's batch does not matter beyond having one.
        return {"inputs": zoo.ZOO[spec.label].make_inputs(2)}
    if spec.kind in ("transformers", "hub"):
        # labels make a language-model head compute its own loss, as in training; a bare
        # model or another head's loss is the mean of its first output. A generation is
        # prompted with the ids alone, as model.generate(input_ids) is.
        length = effective_seq_len(args, model) or DEFAULT_SEQ_LEN
        return {"inputs": token_inputs(model, length, labels=args.new_tokens is None)}
    _needs_input_size(parser, spec)


def _needs_input_size(parser: argparse.ArgumentParser, spec: ModelSpec) -> NoReturn:
    parser.error(
        f"--input-size is needed for {spec.label!r}: the shape of one sample without the "
        f"batch dimension, e.g. --input-size 3,224,224"
    )


def describe_inputs(inputs: dict[str, Any]) -> str:
    """One sample's shape as the profile will see it: ``3 x 64 x 64`` or ``input_ids: 128``.

    Examples
    --------
    >>> import torch
    >>> describe_inputs({"input_size": (784,)})
    '784'
    >>> describe_inputs({"inputs": {"input_ids": torch.zeros(1, 16, dtype=torch.long)}})
    'input_ids: 16 int64'
    """
    if "input_size" in inputs:
        return " x ".join(str(d) for d in inputs["input_size"])
    example = inputs["inputs"]
    if isinstance(example, dict):
        items = list(example.items())
    elif isinstance(example, tuple | list):
        items = [(f"input {i}", t) for i, t in enumerate(example)]
    else:
        items = [("", example)]
    parts = []
    for name, tensor in items:
        shape = " x ".join(str(d) for d in tensor.shape[1:]) or "scalar"
        kind = str(tensor.dtype).removeprefix("torch.")
        dtype = "" if tensor.dtype.is_floating_point else f" {kind}"
        parts.append(f"{name}: {shape}{dtype}" if name else f"{shape}{dtype}")
    return ", ".join(parts)
