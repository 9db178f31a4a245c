"""A Recipe from a torchtune recipe config (the YAML of ``tune run <recipe> --config ...``;
keys as in torchtune's ``recipes/configs/llama3_2/3B_full_single_device.yaml`` and
``3B_lora_single_device.yaml``).

- ``batch_size``, ``gradient_accumulation_steps``: the micro-batch and the accumulation.
- ``dtype``: torchtune trains in that dtype throughout, parameters included, with no autocast
  (``training.get_dtype`` and the recipes' ``model.to(dtype)`` / ``set_default_dtype``): bf16
  is our ``"bf16"``, fp32 ``"fp32"``.
- ``optimizer``: its ``_component_`` and keyword arguments (``fused`` / ``foreach``).
- ``optimizer_in_bwd``: each parameter stepped in its post-accumulate-grad hook
  (``optimizer_in_backward``).
- ``enable_activation_checkpointing``: each transformer layer checkpointed
  (``training.set_activation_checkpointing`` on ``TransformerSelfAttentionLayer``): our
  ``checkpoint="auto"``, each layer recomputed whole (``checkpoint_policy`` left as None,
  "full").
- ``enable_activation_offloading``: the saved activations moved to the host
  (``training.get_act_offloading_ctx_manager``): ``offload_activations=True`` where the
  Recipe has that setting, else listed as ignored.
- ``model``: a LoRA builder (``lora_llama3_2_3b`` ...) gives ``lora_rank`` and the targets;
  torchtune's module names map onto Hugging Face Llama's, which the estimate's PEFT copy
  uses: ``q_proj``, ``k_proj``, ``v_proj`` stay, ``output_proj`` -> ``o_proj``; the MLP's
  ``w1`` / ``w3`` / ``w2`` (``apply_lora_to_mlp``) -> ``gate_proj`` / ``up_proj`` /
  ``down_proj`` (torchtune's ``FeedForward``: ``w2(silu(w1(x)) * w3(x))``); the output
  projection (``apply_lora_to_output``) -> ``lm_head``. The adapters are in the base dtype
  (torchtune builds them with the model, under its dtype): ``lora_dtype="base"``. A QLoRA
  builder (``qlora_llama3_2_3b`` ..., ``partial(lora_..., quantize_base=True)``) or
  ``quantize_base: True`` stores the base weights as torchao's ``NF4Tensor``:
  ``weights="nf4-torchao"`` (torchtune's own ``LoRALinear`` / ``FrozenNF4Linear`` on the
  estimate's copy; the output projection unquantized, as torchtune leaves it).
- The step: the recipes drop the logits once the loss is computed, before the backward
  (``_loss_step``: ``# free logits otherwise it peaks backward memory`` / ``del logits``,
  ``recipes/full_finetune_single_device.py`` and ``lora_finetune_single_device.py``,
  torchtune 0.6.1): ``outputs="freed"``.
- ``loss``: ``torchtune.modules.loss.CEWithChunkedOutputLoss`` is the chunked output and loss,
  ``loss_chunks`` = its ``num_output_chunks`` (8 where the config leaves the class default,
  ``ce_chunked_output_loss.py``; the recipes pass it to the model, ``_setup_model``:
  ``model.set_num_output_chunks(self._loss_fn.num_output_chunks)``). Another loss than
  ``CrossEntropyLoss`` (a fused linear cross-entropy) is listed as ignored.
- ``clip_grad_norm``: ``grad_norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(),
  max_norm=float(self._clip_grad_norm))`` before ``self._optimizer.step()`` where it is not
  null (same recipes): our ``clip_grad_norm``. torchtune refuses it with ``optimizer_in_bwd``
  ("Gradient clipping is not supported with optimizer in bwd"), and so does the Recipe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .ignored import refuse, warn_ignored

if TYPE_CHECKING:
    from .recipe import Recipe

SOURCE = "torchtune config"

# torchtune's chunked output and loss, and its default chunk count
# (``CEWithChunkedOutputLoss.__init__(self, num_output_chunks: int = 8, ...)``, 0.6.1)
_CHUNKED_LOSS = "CEWithChunkedOutputLoss"
_CHUNKS_DEFAULT = 8

# optimizer._component_ -> our name (implementation from fused / foreach below).
OPTIMIZERS: dict[str, str] = {
    "torch.optim.AdamW": "adamw",
    "torch.optim.Adam": "adam",
    "torch.optim.SGD": "sgd",
    "torch.optim.Adagrad": "adagrad",
    "torch.optim.RMSprop": "rmsprop",
    "torch.optim.Adafactor": "adafactor",
    "bitsandbytes.optim.AdamW8bit": "adamw8bit",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw8bit",
    "bitsandbytes.optim.PagedAdamW": "paged-adamw",
    "torchao.optim.AdamW8bit": "torchao-adamw8bit",
    "torchao.optim.AdamW4bit": "torchao-adamw4bit",
    "torchao.prototype.low_bit_optim.AdamW8bit": "torchao-adamw8bit",
    "torchao.prototype.low_bit_optim.AdamW4bit": "torchao-adamw4bit",
}

# torchtune's QLoRA builders (torchtune/models/*/_model_builders.py: qlora_llama3_2_3b =
# partial(lora_llama3_2_3b, quantize_base=True)), the builders' default rank, and the format
# of their base weights: torchao's NF4Tensor (LoRALinear: to_nf4(self.weight))
_QLORA_BUILDER = "qlora_"
_QLORA_RANK = 8
TORCHAO_NF4 = "nf4-torchao"

# torchtune's LoRA module names -> Hugging Face Llama's (see the module docstring).
LORA_ATTN_NAMES: dict[str, str] = {
    "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj",
}  # fmt: skip
LORA_MLP_NAMES: tuple[str, ...] = ("gate_proj", "down_proj", "up_proj")  # w1, w2, w3

DTYPES: dict[str, str] = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}

# Keys with no effect on the device memory of a training step: files, data (the sequence
# length is the estimate's own input), logging, schedules, seeds.
NO_MEMORY_EFFECT: frozenset[str] = frozenset({
    "output_dir", "tokenizer", "dataset", "seed", "shuffle", "checkpointer",
    "resume_from_checkpoint", "save_adapter_weights_only", "save_last_epoch_only", "epochs",
    "max_steps_per_epoch", "metric_logger", "log_every_n_steps", "log_peak_memory_stats",
    "log_level", "device", "lr_scheduler", "collate_fn", "run_val_every_n_steps",
    "dataset_val", "save_every_n_steps", "keep_last_n_checkpoints",
})  # fmt: skip

_MODELLED = frozenset({
    "batch_size", "gradient_accumulation_steps", "dtype", "optimizer", "optimizer_in_bwd",
    "enable_activation_checkpointing", "model", "fsdp_reshard_after_forward", "loss",
    "compile", "enable_activation_offloading", "clip_grad_norm", "profiler",
    "mixed_precision", "fsdp_cpu_offload",
})  # fmt: skip


def read_torchtune(config: object, gpus: int = 1) -> Recipe:
    """See :meth:`Recipe.from_torchtune`."""
    from .recipe import Recipe

    values = _as_dict(config)
    ignored: list[str] = []
    _refuse_and_ignore(values, ignored)
    dtype = str(values.get("dtype", "fp32")).lower()
    if dtype not in DTYPES:
        raise ValueError(f"{SOURCE}: unknown dtype {dtype!r}; torchtune's are bf16 and fp32")
    settings: dict[str, Any] = {
        "batch_size": int(values.get("batch_size", 1)),
        "grad_accumulation": int(values.get("gradient_accumulation_steps", 1)),
        "precision": DTYPES[dtype],
        "optimizer": _optimizer(values.get("optimizer")),
        "optimizer_in_backward": bool(values.get("optimizer_in_bwd", False)),
        "checkpoint": "auto" if values.get("enable_activation_checkpointing") else None,
        "gpus": gpus,
        "outputs": "freed",  # del logits before the backward (module docstring)
    }
    if values.get("enable_activation_offloading"):
        settings["offload_activations"] = True
    loss = values.get("loss")
    if _component(loss).rsplit(".", 1)[-1] == _CHUNKED_LOSS:
        assert isinstance(loss, Mapping)
        settings["loss_chunks"] = int(loss.get("num_output_chunks", _CHUNKS_DEFAULT))
    clip = values.get("clip_grad_norm")
    if clip is not None:
        settings["clip_grad_norm"] = float(clip)
    if gpus > 1:  # torchtune's distributed recipes: FSDP2 fully_shard on each layer
        reshard = values.get("fsdp_reshard_after_forward", True)
        settings["strategy"] = "zero3" if reshard else "zero2"
        # the recipe's loop settings are estimated on one device only: named, not estimated
        loop = [
            k
            for k in ("outputs", "clip_grad_norm", "loss_chunks")
            if settings.pop(k, None) is not None
        ]
        ignored.append(
            f"the recipe's loop ({', '.join(loop)}) across {gpus} GPUs: each rank's step is "
            "estimated as a plain loop's (outputs kept through the backward, no clipping)"
        )
    settings.update(qlora_settings(values, ignored))
    warn_ignored(SOURCE, ignored)  # before the optimizer's name is parsed, which may refuse it
    return Recipe(ignored=tuple(ignored)).with_(**settings)


def _as_dict(config: object) -> dict[str, Any]:
    """A dict, a YAML file, or an OmegaConf ``DictConfig`` (unresolved: interpolations such as
    ``${output_dir}`` are in keys the reader does not need)."""
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        container = OmegaConf.to_container(config, resolve=False)
        assert isinstance(container, dict)
        return {str(k): v for k, v in container.items()}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        import yaml

        with open(config, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
        if not isinstance(loaded, dict):
            raise ValueError(f"{SOURCE}: {config} holds no mapping of settings")
        return loaded
    raise TypeError(
        "a torchtune config must be a dict, a path to its YAML file or an OmegaConf "
        f"DictConfig; got {type(config).__name__}"
    )


def _component(value: object) -> str:
    return str(value.get("_component_", "")) if isinstance(value, Mapping) else ""


def _refuse_and_ignore(values: Mapping[str, Any], ignored: list[str]) -> None:
    mixed = values.get("mixed_precision")
    if isinstance(mixed, Mapping) and mixed.get("enabled"):
        raise refuse(SOURCE, "mixed_precision.enabled", "int8 mixed-precision training")
    if values.get("fsdp_cpu_offload"):
        raise refuse(SOURCE, "fsdp_cpu_offload", "parameters and gradients held on the host")
    loss = _component(values.get("loss"))
    if loss and loss.rsplit(".", 1)[-1] not in ("CrossEntropyLoss", _CHUNKED_LOSS):
        ignored.append(f"loss {loss} (a chunked or fused cross-entropy: the estimate's loss "
                       "is the model's own over the whole logits)")  # fmt: skip
    if values.get("compile"):
        ignored.append("compile=True (torch.compile fuses the forward and changes what is saved)")
    profiler = values.get("profiler")
    if isinstance(profiler, Mapping) and profiler.get("enabled") and profiler.get("profile_memory"):
        ignored.append("profiler.profile_memory (the profiler's own records)")
    for key, value in values.items():
        if key not in NO_MEMORY_EFFECT and key not in _MODELLED:
            ignored.append(f"{key}={value!r} (unknown to this reader)")


def _optimizer(value: object) -> str:
    if not isinstance(value, Mapping):
        raise ValueError(f"{SOURCE}: optimizer must be a mapping with a _component_")
    component = _component(value)
    if component not in OPTIMIZERS:
        valid = ", ".join(OPTIMIZERS)
        raise ValueError(f"{SOURCE}: optimizer {component!r} is not estimated; read: {valid}")
    name = OPTIMIZERS[component]
    if name == "sgd" and float(value.get("momentum", 0) or 0) > 0:
        name = "sgd-momentum"
    if value.get("fused"):
        return f"{name}-fused"
    if "foreach" in value and value["foreach"] is not None:
        return f"{name}-{'foreach' if value['foreach'] else 'forloop'}"
    return name


def _lora_reading(model: object, ignored: list[str]) -> tuple[dict[str, Any], bool]:
    """The LoRA settings of the ``model`` section, and whether its base is quantized: a
    ``qlora_`` builder, or a LoRA builder with ``quantize_base: True`` (the same model)."""
    if not isinstance(model, Mapping):
        return {}, False
    qlora = _QLORA_BUILDER in _component(model).rsplit(".", 1)[-1]
    qlora = qlora or bool(model.get("quantize_base"))
    if qlora:
        # the builders' default rank (torchtune/models/*/_model_builders.py, e.g.
        # lora_llama3_2_3b: lora_rank=8; the qlora_ builders are
        # functools.partial(lora_..., quantize_base=True))
        model = {"lora_rank": _QLORA_RANK, **model}
    elif "lora_rank" not in model:
        return {}, False
    attn = list(model.get("lora_attn_modules", []))
    unknown = [m for m in attn if m not in LORA_ATTN_NAMES]
    if unknown:
        valid = ", ".join(LORA_ATTN_NAMES)
        raise ValueError(f"{SOURCE}: lora_attn_modules {unknown} unknown; torchtune's are {valid}")
    targets = [LORA_ATTN_NAMES[m] for m in attn]
    if model.get("apply_lora_to_mlp"):
        targets.extend(LORA_MLP_NAMES)
    if model.get("apply_lora_to_output"):
        targets.append("lm_head")
    if model.get("use_dora"):
        raise refuse(SOURCE, "model.use_dora", "DoRA's magnitude vectors and norms")
    if float(model.get("lora_dropout", 0) or 0) > 0:
        ignored.append(f"model.lora_dropout={model['lora_dropout']} (the adapters' dropout "
                       "masks)")  # fmt: skip
    settings = {"lora_rank": int(model["lora_rank"]), "lora_targets": targets, "lora_dtype": "base"}
    return settings, qlora


def qlora_settings(config: object, ignored: list[str] | None = None) -> dict[str, Any]:
    """The LoRA settings a torchtune config's ``model`` section gives, with the weights'
    format where its base is quantized (torchao's ``NF4Tensor``: ``"nf4-torchao"``); what
    it does not estimate is appended to ``ignored``.

    Examples
    --------
    >>> s = qlora_settings({"model": {"lora_attn_modules": ["q_proj", "output_proj"],
    ...     "_component_": "torchtune.models.llama3_2.qlora_llama3_2_3b", "lora_rank": 16}})
    >>> s["lora_rank"], s["lora_targets"], s["weights"]
    (16, ['q_proj', 'o_proj'], 'nf4-torchao')
    """
    settings, qlora = _lora_reading(
        _as_dict(config).get("model"), [] if ignored is None else ignored
    )
    if qlora:
        settings["weights"] = TORCHAO_NF4
    return settings
