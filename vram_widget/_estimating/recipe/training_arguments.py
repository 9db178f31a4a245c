"""A Recipe from Hugging Face ``TrainingArguments`` (transformers 5.x; read from the source of
``transformers/training_args.py``, ``trainer.py`` and ``trainer_optimizer.py``).

What each setting means for the Trainer's step:

- ``per_device_train_batch_size`` and ``gradient_accumulation_steps``: the micro-batch and the
  micro-batches per optimizer step (``Trainer._inner_training_loop``).
- ``bf16`` / ``fp16``: ``TrainingArguments.__post_init__`` sets ``mixed_precision`` to
  ``"bf16"`` / ``"fp16"`` and the Trainer hands it to accelerate, which runs the forward under
  ``torch.autocast``; the weights stay in the dtype the model was loaded in (fp32 by default),
  so this is ``"amp-bf16"`` / ``"amp-fp16"``. A model loaded in bf16
  (``from_pretrained(..., dtype=torch.bfloat16)``) trains in bf16 whatever these flags say:
  the arguments cannot tell, so pass ``precision="bf16"`` then (``recipe.with_(...)``).
  ``bf16_full_eval`` / ``fp16_full_eval`` cast the model for evaluation only.
- ``optim``: ``Trainer.get_optimizer_cls_and_kwargs`` (``trainer_optimizer.py``,
  ``_OPTIMIZER_HANDLERS``). ``adamw_torch`` builds ``torch.optim.AdamW`` without ``foreach``
  or ``fused`` (torch's default implementation for the device); ``adamw_torch_fused`` adds
  ``fused=True``; ``sgd`` is ``torch.optim.SGD`` with momentum 0 unless ``optim_args`` gives
  one.
- ``activation_checkpointing`` (and its deprecated alias ``gradient_checkpointing``):
  ``model.activation_checkpointing_enable(kwargs)``, which defaults to
  ``{"use_reentrant": False}`` (``modeling_utils.PreTrainedModel
  ._activation_checkpointing_enable``): our ``checkpoint="auto"``.
- The step itself: ``Trainer.compute_loss`` returns the loss alone (``outputs =
  model(**inputs)`` is local to it) and ``training_step`` runs ``self.accelerator.backward(
  loss)`` on it, so the model's outputs (the logits) are freed before the backward:
  ``outputs="freed"``. ``training_step`` then calls ``self.accelerator.backward(loss)``,
  which runs ``loss = loss / self.gradient_accumulation_steps; loss.backward()``
  (accelerate 1.x, ``Accelerator.backward``; the Trainer gives accelerate ``num_steps=1``,
  ``Trainer.create_accelerator_and_postprocess``, and scales for accumulation itself): a new
  scalar for the backward while ``training_step`` holds the loss, ``loss_scaled=True``.
  The Trainer's own ``loss / self.current_gradient_accumulation_steps`` (where the model
  does not take ``num_items_in_batch``) replaces its ``loss``, so nothing more stays alive.
- ``max_grad_norm`` (default 1.0): ``_inner_training_loop`` calls ``self._clip_grad_norm(
  model)`` when it is > 0, and ``self._get_grad_norm(model)`` otherwise, which runs the same
  ``accelerator.clip_grad_norm_(model.parameters(), float("inf"))`` to read the norm
  (``Trainer._get_grad_norm``): one ``torch.nn.utils.clip_grad_norm_`` either way
  (accelerate 1.x, ``Accelerator._clip_grad_norm_dtensor_aware`` on plain tensors), its norm
  held as ``grad_norm`` through ``optimizer.step()`` and ``model.zero_grad()``:
  ``clip_grad_norm=max_grad_norm``, or ``inf`` (the same memory) where it is 0.
- The loop (``Trainer._run_epoch``) holds ``tr_loss_step``, the last micro-batch's loss
  (``training_step`` returns ``loss.detach()``), until the next ``training_step`` returns,
  and ``grad_norm`` until it is set to None before the next step's clipping:
  ``carried_scalars=True``.
- The optimizer's parameters: ``Trainer.create_optimizer`` builds two groups, the parameters
  weight decay applies to (``get_decay_parameter_names``: not norms nor biases), then the
  others: ``param_groups="decay-split"`` (``_profiling/param_groups.py``).
- ``fsdp`` / ``fsdp_config``: FSDP2 by default (``fsdp_config["version"]`` 2), with
  ``reshard_after_forward`` True (zero3) or False (zero2); the legacy strings
  ``"full_shard"`` / ``"shard_grad_op"`` / ``"hybrid_shard"`` (``_apply_legacy_fsdp_to_config``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .ignored import refuse, warn_ignored

if TYPE_CHECKING:
    from .recipe import Recipe

SOURCE = "TrainingArguments"

# transformers' OptimizerNames value -> our optimizer name (None: not an optimizer the
# estimate knows, refused by name). Names our registry lacks are still mapped here: the
# optimizer's own parse refuses them, naming what it accepts.
OPTIM_NAMES: dict[str, str | None] = {
    "adamw_torch": "adamw",  # torch.optim.AdamW, no foreach/fused given: torch's default
    "adamw_torch_fused": "adamw-fused",  # torch.optim.AdamW(fused=True)
    "adafactor": "adafactor",  # transformers.optimization.Adafactor(scale_parameter=False,
    # relative_step=False): transformers' own Adafactor, not torch.optim.Adafactor
    "sgd": "sgd",  # torch.optim.SGD; "sgd-momentum" where optim_args gives momentum > 0
    "adagrad": "adagrad",  # torch.optim.Adagrad
    "rmsprop": "rmsprop",  # torch.optim.RMSprop
    "adamw_bnb_8bit": "adamw8bit",  # bitsandbytes.optim.AdamW(optim_bits=8)
    "adamw_8bit": "adamw8bit",  # an alias of adamw_bnb_8bit
    "paged_adamw_8bit": "paged-adamw8bit",  # bitsandbytes.optim.AdamW(is_paged, 8 bits)
    "paged_adamw_32bit": "paged-adamw",
    "adamw_torch_8bit": "torchao-adamw8bit",  # torchao.optim.AdamW8bit
    "adamw_torch_4bit": "torchao-adamw4bit",  # torchao.optim.AdamW4bit
    "lion_8bit": "lion8bit",
    "lion_32bit": "lion",
    "paged_lion_8bit": "paged-lion8bit",
    "paged_lion_32bit": "paged-lion",
    "ademamix": "ademamix",
    "ademamix_8bit": "ademamix8bit",
    "paged_ademamix_8bit": "paged-ademamix8bit",
    "paged_ademamix_32bit": "paged-ademamix",
    "rmsprop_bnb": "rmsprop-bnb",
    "rmsprop_bnb_8bit": "rmsprop8bit",
    "rmsprop_bnb_32bit": "rmsprop-bnb",
    # not estimated: other devices, other libraries, or optimizers that rewrite the step
    "adamw_torch_xla": None,
    "adamw_torch_npu_fused": None,
    "adamw_anyprecision": None,
    "galore_adamw": None,
    "galore_adamw_8bit": None,
    "galore_adafactor": None,
    "galore_adamw_layerwise": None,
    "galore_adamw_8bit_layerwise": None,
    "galore_adafactor_layerwise": None,
    "lomo": None,
    "adalomo": None,
    "grokadamw": None,
    "schedule_free_radam": None,
    "schedule_free_adamw": None,
    "schedule_free_sgd": None,
    "apollo_adamw": None,
    "apollo_adamw_layerwise": None,
    "stable_adamw": None,
}

# Settings that do not change the device memory of a training step: the schedule and the
# optimizer's hyperparameters (numbers, not tensors), logging, saving, evaluation (a
# separate pass, not the training step), the data loader (host memory), the hub, seeds.
NO_MEMORY_EFFECT: frozenset[str] = frozenset({
    "output_dir", "overwrite_output_dir", "num_train_epochs", "max_steps", "learning_rate",
    "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "data_seed", "full_determinism",
    "logging_dir", "logging_strategy", "logging_steps", "logging_first_step",
    "logging_nan_inf_filter", "log_on_each_node", "log_level", "log_level_replica",
    "disable_tqdm", "report_to", "run_name", "project", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id", "include_num_input_tokens_seen", "skip_memory_metrics",
    "eval_strategy", "eval_steps", "eval_delay", "per_device_eval_batch_size",
    "prediction_loss_only", "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object",
    "include_for_metrics", "batch_eval_metrics", "eval_accumulation_steps", "bf16_full_eval",
    "fp16_full_eval", "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    "save_strategy", "save_steps", "save_on_each_node", "save_total_limit", "save_only_model",
    "save_safetensors", "enable_jit_checkpoint", "restore_callback_states_from_checkpoint",
    "resume_from_checkpoint", "ignore_data_skip", "push_to_hub", "hub_token", "hub_private_repo",
    "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision", "do_train", "do_eval",
    "do_predict", "local_rank", "debug", "dataloader_drop_last", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns",
    "label_names", "train_sampling_strategy", "length_column_name", "ddp_timeout",
    "ddp_backend", "average_tokens_across_devices", "use_cpu", "accelerator_config",
    "adam_beta3", "alpha",
})  # fmt: skip

# Read by the reader itself (below).
_MODELLED = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "optim",
    "optim_args", "activation_checkpointing", "activation_checkpointing_kwargs",
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "fsdp", "fsdp_config",
    "max_grad_norm",
})  # fmt: skip

# Refused: the step they make is another one than the estimate's.
_REFUSED: dict[str, str] = {
    "deepspeed": "DeepSpeed's ZeRO partitions and buffers are its own, not FSDP2's",
    "optim_target_modules": "GaLore / APOLLO project the gradients of these modules",
    "parallelism_config": "tensor and context parallelism split the layers themselves",
    "use_liger_kernel": "Liger's fused kernels replace the model's own ops",
}

# Ignored with a warning where set away from the default: (is it set?, what it changes).
_IGNORED: dict[str, tuple[Any, str]] = {
    "torch_compile": (bool, "torch.compile fuses the forward and changes what is saved"),
    "torch_compile_backend": (lambda v: v is not None, "torch.compile"),
    "torch_compile_mode": (lambda v: v is not None, "torch.compile"),
    "tf32": (lambda v: v is not None, "TF32 matmuls may pick other kernels and workspaces"),
    "label_smoothing_factor": (
        lambda v: bool(v),
        "the Trainer's LabelSmoother takes a log-softmax of the logits outside the model",
    ),
    "neftune_noise_alpha": (lambda v: v is not None, "NEFTune's noise on the embeddings"),
    "torch_empty_cache_steps": (
        lambda v: v is not None,
        "empty_cache changes what the allocator reserves, not what is allocated",
    ),
    "auto_find_batch_size": (bool, "the Trainer halves the batch size after an OOM"),
    "use_cache": (bool, "a KV cache built in the training forward"),
    "ddp_bucket_cap_mb": (lambda v: v is not None, "DDP's gradient buckets of another size"),
    "ddp_find_unused_parameters": (lambda v: v is not None, "DDP's unused-parameter search"),
    "ddp_broadcast_buffers": (lambda v: v is not None, "DDP's buffer broadcast"),
    "ddp_static_graph": (lambda v: v is not None, "DDP's static graph"),
    "liger_kernel_config": (lambda v: v is not None, "Liger kernels"),
}


def read_training_arguments(args: object, gpus: int = 1, model: object = None) -> Recipe:
    """See :meth:`Recipe.from_training_arguments`."""
    from .recipe import Recipe

    values = _as_dict(args)
    ignored: list[str] = []
    for key, value in values.items():
        if key in _REFUSED and value:
            raise refuse(SOURCE, f"{key}={value!r}", _REFUSED[key])
        if key in _IGNORED:
            is_set, what = _IGNORED[key]
            if is_set(value):
                ignored.append(f"{key}={value!r} ({what})")
        elif key not in NO_MEMORY_EFFECT and key not in _MODELLED and key not in _REFUSED:
            ignored.append(f"{key}={value!r} (unknown to this reader)")
    settings: dict[str, Any] = {
        "batch_size": int(values.get("per_device_train_batch_size", 8)),
        "grad_accumulation": int(values.get("gradient_accumulation_steps", 1)),
        "precision": _precision(values, ignored),
        # transformers 5.x: the default optim is adamw_torch_fused (training_args.py)
        "optimizer": _optimizer(values.get("optim", "adamw_torch_fused"), values.get("optim_args")),
        "checkpoint": _checkpoint(values),
        "outputs": "freed",  # compute_loss returns the loss alone (module docstring)
        "loss_scaled": True,  # accelerate's backward divides the loss (module docstring)
        "carried_scalars": True,  # tr_loss_step and grad_norm (module docstring)
        "clip_grad_norm": _clip(values.get("max_grad_norm", 1.0)),
        "param_groups": "decay-split",  # Trainer.create_optimizer (module docstring)
    }
    settings.update(_fsdp(values.get("fsdp"), values.get("fsdp_config"), gpus, ignored))
    if model is not None:
        settings.update(read_model(model, settings["precision"], ignored))
    if gpus > 1:
        # the loop's own settings are estimated on one device only (a rank's step with them
        # is refused): across ranks, the step is the plain loop's, and they are named here
        loop = [k for k in _LOOP_SETTINGS if settings.pop(k, None) is not None]
        ignored.append(
            f"the Trainer's loop ({', '.join(loop)}) across {gpus} GPUs: each rank's step is "
            "estimated as a plain loop's (outputs kept through the backward, no clipping)"
        )
    warn_ignored(SOURCE, ignored)  # before the optimizer's name is parsed, which may refuse it
    return Recipe(ignored=tuple(ignored)).with_(**settings)


# the Trainer's loop as its settings (see the module docstring), estimated on one device
_LOOP_SETTINGS = ("outputs", "loss_scaled", "carried_scalars", "clip_grad_norm", "param_groups")


def _as_dict(args: object) -> dict[str, Any]:
    """``TrainingArguments`` (its ``to_dict()``), a dict, a JSON string or a JSON file."""
    if isinstance(args, Mapping):
        return dict(args)
    to_dict = getattr(args, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    if isinstance(args, os.PathLike) or (
        isinstance(args, str) and not args.lstrip().startswith("{")
    ):
        with open(args, encoding="utf-8") as f:
            return dict(json.load(f))
    if isinstance(args, str):
        return dict(json.loads(args))
    raise TypeError(
        "training arguments must be a transformers.TrainingArguments, a dict, the JSON "
        f"string args.to_json_string() writes or a path to such a file; got {type(args).__name__}"
    )


def _precision(values: Mapping[str, Any], ignored: list[str]) -> str:
    if values.get("bf16") and values.get("fp16"):
        raise ValueError(f"{SOURCE}: bf16 and fp16 are both set; the Trainer refuses that too")
    if values.get("bf16"):
        return "amp-bf16"
    if values.get("fp16"):
        ignored.append("fp16=True (the GradScaler's scale and found-inf scalars, and its unscale)")
        return "amp-fp16"
    return "fp32"


def _optimizer(optim: object, optim_args: object) -> str:
    key = str(getattr(optim, "value", optim))
    if key not in OPTIM_NAMES:
        valid = ", ".join(sorted(OPTIM_NAMES))
        raise ValueError(f"{SOURCE}: unknown optim {key!r}; transformers' names are {valid}")
    name = OPTIM_NAMES[key]
    if name is None:
        known = ", ".join(k for k, v in OPTIM_NAMES.items() if v is not None)
        raise refuse(SOURCE, f"optim={key!r}", f"the estimate's optimizers are read from {known}")
    extra = _optim_args(optim_args)
    if key == "sgd" and float(extra.pop("momentum", 0) or 0) > 0:
        name = "sgd-momentum"
    if key == "rmsprop" and (float(extra.get("momentum", 0) or 0) > 0 or extra.get("centered")):
        raise refuse(
            SOURCE, f"optim_args={optim_args!r}", "RMSprop with momentum or centered keeps "
            "more state than the plain RMSprop the estimate runs",
        )  # fmt: skip
    return name


def _clip(max_grad_norm: object) -> float:
    """The max norm the Trainer's ``clip_grad_norm_`` runs with: ``max_grad_norm`` where it
    is > 0, else ``inf`` (``Trainer._get_grad_norm`` reads the norm with it: the same
    memory, no clipping)."""
    value = float(max_grad_norm) if max_grad_norm is not None else 0.0  # type: ignore[arg-type]
    return value if value > 0 else float("inf")


def _optim_args(optim_args: object) -> dict[str, Any]:
    """``optim_args`` as the Trainer parses it: ``"momentum=0.9,nesterov=True"``."""
    if not optim_args:
        return {}
    pairs = (part.split("=", 1) for part in str(optim_args).replace(" ", "").split(","))
    return {k: (v.lower() in ("true", "1", "yes") if v.isalpha() else v) for k, v in pairs}


def _checkpoint(values: Mapping[str, Any]) -> str | None:
    on = values.get("activation_checkpointing") or values.get("gradient_checkpointing")
    if not on:
        return None
    kwargs = values.get("activation_checkpointing_kwargs")
    kwargs = kwargs or values.get("gradient_checkpointing_kwargs") or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if kwargs.get("use_reentrant", False):
        raise refuse(
            SOURCE, "activation_checkpointing_kwargs={'use_reentrant': True}",
            "the estimate checkpoints with torch.utils.checkpoint's non-reentrant variant, "
            "transformers' default; reentrant checkpointing saves other tensors",
        )  # fmt: skip
    if kwargs.get("offload") or int(kwargs.get("every_n_layers", 1)) != 1:
        raise refuse(SOURCE, f"activation_checkpointing_kwargs={kwargs!r}",
                     "offloaded or every-n-layers checkpointing")  # fmt: skip
    return "auto"


def _fsdp(fsdp: object, config: object, gpus: int, ignored: list[str]) -> dict[str, Any]:
    """The data-parallel settings: ``gpus`` ranks, and FSDP's strategy where it is on."""
    if not fsdp:
        return {"gpus": gpus}
    if gpus < 2:
        raise ValueError(
            f"{SOURCE}: fsdp={fsdp!r} shards over ranks, and the world size is not in the "
            "training arguments: pass gpus=N (N > 1), the ranks torchrun / accelerate starts"
        )
    if isinstance(config, str):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    conf: dict[str, Any] = dict(config) if isinstance(config, Mapping) else {}
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    if "offload" in items or conf.get("cpu_offload"):
        raise refuse(SOURCE, "FSDP cpu_offload", "parameters and gradients held on the host")
    version = int(conf.get("version", 2))
    if version != 2:
        ignored.append("fsdp_config version=1 (estimated as FSDP2: FSDP1's flat parameters differ)")
    strategy = "zero3"
    if "hybrid_shard" in items:
        strategy = "hsdp"
    elif "shard_grad_op" in items or str(conf.get("reshard_after_forward", True)).lower() in (
        "false",
        "shard_grad_op",
    ):
        strategy = "zero2"
    settings: dict[str, Any] = {"gpus": gpus, "strategy": strategy}
    if conf.get("activation_checkpointing"):
        settings["checkpoint"] = "auto"
    units = conf.get("transformer_layer_cls_to_wrap")
    if units:
        settings["fsdp_units"] = [units] if isinstance(units, str) else list(units)
    return settings


# The keywords of transformers' BitsAndBytesConfig (transformers/utils/quantization_config.py,
# BitsAndBytesConfig.__init__: load_in_8bit, load_in_4bit, llm_int8_threshold,
# llm_int8_skip_modules, llm_int8_enable_fp32_cpu_offload, llm_int8_has_fp16_weight,
# bnb_4bit_compute_dtype, bnb_4bit_quant_type, bnb_4bit_use_double_quant,
# bnb_4bit_quant_storage), as Weights.from_bnb_config reads them; quant_method names the
# library (QuantizationMethod.BITS_AND_BYTES = "bitsandbytes")
_BNB_METHOD = "bitsandbytes"
_HALF = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


def read_model(model: object, precision: str, ignored: list[str]) -> dict[str, Any]:
    """The settings the model handed to the Trainer gives: its weights' quantization
    (``model.config.quantization_config``, set by ``from_pretrained(...,
    quantization_config=BitsAndBytesConfig(...))``), its PEFT LoRA adapters
    (``model.peft_config``) and, where its weights are bf16 / fp16, that precision (the
    Trainer's autocast over half weights is a step in that half precision)."""
    settings: dict[str, Any] = {}
    config = getattr(model, "config", None)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        settings.update(_bnb_weights(quantization))
    settings.update(_peft_lora(model, ignored))
    half = _half_dtype(model)
    if half is not None:
        if precision.startswith("amp-") and precision != f"amp-{half}":
            ignored.append(f"{precision.removeprefix('amp-')}=True on a model whose weights "
                           f"are {half} (estimated in {half})")  # fmt: skip
        settings["precision"] = half
    return settings


def _bnb_weights(quantization: object) -> dict[str, Any]:
    from .weights import Weights

    get = (
        quantization.get
        if isinstance(quantization, Mapping)
        else lambda k, d=None: getattr(quantization, k, d)
    )
    method = get("quant_method", _BNB_METHOD)
    method = str(getattr(method, "value", method))
    if method != _BNB_METHOD:
        raise refuse(
            SOURCE, f"the model's quantization_config (quant_method={method!r})",
            "only bitsandbytes' weights (BitsAndBytesConfig: 4-bit nf4 / fp4, LLM.int8) are "
            "estimated",
        )  # fmt: skip
    if get("llm_int8_has_fp16_weight", False):
        raise refuse(
            SOURCE, "the model's llm_int8_has_fp16_weight=True",
            "LLM.int8 with fp16 master weights (Int8Params has_fp16_weights=True) keeps and "
            "trains the fp16 weights",
        )  # fmt: skip
    if get("llm_int8_enable_fp32_cpu_offload", False):
        raise refuse(SOURCE, "the model's llm_int8_enable_fp32_cpu_offload=True",
                     "modules offloaded to the host in fp32")  # fmt: skip
    weights = Weights.from_bnb_config(quantization)
    return {"weights": weights} if weights.quantized else {}


def _peft_lora(model: object, ignored: list[str]) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` of the active adapter (``r``, ``target_modules``)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return {}
    active = getattr(model, "active_adapter", None)
    config = configs.get(active) if isinstance(active, str) else None
    config = config if config is not None else next(iter(configs.values()))
    kind = str(getattr(getattr(config, "peft_type", ""), "value", ""))
    if kind != "LORA":
        raise refuse(SOURCE, f"the model's PEFT adapter ({kind})", "only LoRA is estimated")
    if getattr(config, "use_dora", False):
        raise refuse(SOURCE, "the model's LoraConfig use_dora=True",
                     "DoRA's magnitude vectors and norms")  # fmt: skip
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, set | frozenset | list | tuple):
        targets = sorted(targets)
    if float(getattr(config, "lora_dropout", 0) or 0) > 0:
        ignored.append(f"the model's lora_dropout={config.lora_dropout} (the adapters' "
                       "dropout masks)")  # fmt: skip
    return {"lora_rank": int(config.r), "lora_targets": targets or "auto"}


def _half_dtype(model: object) -> str | None:
    """bf16 / fp16 where most of the model's unquantized floating weights are in it."""
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    counts: dict[str, int] = {}
    for p in parameters():
        if type(p).__name__ in ("Params4bit", "Int8Params") or not p.is_floating_point():
            continue
        key = str(p.dtype)
        counts[key] = counts.get(key, 0) + int(p.numel())
    if not counts:
        return None
    return _HALF.get(max(counts, key=lambda k: counts[k]))
