"""ModelProfile: the cached per-layer profile of one model, and the door to estimates.

No torch here. A precision (or an optimizer) seen for the first time asks its source, the
profiler, for one more fake run; every later estimate is numpy arithmetic over the cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .chunked_loss import CHUNKING_UNKNOWN
from .estimator import MemoryEstimate
from .levers import Levers, resolve_levers
from .loading import LoadLayout
from .options import (
    Device,
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    Precision,
    Strategy,
)
from .profile_rungs import RungsMixin
from .profile_searches import (
    SearchesMixin,
)
from .profile_source import ProfileSource, ProfilingError
from .profile_step import (
    StepMixin,
    _unmodelled_step,
)
from .profile_timelines import TimelinesMixin
from .recipe import Recipe
from .recipe.float8 import Float8
from .recipe.generation import Generation
from .recipe.ignored import warn_ignored
from .recipe.recipe import default
from .recipe.weights import Weights
from .sharding import (
    DEFAULT_GPUS_PER_NODE,
    Parallel,
    StepEdits,
)
from .table import ModuleRows, OptimizerTrace, Timeline


class ModelProfile(TimelinesMixin, RungsMixin, StepMixin, SearchesMixin):
    """The cached profile of one model; ``estimate`` answers any setting in milliseconds.

    Build it with :func:`vram_widget.profile_model`.
    """

    # why compile="blocks" cannot run under FSDP2 (set per instance; the class's "" for a
    # profile cached before the field existed)
    compile_fsdp_refusal: str = ""

    def __init__(
        self,
        rows: ModuleRows,
        device: Device,
        source: ProfileSource,
        *,
        model_name: str = "",
        input_shape: str = "",
        fallback_reason: str | None = None,
        seq_len: int | None = None,
        no_seq_reason: str = "",
        seq_len_limit: int | None = None,
        seq_window: int | None = None,
        generates: bool = False,
        generation_limit: int | None = None,
        cache_implementation: str | None = None,
        cache_config: tuple[tuple[str, object], ...] = (),
        param_names: tuple[str, ...] = (),
        param_shapes: tuple[tuple[int, ...], ...] = (),
        param_trainable: tuple[bool, ...] = (),
        checkpoint_blocks: tuple[str, ...] = (),
        hf_checkpointing: bool = False,
        loss_chunks_refusal: str = CHUNKING_UNKNOWN,
        compile_fsdp_refusal: str = "",
    ) -> None:
        self.rows = rows
        self.device = device
        self.model_name = model_name
        # The profiled inputs as a person reads them ("batch × 3 × 224 × 224"): every
        # estimate is for this shape at its batch size, so it is shown wherever one is.
        self.input_shape = input_shape
        self.fallback_reason = fallback_reason
        self._source = source
        # The example's sequence length (None: no sequence axis), and why there is none
        self.seq_len = seq_len
        self._no_seq_reason = no_seq_reason
        # the longest sequence the model takes (learned absolute positions), if it has one
        self.seq_len_limit = seq_len_limit
        # a length where the model's attention changes form (a sliding window, chunks): the
        # fit in the length serves only lengths on the example's side of it
        self.seq_window = seq_window
        # whether the model generates with a KV cache (mode="generate"), and the most
        # positions a prompt and its new tokens may take (config.max_position_embeddings)
        self.generates = generates
        self.generation_limit = generation_limit
        # the model's generation_config.cache_implementation (None: DynamicCache)
        self.cache_implementation = cache_implementation
        # its generation_config.cache_config, as sorted items (QuantizedCache's settings)
        self.cache_config = cache_config
        # the parameters' qualified names (tied ones once), which ``trainable`` patterns match
        self.param_names = param_names
        self.param_shapes = param_shapes
        # each parameter's requires_grad as the model has it (the levers may freeze more)
        self.param_trainable = param_trainable or tuple(True for _ in param_names)
        # parameters kept in their own dtype whatever the precision (PEFT's adapters: fp32
        # on a half base by default), name -> dtype name
        self.fixed_param_dtypes: dict[str, str] = {}
        # what ``checkpoint="auto"`` wraps, and whether Hugging Face's own call applies it
        self.checkpoint_blocks = checkpoint_blocks
        self.hf_checkpointing = hf_checkpointing
        # why ``loss_chunks`` cannot be applied to the model ("": it can; chunked_loss.py)
        self.loss_chunks_refusal = loss_chunks_refusal
        # why compile="blocks" cannot run under FSDP2 ("": it can; _profiling/compiled.py,
        # fsdp_blocks_refusal)
        self.compile_fsdp_refusal = compile_fsdp_refusal
        # Every cache is per (precision, mode, levers); inference has no levers.
        self._timelines: dict[tuple[Precision, Mode, Levers], Timeline] = {}
        # the timeline as a polynomial in (batch, seq), made on the first other length
        # asked (None: memory is no such polynomial in the length)
        self._across_lengths: dict[tuple[Precision, Mode, Levers], Timeline | None] = {}
        # where it is none: other sequence lengths, each profiled on first use (cached)
        self._other_lengths: dict[tuple[Precision, Mode, Levers, int], Timeline] = {}
        # a setting that failed to profile fails again at once, without another run
        self._failures: dict[tuple[Precision, Mode, Levers], ProfilingError] = {}
        self._optimizers: dict[
            tuple[
                Precision,
                OptimizerChoice,
                Levers,
                tuple[str, ...] | None,
                tuple[int, int] | None,
                OptimizerImplementation,
            ],
            OptimizerTrace,
        ] = {}
        # LoRA: the profile of a meta copy that PEFT's get_peft_model wrapped, per (rank,
        # targets); its module names carry PEFT's prefix
        self._lora_profiles: dict[tuple[int, tuple[str, ...] | None, str | None], ModelProfile] = {}
        # quantized weights: the profile of bitsandbytes' quantized meta copy, per (weights,
        # LoRA rank, targets, adapters' dtype)
        self._quantized_profiles: dict[
            tuple[Weights, int | None, tuple[str, ...] | None, str | None], ModelProfile
        ] = {}
        # transformers' quantized KV cache: the profile of a meta copy whose generation
        # config asks for it, per Generation (its kv_* settings; new_tokens None)
        self._kv_cache_profiles: dict[Generation, ModelProfile] = {}
        # float8 training: the profile of torchao's float8 conversion of a meta copy
        self._float8_profiles: dict[Float8, ModelProfile] = {}
        # data parallelism: (precision, levers, ranks, rank) -> buffers, optimizer shards
        self._rank_layouts: dict[
            tuple[Precision, Levers, Parallel, int | None],
            tuple[tuple[int, ...], list[tuple[int, tuple[str, ...]]] | None],
        ] = {}
        # FSDP2: (timeline id, precision, levers, ranks) -> what it inserts into the step
        self._step_edits: dict[tuple[int, Precision, Levers, Parallel], StepEdits] = {}
        # generation across a sliding window: a run at a prompt just below it, per precision
        self._across_windows: dict[Precision, Timeline] = {}
        # generation with the quantized cache across a flush: recorded through its decode
        # steps, per (precision, prompt length, decode steps)
        self._across_flushes: dict[tuple[Precision, int | None, int], Timeline] = {}
        # generation with a StaticCache: runs at STATIC_CACHE_TOKENS, per precision and prompt
        self._static_caches: dict[tuple[Precision, int | None], tuple[Timeline, ...]] = {}
        self.name_prefix = ""
        # the tensors a loader leaves, per (dtype, weights): load_bytes
        self._load_layouts: dict[tuple[str, Weights], LoadLayout] = {}

    def __repr__(self) -> str:
        return (
            f"ModelProfile({self.model_name or 'model'}: {self.param_count:,} parameters, "
            f"{len(self.rows.names) - 2} modules, inputs: {self.input_shape or '?'}, "
            f"device={self.device.value!r})"
        )

    @property
    def param_count(self) -> int:
        """Parameters of the model, shared (tied) ones counted once."""
        return int(self.rows.param_count.sum())

    @property
    def trainable_param_count(self) -> int:
        return int(self.rows.trainable_param_count.sum())

    def levers(
        self,
        checkpoint: object = None,
        trainable: object = None,
        grad_accumulation: object = 1,
        lora_rank: object = None,
        lora_targets: object = "auto",
        checkpoint_policy: object = None,
    ) -> Levers:
        """The :class:`Levers` that ``estimate``'s lever keywords mean for this model (a
        ValueError / TypeError naming the problem and the valid forms)."""
        if isinstance(checkpoint, list | tuple) and self.name_prefix:
            # patterns of the plain model's names also match inside PEFT's wrapper
            checkpoint = [self.name_prefix + str(p) for p in checkpoint]
        return resolve_levers(
            module_names=self.rows.names[:-2],
            module_types=self.rows.types[:-2],
            param_names=self.param_names,
            auto_blocks=self.checkpoint_blocks,
            hf_auto=self.hf_checkpointing,
            model_name=self.model_name,
            checkpoint=checkpoint,
            trainable=trainable,
            grad_accumulation=grad_accumulation,
            lora_rank=lora_rank,
            lora_targets=lora_targets,
            checkpoint_policy=checkpoint_policy,
        )

    def estimate(
        self,
        batch_size: int = default(1),
        precision: str | Precision = default("fp32"),
        optimizer: str | OptimizerName | None = default("adam"),
        mode: str | Mode = default("train"),
        *,
        seq_len: int | None = default(None),
        compute_capability: tuple[int, int] | None = default(None),
        checkpoint: object = default(None),
        trainable: object = default(None),
        grad_accumulation: int = default(1),
        lora_rank: int | None = default(None),
        lora_targets: object = default("auto"),
        weights: object = default(None),
        float8: object = default(None),
        expandable_segments: bool = default(False),
        gpus: int = default(1),
        strategy: str | Strategy = default("ddp"),
        rank: int | None = default(None),
        gpus_per_node: int = default(DEFAULT_GPUS_PER_NODE),
        fsdp_units: object = default(None),
        new_tokens: int | None = default(None),
        recipe: Recipe | None = None,
        **settings: Any,
    ) -> MemoryEstimate:
        """Memory and FLOPs of one step at this setting, from the cached profile.

        Parameters
        ----------
        batch_size : int
            Samples per step (>= 1).
        precision : {"fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"}
        optimizer : str, callable or None
            ``"sgd"``, ``"sgd-momentum"``, ``"adam"``, ``"adamw"``, ``"adagrad"``,
            ``"rmsprop"`` (``-fused`` / ``-foreach`` / ``-forloop`` for SGD and Adam /
            AdamW); ``"adamw8bit"`` and ``"paged-adamw8bit"`` (bitsandbytes),
            ``"adamw8bit-torchao"`` and ``"adamw4bit-torchao"`` (torchao), ``"adafactor"``
            (transformers, with its Trainer's settings), each stepped by its library (a
            missing library is named with its ``pip install``); a callable ``params ->
            torch.optim.Optimizer`` (a class or a ``functools.partial``), whose own
            ``step()`` is traced; or None. Bitsandbytes' paged state is not in
            ``peak_bytes`` on CUDA: it is in unified memory, reported as ``paged_bytes``.
            Ignored in inference and generate modes.
        mode : {"train", "inference", "generate"}
            ``"generate"``: Hugging Face's greedy ``model.generate`` of ``new_tokens`` tokens
            after a prompt of ``seq_len`` tokens per sequence, ``batch_size`` sequences at
            once: the prefill of the prompt, then one decode step per further token with
            the model's own ``DynamicCache`` (``generation``: its code recorded on fake
            tensors for the prefill and 4 decode steps, the rest extrapolated from a pattern
            checked exactly on them, ``decoding``). The peak is over every step
            (``est.peak_step``: 0 the prefill, k decode step k); ``est.kv_cache_bytes`` and
            ``est.kv_cache_bytes_per_token`` give the cache. Prompts are taken as unpadded.
        seq_len : int, optional
            Tokens per sample, where the profile has a sequence axis (``has_seq_axis``);
            None is the example's length (``self.seq_len``). A length used for the first time
            is profiled at that length (cached), so the answer is exact at any length.
        compute_capability : (major, minor), optional
            The target GPU's, as ``torch.cuda.get_device_capability()`` gives it; it sizes
            the cuBLAS workspace in ``est.extras`` (32 MiB on 9.x, 8 MiB before). Default
            (9, 0), an H100.
        checkpoint : None, "auto", str or list of str
            Activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``):
            the modules whose forward is recomputed in the backward. ``"auto"``: each child
            of the model's largest ``ModuleList`` of repeated blocks (for a Hugging Face
            model, applied by its own ``activation_checkpointing_enable``); a class name
            (``"GPT2Block"``); or a list of fnmatch patterns of qualified module names
            (``["layer1", "layer2"]``), each wrapped as torch's ``checkpoint_wrapper`` wraps
            it. The recompute's FLOPs are in the backward's.
        trainable : None, str or list of str
            fnmatch patterns of the parameter names that train (``"classifier.*"``); every
            other parameter is frozen (no gradient, no optimizer state). None: as the model's
            ``requires_grad`` flags are.
        grad_accumulation : int
            Micro-batches of ``batch_size`` whose gradients accumulate before one optimizer
            step: the peak is over the whole step (the second micro-batch's backward runs with
            the gradients resident), the FLOPs those of all micro-batches.
        lora_rank : int, optional
            LoRA adapters of this rank, applied by PEFT's own ``get_peft_model(model,
            LoraConfig(r=lora_rank, target_modules=...))`` on a meta copy of the model (the
            model itself is not touched), so what is frozen, added and saved is exactly
            PEFT's. Needs ``pip install peft``. Not with ``trainable``.
        lora_targets : "auto", "all-linear" or list of str
            PEFT's ``target_modules``; ``"auto"``: PEFT's defaults for the architecture
            (Hugging Face models; other models must name their modules).
        weights : None, str ("nf4", "int8-torchao", "nf4-torchao", ...) or Weights
            The base weights stored by bitsandbytes, as transformers'
            ``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` stores them:
            its ``replace_with_bnb_linear`` on a meta copy of the model (``nn.Linear`` and
            ``Conv1D`` layers, the output embeddings and last module kept), each weight
            quantized by bitsandbytes' own ``quantize_4bit`` on fake tensors, the step run
            through ``Linear4bit``'s kernels. ``"nf4"`` / ``"fp4"``: ``Linear4bit`` at
            ``BitsAndBytesConfig``'s defaults (compute in float32, no double quantization,
            blocks of 64); a :class:`~vram_widget.Weights` (or a ``BitsAndBytesConfig``)
            sets them (``Weights("nf4", double_quant=True, compute_dtype="bf16")``, QLoRA's).
            In training, the quantized weights are frozen: ``lora_rank`` is needed (QLoRA:
            PEFT's ``prepare_model_for_kbit_training``, which casts the other half-precision
            parameters to fp32, then ``get_peft_model``). ``"int8"`` (``Linear8bitLt``,
            inference): with ``Weights("int8", int8_threshold=0.0)``; at
            ``BitsAndBytesConfig``'s threshold 6.0 its outlier split depends on the
            activations' values, refused (``measure`` takes it). On ``device="cuda"``,
            ``gemm_4bit`` runs as its unfused fallback does
            (the weight dequantized, then ``F.linear``: bitsandbytes/backends/cuda/ops.py,
            ``_dequant_linear_fallback``); for up to 1,536 rows of input it may pick a fused
            kernel by the GPU's architecture (``_gemm_4bit_use_custom_cuda``) that makes
            only the output, so the estimate is an upper bound there (UNCONFIRMED on a GPU).
            Needs ``pip install bitsandbytes transformers``. ``"int8-torchao"`` /
            ``"int4-torchao"``: torchao's ``quantize_`` (``Int8WeightOnlyConfig``; int4 on
            ``device="cpu"`` only, ``PrototypeInt4WeightOnlyConfig``'s
            ``Int4OpaqueTensor``), inference only, on the ``nn.Linear`` layers (on a
            transformers model, not the output embeddings, as ``TorchAoConfig``); needs
            ``pip install torchao``.
        float8 : None, True, "tensorwise", "rowwise" or Float8
            Float8 training by torchao: ``convert_to_float8_training`` on a meta copy (every
            ``nn.Linear``, torchao's default; ``Float8(recipe, filter_fqns=...)`` keeps
            layers in high precision, as torchtitan's ``filter_fqns`` does), with
            ``Float8LinearConfig.from_recipe_name(recipe)``; True is torchao's default,
            ``"tensorwise"``. The weights, their gradients and the optimizer state stay in
            the precision's dtype; the casts to float8 are added. Training only, in fp32,
            bf16 or fp16, on one GPU or on data-parallel ranks (``strategy="ddp"``,
            ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"hsdp"``; FSDP2 gathering the high-precision
            weights, torchao's default); a Linear whose dims are not multiples of 16 is
            refused by name. ``float8_all_gather=True`` (FSDP2 gathering the weights in
            float8): the rank's peak and bytes sent from its own step run on fake tensors
            and the fake process group, with ``checkpoint`` and ``grad_accumulation`` (other
            lever and step settings refused by name); on ``device="cuda"`` a CUDA rank's
            step with 512-byte blocks and no reserved figure, UNCONFIRMED on a GPU
            (``_profiling/float8_fsdp.py``). ``device="cpu"`` runs
            torchao's ``emulate=True`` (what ``measure`` runs on a CPU); ``device="cuda"``
            its ``torch._scaled_mm`` path (the kernel's workspace UNCONFIRMED). Needs
            ``pip install torchao``.
            ``pip install torchao``. ``"nf4-torchao"``: torchao's ``NF4Tensor`` as
            torchtune's QLoRA applies it: its ``LoRALinear(..., quantize_base=True)`` on the
            ``lora_targets``, ``FrozenNF4Linear`` on the other Linear layers (on a
            transformers model, not the output embeddings; elsewhere ``skip_modules``), only
            the adapters trained, in the model's dtype (or ``lora_dtype``); each weight's
            size a multiple of ``blocksize x scaler_blocksize`` (64 x 256); needs ``pip
            install torchao torchtune``.
        expandable_segments : bool
            The caching allocator's ``expandable_segments:True`` for ``reserved_bytes``,
            ``device_bytes``, ``fits_device`` and ``memory_snapshot`` (``device="cuda"``
            only).
        gpus : int
            Data-parallel ranks. The estimate is one rank's training step at ``batch_size``
            samples per rank (the global batch is ``gpus * batch_size``). 1: one device, no
            wrapper. Inference is not wrapped (each rank runs the forward alone).
        strategy : {"ddp", "zero1", "zero2", "zero3", "hsdp"}
            How the ranks share the step (``sharding.STRATEGIES``): ``"ddp"`` is
            ``DistributedDataParallel`` with its defaults, whose flat gradient buckets
            (25 MiB, the first 1 MiB) add the trainable parameters' bytes once more on each
            rank, in ``communication_bytes``. ``"zero1"`` adds
            ``ZeroRedundancyOptimizer``: each rank's optimizer state and step are those of
            its shard of the parameters (ZeRO's own partition); ranks differ, and the
            estimate is the worst one (``est.rank``). ``"zero2"`` and ``"zero3"`` are
            FSDP2's ``fully_shard`` on each repeated block and the root
            (``sharding.fsdp_step_edits``): parameters, gradients and optimizer state are
            each rank's padded dim-0 shards; each unit is all-gathered around its forward
            and backward (``"zero3"`` frees a block's after its forward, ``"zero2"`` keeps
            them) and its gradients reduce-scattered after its backward; ``"hsdp"`` is
            ``"zero3"`` within nodes of ``gpus_per_node``, replicated across. They compose
            with every lever (each micro-batch gathers and reduce-scatters again).
        rank : int, optional
            With ``gpus > 1``: the rank to estimate where ranks differ (ZeRO's shards;
            FSDP2's last ranks hold shorter chunks); None: the worst of the ranks that lead
            on optimizer state or on the step's largest temporaries
            (``sharding._zero_ranks``), rank 0 under FSDP2.
        gpus_per_node : int
            GPUs per node (default 8): ``"hsdp"`` is ``"zero3"`` within a node and
            replicated across nodes; ``gpus`` must be whole nodes (or at most one).
        fsdp_units : str or list of str, optional
            FSDP2's units under ``"zero2"`` / ``"zero3"`` / ``"hsdp"``: module names or
            class names (``"LlamaDecoderLayer"``), outermost matches, besides the root.
            None: each child of the largest ``ModuleList`` of repeated blocks, as
            torchtitan and accelerate wrap. A name that matches nothing is a ValueError.
        new_tokens : int, optional
            With ``mode="generate"`` (and only then): the tokens generated after the
            prompt, >= 1; the prompt plus them must fit the model's
            ``max_position_embeddings``. A generation whose steps cross the model's sliding
            window costs one more profiling run the first time (per precision): a run across
            the window, joined to the prompt's own. A model whose ``generation_config`` asks
            for another cache than the dynamic, static or quantized one is refused by name.
        recipe : Recipe, optional
            The whole setup as one value; the keywords above build one (a keyword that
            asks for something else than ``recipe`` holds is a ValueError).
        **settings
            Any other setting of a :class:`~vram_widget.Recipe` by its flat name
            (:meth:`Recipe.with_ <vram_widget.Recipe.with_>`), e.g.
            ``optimizer_in_backward=True``, ``set_to_none=False``, ``lora_dtype="bf16"``,
            ``context_bytes=...``; an unknown name is a TypeError listing the valid ones.
            ``kv_cache="quantized"`` (with ``mode="generate"``) is transformers'
            ``QuantizedCache`` (quanto backend) in place of the model's own cache, with
            ``kv_bits`` (4 or 2), ``residual_length`` and ``q_group_size`` (transformers'
            ``cache_config`` names; defaults 4, 128 and 64, its own): estimated while
            ``new_tokens <= residual_length`` (a generation across the cache's flush is
            refused by name), on a meta copy whose generation config asks for it (once per
            setting); the three without ``kv_cache="quantized"`` are a ValueError.
            ``tp=k`` (with ``gpus=k``) estimates one of ``k`` tensor-parallel ranks, in
            training or inference: a meta copy of the model sharded by its own plan (a
            Hugging Face model's ``base_model_tp_plan``) or ``tp_plan={pattern:
            ParallelStyle}`` with DTensor on PyTorch's fake process group, profiled once
            per question (``_profiling/tensor_parallel.py``; docs: the guide on several
            GPUs).
            ``pp=k`` (with ``gpus=k``), ``pp_schedule="gpipe"`` / ``"1f1b"`` /
            ``"interleaved-1f1b"`` (with ``stages_per_rank=v``, default 2: rank r holds
            stages r, r + k, ...) and ``microbatches=m`` (default ``k``),
            ``pp_split=["layers.K", ...]`` (the first layer of each stage after the first;
            default: the layers evenly) estimate each of ``k`` pipeline ranks of a Hugging
            Face decoder (fp32 / bf16 training, a ``device="cpu"`` profile):
            ``batch_size`` is the whole step's batch, split into ``m`` micro-batches; each
            rank's step runs as ``torch.distributed.pipelining`` schedules it, on fake
            tensors (``_profiling/pipeline_parallel.py``). ``peak_bytes`` is the worst
            rank's, ``est.stage_peak_bytes`` each rank's (all its stages together).
            With ``tp=t`` too (``gpus=k * t``), each stage is sharded by the model's own
            plan over ``t`` tensor-parallel ranks on a ``("pp", "tp")`` mesh, as torchtitan
            composes them (``_profiling/pipeline_tensor_parallel.py``); rank r holds
            stage r // t.
            ``context_bytes`` (bytes) replaces the CUDA context of
            ``accelerator.cuda_context``'s table, which ``compute_capability`` and
            ``lazy_loading`` (default True, torch's ``CUDA_MODULE_LOADING=LAZY``) pick;
            ``est.extras.cuda_context_source`` says which figure was used and its source.
            ``compile=True`` / ``"model"`` / ``"blocks"`` with ``activation_memory_budget``
            estimates the ``torch.compile`` training step (``est.levers.compile``): Inductor's
            partitioner on fake tensors decides what is saved for the backward, and the
            partitioned graphs run node by node, so each region's temporaries are the eager
            ops' (an upper bound on Inductor's fused kernels; the guide on torch.compile).

        Notes
        -----
        The levers apply in training; a new combination costs one more profiling run
        (cached), as a new precision does.

        Returns
        -------
        MemoryEstimate

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
        >>> est = profile.estimate(batch_size=64, optimizer="sgd")
        >>> est.peak_bytes > est.parameter_bytes
        True

        Generation (a Hugging Face causal LM; this GPT-2's KV cache is 2 layers x keys and
        values x 64 x 4 bytes = 1,024 B per token in fp32; after 8 new tokens on a prompt
        of 20 it holds 20 + 7 tokens of each of 4 sequences):

        >>> import torch, transformers
        >>> gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64))
        >>> prompts = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
        >>> est = profile_model(gpt2, inputs=prompts, device="cpu").estimate(
        ...     4, mode="generate", seq_len=20, new_tokens=8)
        >>> est.kv_cache_bytes_per_token, est.kv_cache_bytes == 4 * 27 * 1024
        (1024, True)
        """
        asked = Recipe.from_keywords(
            recipe,
            batch_size=batch_size,
            precision=precision,
            optimizer=optimizer,
            mode=mode,
            seq_len=seq_len,
            compute_capability=compute_capability,
            checkpoint=checkpoint,
            trainable=trainable,
            grad_accumulation=grad_accumulation,
            lora_rank=lora_rank,
            lora_targets=lora_targets,
            weights=weights,
            float8=float8,
            expandable_segments=expandable_segments,
            gpus=gpus,
            strategy=strategy,
            rank=rank,
            gpus_per_node=gpus_per_node,
            fsdp_units=fsdp_units,
            new_tokens=new_tokens,
            **settings,
        )
        est = self._estimate(asked)
        # what the config the Recipe was read from sets, and what the step runs, that the
        # estimate leaves out: named on the estimate and in a warning, never dropped
        ignored = (*asked.ignored, *_unmodelled_step(asked))
        if len(ignored) > len(asked.ignored):
            warn_ignored("the step", ignored[len(asked.ignored) :])
        return dataclasses.replace(est, ignored=ignored) if ignored else est
