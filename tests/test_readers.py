"""Recipes read from Hugging Face TrainingArguments and torchtune configs, and the Trainer's
own step against the estimate of the Recipe read from its arguments."""

from __future__ import annotations

import gc
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from vram_widget import Recipe, RecipeSettingIgnored, profile_model, zoo
from vram_widget._estimating.recipe.training_arguments import OPTIM_NAMES

DATA = Path(__file__).parent / "data"


def test_training_arguments_settings() -> None:
    args = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True,
            "optim": "adamw_torch_fused", "gradient_checkpointing": True, "learning_rate": 1e-4,
            "max_grad_norm": 0.0}  # fmt: skip
    r = Recipe.from_training_arguments(args)
    assert (r.step.batch_size, r.get("grad_accumulation"), r.step.precision.value) == (
        4, 2, "amp-bf16"
    )  # fmt: skip
    assert (r.optimizer.name.value, r.optimizer.implementation.value) == ("adamw", "fused")
    assert r.levers.checkpoint == "auto" and r.ignored == ()
    # adamw_torch: the Trainer passes neither foreach nor fused (torch's default)
    plain = Recipe.from_training_arguments({**args, "optim": "adamw_torch", "bf16": False})
    assert plain.optimizer.implementation is None and plain.step.precision.value == "fp32"
    sgd = Recipe.from_training_arguments({**args, "optim": "sgd", "optim_args": "momentum=0.9"})
    assert sgd.optimizer.name.value == "sgd-momentum"


def test_training_arguments_instance_and_json_agree(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, max_grad_norm=0.0,
        report_to="none", optim="adamw_torch",
    )  # fmt: skip
    path = tmp_path / "args.json"
    path.write_text(args.to_json_string())
    from_instance = Recipe.from_training_arguments(args)
    assert from_instance == Recipe.from_training_arguments(args.to_json_string())
    assert from_instance == Recipe.from_training_arguments(path)
    assert from_instance.step.batch_size == 3


def test_every_transformers_optimizer_is_mapped() -> None:
    transformers = pytest.importorskip("transformers")
    names = {o.value for o in transformers.training_args.OptimizerNames}
    assert names == set(OPTIM_NAMES)


def test_ignored_settings_warn_and_reach_the_estimate() -> None:
    with pytest.warns(RecipeSettingIgnored, match=r"tf32=True.*torch_compile=True"):
        r = Recipe.from_training_arguments(
            {"optim": "sgd", "tf32": True, "max_grad_norm": 1.0, "torch_compile": True}
        )
    assert len(r.ignored) == 2  # max_grad_norm is modelled (clip_grad_norm)
    est = profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(recipe=r)
    assert est.ignored == r.ignored


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"deepspeed": "ds.json"}, "deepspeed"),
        ({"gradient_checkpointing": True,
          "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "use_reentrant"),
        ({"optim": "galore_adamw"}, "galore_adamw"),
        ({"optim": "nadam"}, "unknown optim 'nadam'"),
        ({"fsdp": "full_shard"}, "pass gpus=N"),
    ],
)  # fmt: skip
def test_training_arguments_refused_by_name(args: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Recipe.from_training_arguments({"max_grad_norm": 0, **args})


def test_training_arguments_fsdp() -> None:
    base = {"max_grad_norm": 0, "optim": "adamw_torch"}
    # across GPUs the Trainer's loop settings are not estimated: named, and left at the plain
    # loop's, so the rank's step is estimated rather than refused
    with pytest.warns(RecipeSettingIgnored, match=r"the Trainer's loop \(outputs, .*8 GPUs"):
        full = Recipe.from_training_arguments({**base, "fsdp": "full_shard"}, gpus=8)
    assert (full.parallel.gpus, full.parallel.strategy.value) == (8, "zero3")
    assert (full.step.outputs.value, full.optimizer.clip_grad_norm) == ("kept", None)
    assert any("8 GPUs" in item for item in full.ignored)
    from models import hf_llama, hf_tokens

    profile = profile_model(hf_llama(), inputs=hf_tokens(2))
    with pytest.warns(UserWarning, match="sharding saves little"):  # a tiny model's root
        est = profile.estimate(recipe=full.with_(batch_size=2))
    assert est.gpus == 8 and est.ignored == full.ignored
    with pytest.warns(RecipeSettingIgnored, match="4 GPUs"):
        grad_op = Recipe.from_training_arguments(
            {**base, "fsdp": True, "fsdp_config": {"reshard_after_forward": False}}, gpus=4
        )
    assert grad_op.parallel.strategy.value == "zero2"
    with pytest.warns(RecipeSettingIgnored, match="version=1"):
        hybrid = Recipe.from_training_arguments(
            {**base, "fsdp": "hybrid_shard", "fsdp_config": {"version": 1}}, gpus=16
        )
    assert hybrid.parallel.strategy.value == "hsdp"


def test_torchtune_full_single_device() -> None:
    # its CEWithChunkedOutputLoss (no num_output_chunks: the class default, 8) is estimated
    try:
        r = Recipe.from_torchtune(DATA / "torchtune_3B_full_single_device.yaml")
    except ValueError as exc:
        # bitsandbytes' PagedAdamW8bit is mapped; the optimizer registry decides on it
        assert "'paged-adamw8bit'" in str(exc)
        return
    assert r.levers.loss_chunks == 8 and r.ignored == ()
    assert r.optimizer.name.value == "paged-adamw8bit"
    assert (r.step.precision.value, r.optimizer.in_backward, r.levers.checkpoint) == (
        "bf16", True, "auto"
    )  # fmt: skip


def test_torchtune_chunked_loss_is_loss_chunks() -> None:
    loss = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
    base = {"optimizer": {"_component_": "torch.optim.AdamW"}}
    config = {**base, "loss": {**loss, "num_output_chunks": 4}}
    assert Recipe.from_torchtune(config).levers.loss_chunks == 4
    # the class default
    assert Recipe.from_torchtune({**base, "loss": loss}).levers.loss_chunks == 8
    with pytest.warns(RecipeSettingIgnored, match=r"loop \(outputs, loss_chunks\) across 2"):
        sharded = Recipe.from_torchtune({**base, "loss": loss}, gpus=2)
    assert sharded.levers.loss_chunks is None


def test_torchtune_lora_single_device() -> None:
    with pytest.warns(RecipeSettingIgnored, match="LinearCrossEntropyLoss"):
        r = Recipe.from_torchtune(DATA / "torchtune_3B_lora_single_device.yaml")
    assert (r.step.batch_size, r.get("grad_accumulation"), r.step.precision.value) == (4, 8, "bf16")
    assert (r.optimizer.name.value, r.optimizer.implementation.value) == ("adamw", "fused")
    # q_proj, v_proj, output_proj -> o_proj; apply_lora_to_mlp: w1, w2, w3 -> gate, down, up
    assert r.levers.lora_targets == ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj",
                                     "up_proj")  # fmt: skip
    assert (r.levers.lora_rank, r.levers.lora_dtype) == (64, "base")
    assert r.levers.checkpoint == "auto"


def test_torchtune_qlora_reads_nf4_torchao() -> None:
    # the model section of torchtune's recipes/configs/llama3_1/8B_qlora_single_device.yaml
    # (torchtune 0.6.1): a qlora_* builder is its lora_* builder with quantize_base=True
    model = {
        "_component_": "torchtune.models.llama3_1.qlora_llama3_1_8b",
        "lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
        "apply_lora_to_mlp": True,
        "apply_lora_to_output": False,
        "lora_rank": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
    }
    base = {"optimizer": {"_component_": "torch.optim.AdamW"}, "dtype": "bf16"}
    r = Recipe.from_torchtune({**base, "model": model})
    assert r.weights.format is not None and r.weights.format.value == "nf4-torchao"
    assert (r.levers.lora_rank, r.levers.lora_dtype) == (8, "base")
    assert r.levers.lora_targets == ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj",
                                     "up_proj")  # fmt: skip
    assert r.step.precision.value == "bf16"
    plain = {**model, "_component_": "torchtune.models.llama3_2.lora_llama3_2_3b"}
    assert not Recipe.from_torchtune({**base, "model": plain}).weights.quantized
    quantized = Recipe.from_torchtune({**base, "model": {**plain, "quantize_base": True}})
    assert quantized.weights.format == r.weights.format


def test_torchtune_refusals() -> None:
    base = {"optimizer": {"_component_": "torch.optim.AdamW"}}
    with pytest.raises(ValueError, match=r"torch\.optim\.NAdam"):
        Recipe.from_torchtune({"optimizer": {"_component_": "torch.optim.NAdam"}})
    with pytest.raises(ValueError, match="dtype 'fp16'"):
        Recipe.from_torchtune({**base, "dtype": "fp16"})
    loop = Recipe.from_torchtune({"optimizer": {"_component_": "torch.optim.SGD",
                                                "momentum": 0.9, "foreach": False}})  # fmt: skip
    assert (loop.optimizer.name.value, loop.optimizer.implementation.value) == (
        "sgd-momentum", "forloop"
    )  # fmt: skip


# --- the Trainer's own step -------------------------------------------------------------------


def _trainer_peak(
    optim: str, checkpointing: bool, accumulation: int, max_grad_norm: float, tmp_path: Path
) -> tuple[int, Any]:
    """The peak of the Trainer's third optimizer step (``accumulation`` micro-batches of 2),
    as ``measure`` reads a CPU peak: resident bytes at the step's start (parameters, buffers,
    optimizer state, one micro-batch, and the previous step's loss and gradient norm that
    the training loop holds, ``tr_loss_step`` and ``grad_norm``) plus the largest rise of the
    CPU allocator's total during the step, from ``on_step_begin`` to ``on_step_end`` (after
    ``zero_grad``)."""
    transformers = pytest.importorskip("transformers")
    from models import hf_llama, hf_tokens
    from torch.profiler import ProfilerActivity, profile, record_function

    from vram_widget._profiling import cpu_trace as measuring

    marks: dict[str, Any] = {}

    class Mark(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                gc.collect(0)
                tensors = [*kw["model"].parameters(), *kw["model"].buffers()]
                for s in kw["optimizer"].state.values():
                    tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
                tensors += _loop_scalars()
                marks["resident"] = measuring._storage_bytes(tensors, torch.device("cpu"))
                del tensors
                marks["span"] = record_function(measuring._MARKER)
                marks["span"].__enter__()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                marks["span"].__exit__(None, None, None)

    data = [{k: v[0] for k, v in hf_tokens(1, 16, seed=i).items()} for i in range(12)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, optim=optim,
        gradient_checkpointing=checkpointing, max_steps=3, report_to="none",
        save_strategy="no", logging_strategy="no", max_grad_norm=max_grad_norm,
        disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = transformers.Trainer(model=hf_llama(), args=args, train_dataset=data,
                                   callbacks=[Mark()])  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train()
    trace = measuring._cpu_trace(prof)
    one_batch = sum(t.nbytes for t in hf_tokens(2, 16).values())
    return marks["resident"] + one_batch + trace.peak_above_start(), args


def _loop_scalars() -> list[torch.Tensor]:
    """The previous step's loss and gradient norm, which the Trainer's loop holds
    (``tr_loss_step``, ``grad_norm`` in ``Trainer._run_epoch``). Read from the loop's frame;
    the locals dict that reading makes holds references of its own, so it is emptied, else
    it would keep them alive past the point where the loop drops them."""
    loop = inspect.currentframe()
    while loop is not None and loop.f_code.co_name != "_run_epoch":
        loop = loop.f_back
    assert loop is not None
    names = loop.f_locals
    carried = [names.get("tr_loss_step"), names.get("grad_norm")]
    if isinstance(names, dict):  # a snapshot (Python < 3.13; later, a view holding nothing)
        names.clear()
    del loop, names
    assert all(isinstance(t, torch.Tensor) for t in carried)
    return carried  # type: ignore[return-value]


@pytest.fixture(scope="module")
def llama_profile() -> Any:
    from models import hf_llama, hf_tokens

    return profile_model(hf_llama(), inputs=hf_tokens(2, 16), device="cpu")


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing's new name
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize(
    ("optim", "checkpointing"),
    [("adamw_torch_fused", False), ("adamw_torch_fused", True), ("adamw_torch", False),
     ("adamw_torch", True)],
)  # fmt: skip
def test_trainer_step_against_the_estimate(
    optim: str, checkpointing: bool, accumulation: int, llama_profile: Any, tmp_path: Path
) -> None:
    # max_grad_norm 1.0 (the default) clips; 0.0 only reads the norm: the same memory
    max_grad_norm = 1.0 if accumulation == 1 else 0.0
    measured, args = _trainer_peak(optim, checkpointing, accumulation, max_grad_norm, tmp_path)
    recipe = Recipe.from_training_arguments(args)
    assert recipe.levers.checkpoint == ("auto" if checkpointing else None)
    assert recipe.ignored == ()
    est = llama_profile.estimate(recipe=recipe)
    assert est.levers.carried_scalars and est.levers.decay_groups and est.levers.outputs_freed
    assert measured == est.peak_bytes


# --- the quantized setups: the model's BitsAndBytesConfig, torchtune's QLoRA builders -------


def test_training_arguments_read_the_models_quantization(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from models import hf_llama

    from vram_widget import Weights

    torch.manual_seed(0)
    hf_llama().save_pretrained(tmp_path)
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )  # fmt: skip
    # the real load: from_pretrained sets model.config.quantization_config
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, quantization_config=config, device_map="cpu"
    )
    args = {"per_device_train_batch_size": 2, "bf16": True, "optim": "adamw_torch"}
    r = Recipe.from_training_arguments(args, model=model)
    assert r.weights == Weights("nf4", double_quant=True, compute_dtype="bf16")
    # its weights are held in bf16 (dtype=torch.bfloat16): a bf16 step, not autocast
    assert r.step.precision.value == "bf16"
    # QLoRA as the Trainer gets it: PEFT's kbit preparation (the unquantized weights to fp32)
    # and LoRA adapters of rank 8 on q_proj and v_proj
    prepared = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    wrapped = peft.get_peft_model(
        prepared, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["v_proj", "q_proj"])
    )
    q = Recipe.from_training_arguments(args, model=wrapped)
    assert (q.levers.lora_rank, q.levers.lora_targets) == (8, ("q_proj", "v_proj"))
    assert q.weights.format.value == "nf4" and q.step.precision.value == "amp-bf16"
    # int8 with its options, from the config's own to_dict (a saved config.json holds it)
    model.config.quantization_config = transformers.BitsAndBytesConfig(
        load_in_8bit=True, llm_int8_threshold=4.0, llm_int8_skip_modules=["lm_head"]
    ).to_dict()
    i8 = Recipe.from_training_arguments(args, model=model)
    assert i8.weights == Weights("int8", int8_threshold=4.0, skip_modules=("lm_head",))


def test_training_arguments_refuse_other_quantizations() -> None:
    pytest.importorskip("transformers")
    from models import hf_llama

    model = hf_llama()
    args = {"optim": "adamw_torch"}
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        Recipe.from_training_arguments(args, model=model)
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True,
                                        "llm_int8_has_fp16_weight": True}  # fmt: skip
    with pytest.raises(ValueError, match="llm_int8_has_fp16_weight"):
        Recipe.from_training_arguments(args, model=model)
    # a float32 model without quantization changes nothing the arguments say
    del model.config.quantization_config
    assert Recipe.from_training_arguments(args, model=model) == Recipe.from_training_arguments(args)


def test_torchtune_qlora_builder_is_read() -> None:
    from vram_widget._estimating.recipe.torchtune import qlora_settings
    from vram_widget._estimating.recipe.weights import WeightFormat

    path = DATA / "torchtune_3B_qlora_single_device.yaml"
    # torchao's NF4 base, rank 64 over q_proj, v_proj, output_proj -> o_proj and the MLP
    settings = qlora_settings(path)
    assert settings == {
        "lora_rank": 64,
        "lora_targets": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"],
        "lora_dtype": "base",
        "weights": "nf4-torchao",
    }
    # the builders' default rank (lora_llama3_2_3b: lora_rank=8); quantize_base: True on a
    # LoRA builder is the same model
    bare = {"model": {"_component_": "torchtune.models.llama3_2.qlora_llama3_2_3b",
                      "lora_attn_modules": ["q_proj"]}}  # fmt: skip
    assert qlora_settings(bare)["lora_rank"] == 8
    flag = {"model": {"_component_": "torchtune.models.llama3_2.lora_llama3_2_3b",
                      "lora_attn_modules": ["q_proj"], "quantize_base": True}}  # fmt: skip
    assert qlora_settings(flag)["weights"] == "nf4-torchao"
    r = Recipe.from_torchtune(path)  # every setting it has is read: nothing ignored
    assert r.ignored == ()
    assert r.weights.format is WeightFormat.NF4_TORCHAO and r.levers.lora_rank == 64
