"""A Recipe from a torchtitan job config: the TOML file of ``torchtitan/train.py
--job.config_file`` (or the dict it parses to). Its sections and keys, and their defaults
where a file leaves them out, are torchtitan 0.2.2's ``torchtitan/config/job_config.py``
(``JobConfig``), the last release configured by TOML files: torchtitan 0.3 configures a run
by Python functions that return a ``Trainer.Config`` (pytorch/torchtitan#2386, "Config System
Refactor: TOML to Python Dataclass Registry"), which this reader does not run.

- ``[training]`` ``local_batch_size`` (8) and ``seq_len`` (2048): the micro-batch and the
  sequence length. ``global_batch_size`` (-1: ``local_batch_size`` times the data-parallel
  degree) gives the micro-batches per step, ``global_batch_size // (local_batch_size *
  dp_degree)``, which must divide exactly (``Trainer.__init__``, ``torchtitan/train.py``).
- ``[training]`` ``dtype`` ("float32") and ``mixed_precision_param`` ("bfloat16"):
  ``dtype="bfloat16"`` puts parameters, gradients and optimizer state in bf16 (our
  ``"bf16"``). Otherwise the parameters stay fp32 and ``mixed_precision_param`` is the
  compute dtype: through ``fully_shard``'s ``MixedPrecisionPolicy`` under FSDP, through
  ``torch.autocast`` under DDP or on one device, and not at all with tensor or pipeline
  parallelism without FSDP (``maybe_enable_amp``, ``torchtitan/distributed/utils.py``): our
  ``"amp-bf16"`` (FSDP2 under autocast gathers bf16 parameters, ``sharding.FSDP_PARAM_DTYPE``)
  or ``"fp32"``. ``enable_cpu_offload`` (FSDP's parameters, gradients and optimizer state on
  the host) is refused.
- ``[training]`` ``max_norm`` (1.0): ``train_step`` clips with
  ``dist_utils.clip_grad_norm_(..., self.job_config.training.max_norm, ...)`` before the
  optimizer step, whatever its value: ``clip_grad_norm``.
- The step: ``forward_backward_step`` computes ``loss_sum = self.loss_fn(pred, labels)`` and
  ``loss = loss_sum / global_valid_tokens``, then ``del pred`` ("need to free pred before
  bwd to avoid peaking memory") and ``loss.backward()``: ``outputs="freed"`` and
  ``loss_scaled=True`` (``torchtitan/train.py``).
- ``[optimizer]`` ``name`` ("AdamW"; ``build_optimizers`` knows "Adam" and "AdamW",
  ``torchtitan/components/optimizer.py``) and ``implementation`` ("fused", "foreach",
  "for-loop": ``fused=`` / ``foreach=`` of the torch optimizer, same file);
  ``early_step_in_backward``: each parameter stepped in its post-accumulate-grad hook
  (``optimizer_in_backward``). ``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``
  change no memory.
- ``[activation_checkpoint]`` ``mode`` ("selective"; "none", "full", "memory_budget") and
  ``selective_ac_option`` ("2"): ``apply_ac`` wraps each of ``model.layers``
  (``torchtitan/distributed/activation_checkpoint.py``), our ``checkpoint="auto"``. "full"
  recomputes each block whole; "selective" with "op" is the op-level policy
  (``checkpoint_policy="op"``), with an integer string k every k-th block
  (``checkpoint_policy=k``; "0" checkpoints every block: ``_apply_layer_sac`` tests ``not
  ac_freq or _layer_sac_count % ac_freq == 0``). "memory_budget" is torch.compile's
  partitioner, refused.
- ``[parallelism]``: ``data_parallel_replicate_degree`` (1) and ``data_parallel_shard_degree``
  (-1: the ranks the other degrees leave, ``ParallelDims._validate``,
  ``torchtitan/distributed/parallel_dims.py``): shard > 1 is FSDP2 (``"zero3"``, or
  ``"zero2"`` where ``fsdp_reshard_after_forward="never"``; "default" reshards unless
  pipeline parallelism is on, ``apply_fsdp`` in ``torchtitan/models/llama3/infra/
  parallelize.py``), replicate > 1 alone DDP, both HSDP (sharded within groups of the shard
  degree: ``gpus_per_node``). ``tensor_parallel_degree`` k > 1 is our ``tp=k`` on
  ``gpus=k``, sharded by the model's own plan (torchtitan 0.3.0's ``ParallelismConfig``,
  ``torchtitan/config/configs.py``); with ``data_parallel_shard_degree`` d > 1 beside it,
  ``gpus=d*k, tp=k`` with FSDP2's strategy as above (FSDP2 over the tensor-parallel groups);
  with ``data_parallel_replicate_degree`` r > 1, ``gpus=r*d*k, tp=k, strategy="hsdp",
  gpus_per_node=d*k`` (one replica a node, d = 1 included: HSDP over the tensor-parallel
  groups). Under ``tp``,
  torchtitan's sequence parallelism (``enable_sequence_parallel``, on by default) and its
  vocabulary-parallel loss (``_LossParallelCrossEntropy``, ``torchtitan/components/loss.py``; 0.2's
  ``disable_loss_parallel=false``) are listed as ignored, as is async tensor parallelism
  (``compile.enable_async_tensor_parallel`` in 0.3.0, ``parallelism.`` in 0.2; it needs
  torch.compile, which is listed too). ``pipeline_parallel_degree`` k > 1 is our ``pp=k``
  (``gpus`` counts it: dp x tp x pp), ``pipeline_parallel_schedule`` ("1F1B"; "GPipe" and
  "Interleaved1F1B" too, any other refused) our ``pp_schedule``, and the micro-batches
  ``local_batch_size // pipeline_parallel_microbatch_size`` (1) our ``microbatches``; the
  stages are split by torchtitan's defaults, and keys that change the split
  (``pipeline_parallel_layers_per_stage``, ``..._first_stage_less_layers``, ...) are listed
  as ignored. What the pipeline estimate does not take (HSDP or DDP over stages, "amp-bf16",
  selective checkpointing, ...) it refuses by name. Context and expert parallelism degrees
  > 1 are listed as ignored (each rank's step is estimated as a data-parallel one):
  torchtitan's shard the data-parallel ranks' own batches, where ``cp`` and ``ep`` here are
  ranks sharing one batch.
- ``[model]`` ``name`` / ``flavor``: listed; the model estimated is the one profiled.
  ``converters`` (float8, mx): listed as not estimated. ``[compile]`` ``enable``: listed
  as not estimated. Sections with no effect on a step's memory (``job``, ``profiling``,
  ``metrics``, ``lr_scheduler``, ``checkpoint``, ``comm``, ``validation``,
  ``fault_tolerance``, ``debug``, ``memory_estimation``) are read past; any other section
  or key is listed in ``Recipe.ignored``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import tomllib

from .ignored import refuse, warn_ignored

if TYPE_CHECKING:
    from .recipe import Recipe

__all__ = ["read_torchtitan"]

SOURCE = "torchtitan config"

# torchtitan 0.2.2 JobConfig's defaults (torchtitan/config/job_config.py) for the keys read
_TRAINING_DEFAULTS: dict[str, Any] = {
    "local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "max_norm": 1.0,
    "dtype": "float32", "mixed_precision_param": "bfloat16", "enable_cpu_offload": False,
}  # fmt: skip
_PARALLEL_DEFAULTS: dict[str, Any] = {
    "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
    "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1, "context_parallel_degree": 1, "expert_parallel_degree": 1,
    "enable_sequence_parallel": True,
}  # fmt: skip

# torchtitan 0.2.2 JobConfig's pipeline defaults (Parallelism, torchtitan/config/job_config.py)
_PIPELINE_DEFAULTS: dict[str, Any] = {"schedule": "1F1B", "microbatch": 1}
_SPLIT_DEFAULTS: dict[str, Any] = {
    "pipeline_parallel_layers_per_stage": None, "pipeline_parallel_first_stage_less_layers": 1,
    "pipeline_parallel_last_stage_less_layers": 1, "module_fqns_per_model_part": None,
    "pipeline_parallel_schedule_csv": "",
}  # fmt: skip
# torch's schedule names (get_schedule_class) -> ours; the others are not estimated
_SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B")
PIPELINE_SCHEDULES: dict[str, str] = dict(
    zip((n.lower() for n in _SCHEDULE_NAMES), ("gpipe", "1f1b", "interleaved-1f1b"), strict=True)
)

# optimizer.name -> ours (build_optimizers' optimizer_classes, components/optimizer.py);
# optimizer.implementation -> our implementation suffix
OPTIMIZERS: dict[str, str] = {"Adam": "adam", "AdamW": "adamw"}
IMPLEMENTATIONS: dict[str, str] = {"fused": "fused", "foreach": "foreach", "for-loop": "forloop"}
AC_MODES = ("none", "full", "selective", "memory_budget")
DTYPES = ("float32", "bfloat16")

# Sections with no effect on the device memory of a step (files, logs, schedules, saving)
NO_MEMORY_EFFECT: frozenset[str] = frozenset({
    "job", "profiling", "metrics", "lr_scheduler", "checkpoint", "comm", "validation",
    "fault_tolerance", "debug", "memory_estimation",
})  # fmt: skip
# the keys of each read section that change no memory, or are read below
_KNOWN: dict[str, frozenset[str]] = {
    "training": frozenset({
        *_TRAINING_DEFAULTS, "dataset", "dataset_path", "steps", "mixed_precision_reduce",
        "gc_freq", "gc_debug", "dataloader", "deterministic", "seed",
    }),
    "optimizer": frozenset({
        "name", "implementation", "early_step_in_backward", "lr", "beta1", "beta2", "eps",
        "weight_decay",
    }),
    "activation_checkpoint": frozenset({
        "mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "preserve_rng_state", "determinism_check", "debug", "memory_budget",
        "visualize_memory_budget_pareto", "early_stop",
    }),
    "parallelism": frozenset({
        *_PARALLEL_DEFAULTS, "disable_loss_parallel", "enable_async_tensor_parallel",
        "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size", "pipeline_parallel_expert_parallel_overlap",
        "context_parallel_load_balancer", "context_parallel_rotate_method",
        "expert_tensor_parallel_degree", "expert_parallel_comm_backend",
    }),
    "model": frozenset({
        "name", "flavor", "hf_assets_path", "tokenizer_path", "converters",
        "print_after_conversion",
    }),
    "compile": frozenset({"enable", "components", "backend", "enable_async_tensor_parallel"}),
}  # fmt: skip
# the step's loop settings, estimated on one device only (as the other readers do)
_LOOP_SETTINGS = ("outputs", "loss_scaled", "clip_grad_norm")


def read_torchtitan(config: object, gpus: int | None = None) -> Recipe:
    """See :meth:`Recipe.from_torchtitan`."""
    from .recipe import Recipe

    values = _as_dict(config)
    ignored: list[str] = []
    sections = {name: _section(values, name) for name in _KNOWN}
    _list_unknown(values, ignored)
    training = {**_TRAINING_DEFAULTS, **sections["training"]}
    if training["enable_cpu_offload"]:
        held = "parameters, gradients and optimizer state held on the host"
        raise refuse(SOURCE, "training.enable_cpu_offload", held)
    parallel = _parallel(sections["parallelism"], gpus, ignored)
    if parallel.get("tp", 1) > 1:
        _tensor_parallel(sections["parallelism"], sections["compile"], ignored)
    if parallel.get("pp", 1) > 1:
        parallel.update(_pipeline(sections["parallelism"], training, ignored))
    dp_degree = parallel["gpus"] // (parallel.get("tp", 1) * parallel.get("pp", 1))
    settings: dict[str, Any] = {
        **parallel,
        "batch_size": _positive_int(training, "training", "local_batch_size"),
        "seq_len": _positive_int(training, "training", "seq_len"),
        "grad_accumulation": _accumulation(training, dp_degree),
        "precision": _precision(training, parallel, sections["parallelism"]),
        "optimizer": _optimizer(sections["optimizer"]),
        "optimizer_in_backward": bool(sections["optimizer"].get("early_step_in_backward")),
        "outputs": "freed",  # del pred before loss.backward() (module docstring)
        "loss_scaled": True,  # loss = loss_sum / global_valid_tokens (module docstring)
        "clip_grad_norm": float(training["max_norm"]),
        **_checkpointing(sections["activation_checkpoint"], ignored),
    }
    if settings["optimizer_in_backward"]:
        del settings["clip_grad_norm"]  # the Recipe refuses clipping with it, as torchtitan warns
        ignored.append(
            f"training.max_norm={training['max_norm']!r} with optimizer.early_step_in_backward "
            "(each gradient is stepped and freed in the backward: nothing is left to clip)"
        )
    if parallel["gpus"] > 1:
        loop = [k for k in _LOOP_SETTINGS if settings.pop(k, None) is not None]
        ignored.append(
            f"the training loop ({', '.join(loop)}) across {parallel['gpus']} GPUs: each rank's "
            "step is "
            "estimated as a plain loop's (outputs kept through the backward, no clipping)"
        )
    _model_and_compile(sections["model"], sections["compile"], ignored)
    warn_ignored(SOURCE, ignored)
    return Recipe(ignored=tuple(ignored)).with_(**settings)


def _as_dict(config: object) -> dict[str, Any]:
    """A dict (the parsed TOML), or a path to the TOML file."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, str | os.PathLike):
        with open(config, "rb") as f:
            try:
                return tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{SOURCE}: {os.fspath(config)} is not TOML: {exc}") from None
    raise TypeError(
        "a torchtitan config must be a dict (its parsed TOML) or a path to its TOML file "
        f"(torchtitan's --job.config_file); got {type(config).__name__}"
    )


def _section(values: Mapping[str, Any], name: str) -> dict[str, Any]:
    section = values.get(name, {})
    if not isinstance(section, Mapping):
        raise ValueError(f"{SOURCE}: [{name}] must be a table of settings, got {section!r}")
    return dict(section)


def _list_unknown(values: Mapping[str, Any], ignored: list[str]) -> None:
    for name, section in values.items():
        if name in NO_MEMORY_EFFECT:
            continue
        if name not in _KNOWN:
            ignored.append(f"[{name}] {section!r} (unknown to this reader)")
            continue
        for key, value in section.items():
            if key not in _KNOWN[name]:
                ignored.append(f"{name}.{key}={value!r} (unknown to this reader)")


def _positive_int(section: Mapping[str, Any], name: str, key: str) -> int:
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{SOURCE}: {name}.{key}={value!r}; give an integer >= 1")
    return value


def _degree(section: Mapping[str, Any], key: str) -> int:
    value = section.get(key, _PARALLEL_DEFAULTS[key])
    shard = key == "data_parallel_shard_degree"
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        valid = "an integer >= 1" + (", or -1 (the ranks the others leave)" if shard else "")
        raise ValueError(f"{SOURCE}: parallelism.{key}={value!r}; give {valid}")
    if value == -1 and not shard:
        raise ValueError(f"{SOURCE}: parallelism.{key}=-1; give an integer >= 1")
    return value


def _parallel(section: Mapping[str, Any], gpus: int | None, ignored: list[str]) -> dict[str, Any]:
    """The data-parallel ranks and strategy; the other degrees listed as ignored."""
    replicate = _degree(section, "data_parallel_replicate_degree")
    shard = _degree(section, "data_parallel_shard_degree")
    others = {
        key: _degree(section, key)
        for key in (
            "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
        )
    }  # fmt: skip
    expert = _degree(section, "expert_parallel_degree")
    non_dp = others["tensor_parallel_degree"] * others["pipeline_parallel_degree"]
    non_dp *= others["context_parallel_degree"]
    if shard == -1:  # ParallelDims._validate: the ranks the other degrees leave
        world = 1 if gpus is None else gpus
        if world % (replicate * non_dp):
            raise ValueError(
                f"{SOURCE}: gpus={world} is not a multiple of data_parallel_replicate_degree "
                f"x tensor, pipeline and context parallel degrees = {replicate * non_dp}"
            )
        shard = world // (replicate * non_dp)
    world = replicate * shard * non_dp
    if gpus is not None and gpus != world:
        raise ValueError(
            f"{SOURCE}: gpus={gpus}, but the parallelism degrees multiply to {world} "
            "(torchtitan asserts dp_replicate * dp_shard * cp * tp * pp == WORLD_SIZE); give "
            "gpus equal to their product, or data_parallel_shard_degree = -1"
        )
    tp = others.pop("tensor_parallel_degree")
    pp = others.pop("pipeline_parallel_degree")
    for key, degree in [*others.items(), ("expert_parallel_degree", expert)]:
        if degree > 1:
            ignored.append(
                f"parallelism.{key}={degree} (not estimated: each rank's step is estimated as "
                "a data-parallel one over the whole model)"
            )
    layout = _data_and_tensor_parallel(section, replicate, shard, tp, pp, ignored)
    if pp > 1:  # each stage's ranks laid out as above (pp the outermost mesh dimension)
        layout = {**layout, "gpus": layout["gpus"] * pp, "pp": pp}
        reshard = section.get("fsdp_reshard_after_forward", "default")
        if layout.get("strategy") == "hsdp" and reshard == "default":
            # "default" does not reshard under pipelining (apply_fsdp); "never" is listed above
            ignored.append(
                "parallelism.fsdp_reshard_after_forward='default' under HSDP with pipeline "
                "parallelism (torchtitan does not reshard after the forward there; estimated "
                "resharded)"
            )
    return layout


def _data_and_tensor_parallel(
    section: Mapping[str, Any],
    replicate: int,
    shard: int,
    tp: int,
    pp: int,
    ignored: list[str],
) -> dict[str, Any]:
    """The ranks of one pipeline stage (all of them without pipelining): the data-parallel
    strategy over ``replicate x shard`` ranks and the ``tp`` ranks under it (``pp`` sets
    FSDP2's default resharding, :func:`_fsdp_strategy`)."""
    dp = replicate * shard
    if tp > 1:
        if replicate > 1:  # HSDP on the (dp_replicate, fsdp) sub-mesh over tp groups
            if section.get("fsdp_reshard_after_forward", "default") == "never":
                ignored.append(
                    "parallelism.fsdp_reshard_after_forward='never' under HSDP (estimated "
                    "resharded after the forward)"
                )
            # a "node" of hsdp is one replica: dp_shard x tp ranks (a shard degree of 1 too:
            # torchtitan 0.3.0 keeps the size-1 "fsdp" dim and runs fully_shard over the
            # (dp_replicate, fsdp) sub-mesh, ParallelDims._mesh_exist and parallelize.py:74-80)
            return {
                "gpus": replicate * shard * tp, "tp": tp, "strategy": "hsdp",
                "gpus_per_node": shard * tp,
            }  # fmt: skip
        if shard > 1:  # FSDP2 on the dp_shard sub-mesh over tp groups (parallelize_llama)
            return {"gpus": shard * tp, "tp": tp, "strategy": _fsdp_strategy(section, pp)}
        return {"gpus": tp, "tp": tp}
    if dp == 1:
        return {"gpus": 1}
    if shard == 1:
        return {"gpus": dp, "strategy": "ddp"}
    strategy = _fsdp_strategy(section, pp)
    reshard = section.get("fsdp_reshard_after_forward", "default")
    if replicate > 1:
        if reshard == "never":
            ignored.append(
                "parallelism.fsdp_reshard_after_forward='never' under HSDP (estimated "
                "resharded after the forward)"
            )
        return {"gpus": dp, "strategy": "hsdp", "gpus_per_node": shard}
    return {"gpus": dp, "strategy": strategy}


def _fsdp_strategy(section: Mapping[str, Any], pp: int) -> str:
    """``"zero2"`` or ``"zero3"``: FSDP2's ``reshard_after_forward`` by
    ``fsdp_reshard_after_forward`` ("default": not pp_enabled, ``apply_fsdp``)."""
    reshard = section.get("fsdp_reshard_after_forward", "default")
    if reshard not in ("default", "always", "never"):
        raise ValueError(
            f"{SOURCE}: parallelism.fsdp_reshard_after_forward={reshard!r}; torchtitan's "
            "are 'default', 'always' and 'never'"
        )
    never = reshard == "never" or (reshard == "default" and pp > 1)
    return "zero2" if never else "zero3"


def _tensor_parallel(
    section: Mapping[str, Any], compile_: Mapping[str, Any], ignored: list[str]
) -> None:
    """What torchtitan's tensor parallelism does that ``tp`` (the model's own plan) does
    not, listed (module docstring)."""
    if section.get("enable_sequence_parallel", True):
        ignored.append(
            "parallelism.enable_sequence_parallel=True (torchtitan's sequence-parallel "
            "norms; the estimate shards by the model's own plan)"
        )
    if not section.get("disable_loss_parallel", False):
        ignored.append(
            "torchtitan's vocabulary-parallel loss under tensor parallelism (the estimate "
            "computes the loss on the model's own output)"
        )
    for where, values in (("compile", compile_), ("parallelism", section)):
        if values.get("enable_async_tensor_parallel", False):
            ignored.append(
                f"{where}.enable_async_tensor_parallel=True (async tensor parallelism's "
                "collectives, pipelined with the matmuls by torch.compile)"
            )


def _pipeline(
    section: Mapping[str, Any], training: Mapping[str, Any], ignored: list[str]
) -> dict[str, Any]:
    """``pp_schedule`` and ``microbatches`` for ``pipeline_parallel_degree`` > 1: the local
    batch split into micro-batches of ``pipeline_parallel_microbatch_size``
    (``build_pipeline_schedule``, ``torchtitan/distributed/pipeline_parallel.py``: ``n_microbatches
    = local_batch_size // microbatch_size``, refused where it does not divide), each stage
    split by torchtitan's defaults; the keys that change the split are listed."""
    name = section.get("pipeline_parallel_schedule", _PIPELINE_DEFAULTS["schedule"])
    # torch's get_schedule_class matches names case-insensitively
    # (torch/distributed/pipelining/schedules.py)
    schedule = PIPELINE_SCHEDULES.get(str(name).lower())
    if schedule is None:
        raise ValueError(
            f"{SOURCE}: parallelism.pipeline_parallel_schedule={name!r} is not estimated; "
            f"the schedules estimated are {', '.join(repr(n) for n in _SCHEDULE_NAMES)}"
        )
    size = section.get("pipeline_parallel_microbatch_size", _PIPELINE_DEFAULTS["microbatch"])
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(
            f"{SOURCE}: parallelism.pipeline_parallel_microbatch_size={size!r}; give an "
            "integer >= 1"
        )
    local = training["local_batch_size"]
    if local % size:
        raise ValueError(
            f"{SOURCE}: training.local_batch_size={local} is not a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size={size}; torchtitan refuses it too"
        )
    for key, default in _SPLIT_DEFAULTS.items():
        value = section.get(key, default)
        if value != default:
            ignored.append(
                f"parallelism.{key}={value!r} (the stages are split by torchtitan's default: "
                "by layer count, the embedding and the output each weighing one layer)"
            )
    return {"pp_schedule": schedule, "microbatches": local // size}


def _accumulation(training: Mapping[str, Any], dp_degree: int) -> int:
    """Micro-batches per step: global // (local x dp degree), exactly (Trainer.__init__)."""
    local = training["local_batch_size"]
    total = training["global_batch_size"]
    if isinstance(total, bool) or not isinstance(total, int) or total == 0 or total < -1:
        raise ValueError(
            f"{SOURCE}: training.global_batch_size={total!r}; give -1 (local_batch_size x "
            "the data-parallel degree) or a multiple of that"
        )
    if total == -1:
        return 1
    if total % (local * dp_degree):
        raise ValueError(
            f"{SOURCE}: training.global_batch_size={total} is not a multiple of "
            f"local_batch_size x data-parallel degree = {local} x {dp_degree}; torchtitan "
            "refuses it too"
        )
    return total // (local * dp_degree)


def _precision(
    training: Mapping[str, Any], parallel: Mapping[str, Any], section: Mapping[str, Any]
) -> str:
    """Our precision for training.dtype and mixed_precision_param (module docstring)."""
    dtype, param = training["dtype"], training["mixed_precision_param"]
    for key, value in (("dtype", dtype), ("mixed_precision_param", param)):
        if value not in DTYPES:
            raise ValueError(
                f"{SOURCE}: training.{key}={value!r}; torchtitan's are 'float32' and 'bfloat16'"
            )
    if dtype == "bfloat16":
        return "bf16"
    if param == "float32":
        return "fp32"
    fsdp = parallel.get("strategy") in ("zero2", "zero3", "hsdp")
    fsdp = fsdp or _degree(section, "context_parallel_degree") > 1
    tp_or_pp = any(
        _degree(section, key) > 1 for key in ("tensor_parallel_degree", "pipeline_parallel_degree")
    )
    return "fp32" if tp_or_pp and not fsdp else "amp-bf16"


def _optimizer(section: Mapping[str, Any]) -> str:
    name = section.get("name", "AdamW")
    if name not in OPTIMIZERS:
        raise ValueError(
            f"{SOURCE}: optimizer.name={name!r}; torchtitan builds {', '.join(OPTIMIZERS)}"
        )
    implementation = section.get("implementation", "fused")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{SOURCE}: optimizer.implementation={implementation!r}; torchtitan's are "
            f"{', '.join(repr(i) for i in IMPLEMENTATIONS)}"
        )
    return f"{OPTIMIZERS[name]}-{IMPLEMENTATIONS[implementation]}"


def _checkpointing(section: Mapping[str, Any], ignored: list[str]) -> dict[str, Any]:
    """checkpoint / checkpoint_policy for [activation_checkpoint] (module docstring)."""
    mode = section.get("mode", "selective")
    if mode not in AC_MODES:
        raise ValueError(
            f"{SOURCE}: activation_checkpoint.mode={mode!r}; torchtitan's are "
            f"{', '.join(repr(m) for m in AC_MODES)}"
        )
    if mode == "memory_budget":
        why = "torch.compile's partitioner decides what is saved"
        raise refuse(SOURCE, "activation_checkpoint.mode='memory_budget'", why)
    if section.get("early_stop"):
        ignored.append("activation_checkpoint.early_stop=True (the recompute stops early)")
    if mode == "none":
        return {}
    if mode == "full":
        return {"checkpoint": "auto"}
    option = str(section.get("selective_ac_option", "2"))
    if option == "op":
        return {"checkpoint": "auto", "checkpoint_policy": "op"}
    if not option.isdigit():
        raise ValueError(
            f"{SOURCE}: activation_checkpoint.selective_ac_option={option!r}; torchtitan's "
            "are 'op' (op-level) or an integer string k (every k-th layer, '0': every layer)"
        )
    return {"checkpoint": "auto", "checkpoint_policy": max(1, int(option))}


def _model_and_compile(
    model: Mapping[str, Any], compile_: Mapping[str, Any], ignored: list[str]
) -> None:
    named = [f"model.{k}={model[k]!r}" for k in ("name", "flavor") if k in model]
    if named:
        ignored.append(f"{', '.join(named)} (the model estimated is the one profiled)")
    if model.get("converters"):
        ignored.append(
            f"model.converters={model['converters']!r} (float8 / mx conversions: not estimated)"
        )
    if compile_.get("enable"):
        ignored.append(
            "compile.enable=True (torch.compile fuses the forward and changes what is saved: "
            "not estimated)"
        )
