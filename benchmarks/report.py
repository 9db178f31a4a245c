"""Write the benchmark results (benchmarks/results/*.json) into the documentation's tables.

    python benchmarks/report.py

Replaces the text between ``<!-- name -->`` / ``<!-- /name -->`` markers in the pages of
``docs/`` that hold them (``PAGES``: docs/accuracy.md, docs/speed.md and the DeepSpeed table of
docs/guides/multi-gpu.md), so the documentation only ever shows measured numbers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _accuracy() -> str:
    data = json.loads((RESULTS / "accuracy_cpu.json").read_text())
    rows = data["rows"]
    head = (
        f"{len(rows)} configurations (12 zoo models x batch 1, 8, 32 x 7 optimizer settings x "
        f"fp32, bf16, amp-bf16 x train/inference), each estimated from one cached profile and "
        f"measured on a real CPU step; torch {data['torch']}, {data['cpus']} CPUs, "
        f"{data['seconds'] / 60:.0f} minutes. Targets: train median <= 0.5 %, 90th percentile "
        f"<= 2 %, worst <= 5 %; inference median <= 1 %, 90th percentile <= 10 %, worst <= 20 %."
    )
    return head + "\n\n" + data["summary"]


def _isa() -> str:
    """The quick accuracy matrix under the machine's own ISA and under AVX2 (no AVX-512)."""
    lines = [
        "| instruction set (ATen / oneDNN cap; CPU flags) | configurations | train median / "
        "worst | inference median / worst |",
        "|---|---:|---:|---:|",
    ]
    for name in ("native", "avx2"):
        path = RESULTS / f"accuracy_quick_{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        isa = data["isa"]
        cells = []
        for mode in ("train", "inference"):
            errs = sorted(abs(float(r["error_pct"])) for r in data["rows"] if r["mode"] == mode)
            cells.append(f"{errs[len(errs) // 2]:.3f} % / {errs[-1]:.3f} %")
        lines.append(
            f"| {isa['aten_cpu_capability']} / {isa['onednn_max_cpu_isa']}; "
            f"{' '.join(isa['cpu_flags'])} | {len(data['rows'])} | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


def _sweep(name: str, what: str, targets: str) -> str:
    """The documentation's section of one accuracy sweep written by benchmarks/_results.py: what it
    covers, the versions and time it ran with, the targets, and its summary table."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return f"(not run yet: python benchmarks/{name}.py)"
    data = json.loads(path.read_text())
    head = (
        f"{len(data['rows'])} configurations ({what}; torch {data['torch']}, transformers "
        f"{data['transformers']}, {data['cpus']} CPUs, {data['seconds']:.0f} s. Targets: "
        f"{targets}."
    )
    return head + "\n\n" + data["summary"]


def _accuracy_seq() -> str:
    return _sweep(
        "accuracy_seq",
        "Hugging Face GPT-2, BERT, Llama, T5 with eager and SDPA attention, and a torch "
        "TransformerEncoder; batch 1, 3, 8 x 17, 64, 200, 512 tokens x Adam training / "
        "inference, fp32), each estimated from one profile at batch 2 x 16 tokens and "
        "measured on a real CPU step",
        "train median <= 0.1 %, worst <= 2 %; inference worst <= 5 %",
    )


def _accuracy_levers() -> str:
    return _sweep(
        "accuracy_levers",
        "Hugging Face GPT-2, Llama, BERT and the zoo ResNet-50; checkpointing, a frozen "
        "backbone, accumulation of 4 and LoRA rank 8; batch 1 and 8 x fp32 and bf16, AdamW), "
        "each estimated from the plain model's profile and measured on a real CPU step with "
        "the lever applied by the real library (Hugging Face's "
        "activation_checkpointing_enable, torch's checkpoint_wrapper, requires_grad_(False), "
        "the accumulation loop, PEFT's get_peft_model)",
        "median <= 0.1 %, worst <= 2 %",
    )


def _optimizers() -> str:
    return _sweep(
        "accuracy_optimizers",
        "the zoo's MLP and the Hugging Face GPT-2, Llama and BERT at batch 1 and 8 x fp32 and "
        "bf16, the zoo's ResNet-50 at batch 8 in bf16 but for torchao's optimizers; every "
        "optimizer name (torch.optim at its CPU default and each -fused / -foreach / -forloop "
        "form, bitsandbytes' AdamW8bit and PagedAdamW8bit, torchao's AdamW8bit and AdamW4bit, "
        "transformers' Adafactor), a custom torch.optim.Optimizer subclass, and AdamW with "
        "optimizer_in_backward=True and with set_to_none=False), each estimated from the "
        "plain model's profile and measured on a real CPU step with the real library's "
        "optimizer",
        "step peak median <= 0.1 %, worst <= 1 %, over every setting but torchao's, whose "
        "step torch.compile compiles and the estimate traces uncompiled (their rows are "
        "marked and left out)",
    )


def _accuracy_distributed() -> str:
    return _sweep(
        "accuracy_distributed",
        "the zoo's MLP, ResNet-18, TransformerEncoder, causal decoder, tiny Llama and LSTM and "
        "Hugging Face GPT-2, Llama, BERT and T5; DistributedDataParallel with its defaults "
        "(ddp), with ZeroRedundancyOptimizer around AdamW (zero1), and FSDP2's fully_shard "
        "on each repeated block and the root without / with resharding after the forward "
        "(zero2 / zero3), on 2 and 4 ranks x fp32 and bf16 (FSDP2 also amp-bf16 with its "
        "MixedPrecisionPolicy, but on ResNet-18), and HSDP on 2 nodes x 2 ranks "
        "(hsdp), batch 3 per rank; then Hugging "
        "Face's checkpointing, a frozen backbone, accumulation of 2 and PEFT's LoRA under "
        "each strategy on GPT-2 and Llama at 2 ranks; every rank of each run), each rank "
        "estimated from "
        "the single-device profile (estimate(..., rank=r)) and measured in a real "
        "torch.distributed job (gloo, one forked process per rank, the median of its "
        "third to fifth steps)",
        "per-rank median <= 0.5 %, worst <= 3 %",
    )


def _accuracy_parallel() -> str:
    return _sweep(
        "accuracy_parallel",
        "Hugging Face Llama (2 layers, hidden 64, 4 heads, 2 or 4 key/value heads) and Mixtral "
        "(the same shape, 4 experts, 2 per token) under their own tensor-parallel plans, "
        "applied by transformers; a LayerNorm + two Linear block under a ColwiseParallel / "
        "RowwiseParallel plan without and with sequence parallelism; torchtitan 0.3.0's "
        "Llama3Model under a plan of styles splitting its MLPs (w1, w3 ColwiseParallel, w2 "
        "RowwiseParallel); tensor parallelism on 2 and 4 ranks x fp32 and bf16 x AdamW training"
        " and inference; pipeline parallelism of the decoders on 2 ranks x GPipe, 1F1B and "
        "interleaved 1F1B (2 stages a rank) x 2 and 4 micro-batches x fp32 and bf16, AdamW; "
        "FSDP2 (zero3) over tensor-parallel ranks, dp_shard 2 x tp 2 on 4 ranks (also with "
        "activation checkpointing), and HSDP over them, dp_replicate 2 x dp_shard 2 x tp 2 on 8"
        " ranks and dp_replicate 2 x dp_shard 1 x tp 2 on 4, of the Hugging Face and torchtitan"
        " Llamas x fp32 and bf16, AdamW; FSDP2 (zero2, zero3) over pipeline stages, pp 2 x "
        "dp_shard 2 on 4 ranks, HSDP over them, pp 2 x dp_replicate 2 x dp_shard 2 on 8, tensor"
        " parallelism inside pipeline stages, pp 2 x tp 2 on 4 ranks, and FSDP2 over those, pp "
        "2 x dp_shard 2 x tp 2 on 8, of the Hugging Face Llama x the schedules with 2 "
        "micro-batches x fp32 and bf16, AdamW; expert parallelism (ep=2, transformers' ep plan,"
        " routing made balanced) of the Mixtral; batch 4; every rank of each run), each rank "
        "estimated from the single-device profile (estimate(..., tp=k / pp=k / ep=k), with a "
        "data-parallel strategy estimate(..., rank=r), or est.stage_peak_bytes: stage r // (dp "
        "x tp) with pipeline stages) and measured on real gloo ranks (the CPU allocator's "
        "allocated bytes)",
        "per-rank median |ratio - 1| <= 0.5 %, worst <= 3 %",
    )


def _deepspeed_states() -> str:
    path = RESULTS / "deepspeed_states.json"
    if not path.exists():
        return "(not run yet: python benchmarks/deepspeed_states.py)"
    data = json.loads(path.read_text())
    return data["summary"] + f"\n\n(torch {data['torch']}, transformers {data['transformers']})"


def _speed() -> str:
    data = json.loads((RESULTS / "speed.json").read_text())
    rn = data["resnet50_224"]
    est = data["estimate"]
    lines = [
        "| what | measured | target |",
        "|---|---:|---|",
        f"| `torchinfo.summary`, ResNet-50 at 1x3x224x224 | {rn['torchinfo_s']:.2f} s | |",
        f'| `profile_model`, same model, `device="cuda"`: first profile in the process / '
        f"again (warm FakeTensor dispatch cache) | {rn['profile_cuda_first_s']:.2f}"
        f" / {rn['profile_cuda_s']:.2f} s | <= torchinfo (not met) |",
        f'| `profile_model`, same model, `device="cpu"` (real kernel probes): first / again '
        f"| {rn['profile_cpu_first_s']:.2f} / {rn['profile_cpu_s']:.2f} s | |",
    ]
    if "bare_fake_train_step_s" in rn:
        lines.append(
            "| the floor: one bare training step / one forward of the same model under a stock "
            "`FakeTensorMode`, batch 2, nothing recorded (a profile runs three of each) "
            f"| {rn['bare_fake_train_step_s']:.2f} / {rn['bare_fake_forward_s']:.2f} s | |"
        )
    if "real_train_step_b1_s" in rn:
        lines.append(
            "| beside it: a real training step of the same model at batch 1 / one fake step "
            "with a symbolic batch dimension (instead of three concrete runs) "
            f"| {rn['real_train_step_b1_s']:.2f} / {rn['symbolic_batch_train_step_s']:.2f} s | |"
        )
    for key, label in (
        ("floor_resnet50", "ResNet-50 at 224"),
        ("floor_gpt2", "GPT-2 small (SDPA) at 2 x 128 tokens, its sequence axis found"),
    ):
        if key not in data:
            continue
        f = data[key]
        floor = f["bare_train_step_s"] + f["bare_forward_s"]
        lines.append(
            f"| fresh process, {label}: `profile_model(precisions=('fp32',))` (fp32 training, "
            "inference and Adam profiled up front) again / the floor (one bare fake "
            f"training step + one bare forward, same process) "
            f"| {f['profile_again_s']:.2f} / {floor:.2f} s = "
            f"{f['profile_over_floor']:.1f}x | <= 2.5x "
            f"({'met' if f['profile_over_floor'] <= 2.5 else 'not met'}) |"
        )
        if "default_profile_s" in f:
            lines.append(
                "| ... `profile_model` with its defaults (the check that the model runs; "
                "every run deferred) / then its first fp32 / Adam estimate "
                f"| {f['default_profile_s']:.2f} / {f['default_then_estimate_s']:.2f} s | |"
            )
        lines.append(
            f"| ... first profile of it in the process / again "
            f"| {f['profile_first_s']:.2f} / {f['profile_again_s']:.2f} s = "
            f"{f['first_over_again']:.1f}x | <= 2x "
            f"({'met' if f['first_over_again'] <= 2 else 'not met'}) |"
        )
        if "one_run_per_mode_over_floor" in f:
            lines.append(
                "| ... its parts alone: one recorded training run / one recorded forward (batch "
                "2) / the optimizer's trace; a profile of one run per mode, unchecked / of two "
                "per mode, the least a fit checked at a second batch size costs "
                f"| {f['recorded_train_s']:.2f} / {f['recorded_forward_s']:.3f} / "
                f"{f['optimizer_trace_s']:.3f} s; {f['one_run_per_mode_over_floor']:.2f}x / "
                f"{f['two_runs_per_mode_over_floor']:.2f}x the floor | |"
            )
            lines.append(
                "| ... the bare step and forward at a batch size the process has not run "
                "(the fake dispatch cache cold for their shapes) / warm "
                f"| {f['bare_train_step_cold_s'] + f['bare_forward_cold_s']:.2f} / "
                f"{floor:.2f} s = {f['cold_over_warm']:.1f}x | |"
            )
        if "first_other_length_s" in f:
            lines.append(
                "| ... first estimate at another length (fits the profile in the length and "
                "the attention kernel's padding, once) / any length after that "
                f"| {f['first_other_length_s']:.1f} s / {f['other_length_after_fit_ms']:.2f} ms "
                "| |"
            )
    lines += [
        f"| `estimate()`, {est['modules']}-module ResNet-101, median / p90 "
        f"| {est['estimate_median_ms']:.2f} / {est['estimate_p90_ms']:.2f} ms | <= 2 ms median |",
    ]
    for key, what in (
        ("replay", "ResNet-50 at 224, batch 32, fp32, AdamW"),
        ("replay_llama_7b", "Llama-7B shape, batch 8 x 128 tokens, bf16, AdamW"),
    ):
        if key not in data:
            continue
        r = data[key]
        if "reference_replay_ms" not in r:  # results of the class-based replay alone
            lines.append(
                f"| caching-allocator replay, {what} ({r['events']:,} events), median: plain / "
                f"expandable_segments / `device_bytes` | {r['replay_ms']:.1f} / "
                f"{r['replay_expandable_ms']:.1f} / {r['device_bytes_ms']:.0f} ms "
                "| <= 5 ms (Llama-7B) |"
            )
            continue
        lines.append(
            f"| caching-allocator replay, {what} ({r['events']:,} events), cold, median: plain "
            f"/ expandable_segments (the class-based reference, same process: "
            f"{r['reference_replay_ms']:.1f} / {r['reference_replay_expandable_ms']:.1f} ms); "
            f"`device_bytes` of a fresh estimate ({r['device_bytes_replays']} replays"
            + (
                f", the capped ones from checkpoints: {r['device_bytes_in_replays']:.1f} plain "
                "replays' time"
                if "device_bytes_in_replays" in r
                else ""
            )
            + f") / of another estimate of the same setting (remembered) | {r['replay_ms']:.1f} / "
            f"{r['replay_expandable_ms']:.1f} ms; {r['device_bytes_ms']:.1f} / "
            f"{r['device_bytes_remembered_ms']:.2f} ms | <= 5 ms (Llama-7B) |"
        )
    if "llama_7b_meta" in data:
        ll = data["llama_7b_meta"]
        lines.append(
            f"| Llama-7B shape on the meta device: profile + bf16/AdamW estimate, peak RSS "
            f"| {ll['seconds']:.1f} s, {ll['max_rss_bytes'] / 2**30:.2f} GiB | < 2 GB |"
        )
        lines.append(
            f"| ... its parameters vs the closed form | {ll['param_count']:,} vs "
            f"{ll['closed_form']:,} | equal |"
        )
        if "replay_ms" in ll:
            lines.append(
                f"| ... the caching-allocator replay of its step at batch 8 (bf16, AdamW; "
                f"{ll['replay_events']:,} events), the first in a fresh process: time; "
                f"reserved vs allocated peak | {ll['replay_ms']:.1f} ms; "
                f"{ll['reserved_bytes_bf16_adamw_b8'] / 2**30:.1f} "
                f"vs {ll['peak_bytes_bf16_adamw_b8'] / 2**30:.1f} GiB | <= 5 ms (Llama-7B) |"
            )
    if "hf_llama_7b_meta" in data:
        hf = data["hf_llama_7b_meta"]
        lines.append(
            "| `transformers.LlamaForCausalLM`, Llama-2-7B config, on the meta device: profile "
            "+ bf16/AdamW estimate, peak RSS; peak at batch 8 x 128 tokens; largest batch on "
            f"80 GiB (device basis) | {hf['seconds']:.1f} s, "
            f"{hf['max_rss_bytes'] / 2**30:.2f} GiB; "
            f"{hf['peak_bytes_bf16_adamw_b8'] / 2**30:.1f} GiB; "
            f"{hf['max_batch_80gib_bf16_adamw']} | < 2 GB |"
        )
    if "llama_70b_meta" in data:
        big = data["llama_70b_meta"]
        lines.append(
            "| `transformers.LlamaForCausalLM`, Llama-2-70B config (SDPA), on the meta device, "
            "disk cache off: build + `profile_model` + first bf16 / AdamW estimate at 1 x 128 "
            "tokens; then at 4,096 tokens (from the start); peak RSS; the floor, one bare bf16 "
            f"fake training step | {big['first_answer_from_start_s']:.1f} s; "
            f"{big['answer_4k_from_start_s']:.1f} s; {big['max_rss_bytes'] / 2**30:.2f} GiB; "
            f"{big['bare_bf16_train_step_s']:.1f} s | <= 15 s; <= 25 s |"
        )
    widget = RESULTS / "widget_latency.json"
    if widget.exists():
        w = json.loads(widget.read_text())
        labels = {
            "resnet50_3x64x64": "ResNet-50 (3x64x64)",
            "gpt2_small_batch": "GPT-2 small (12 layers, 128 tokens)",
            "gpt2_small_seq_frontier": "GPT-2 small, frontier panel open",
        }
        for key, label in labels.items():
            if key not in w:
                continue
            r = w[key]
            lines.append(
                f"| widget: batch-size move -> estimate -> figure, headline and bar, {label}, "
                '`device="cuda"`, median of the batch moves in an event loop: wall / the '
                f"process's CPU time | {r['batch_only_median_ms']:.1f} / "
                f"{r['batch_only_cpu_median_ms']:.1f} ms | <= 5 ms |"
            )
            lines.append(
                "| ... what waits for the controls to rest 0.15 s (`device_bytes`, a new "
                "setting's largest batch, the longest sequence, the GPUs needed, the details, "
                f"the layers table), median | {r['at_rest_median_ms']:.0f} ms | |"
            )
        lines.append(
            f"| widget: any move of a 1,000-module model, median "
            f"| {w['sequential_1000_modules']['median_ms']:.1f} ms | <= 50 ms |"
        )
    browser = RESULTS / "browser_latency.json"
    if browser.exists():
        b = json.loads(browser.read_text())
        lines.append(
            f"| browser: batch-slider key press -> redrawn figure, JupyterLab in headless "
            f"Chromium, median / p90 of {b['moves']} moves ({b['notebook']}) "
            f"| {b['median_ms']:.0f} / {b['p90_ms']:.0f} ms | <= 100 ms median |"
        )
    return "\n".join(lines)


def _accuracy_cuda() -> str:
    """The real-GPU check (benchmarks/accuracy_cuda.py): allocated, reserved, the out-of-memory
    line and the CUDA context, estimated against the real step."""
    path = RESULTS / "accuracy_cuda.json"
    if not path.exists():
        return "No real-GPU results are recorded."
    data = json.loads(path.read_text())
    mib = 1 << 20
    lines = [
        f"{data['gpu']} ({data['total_memory_bytes'] / 2**30:.1f} GiB), compute capability "
        f"{'.'.join(map(str, data['compute_capability']))}, torch {data['torch']} (CUDA "
        f"{data['cuda']}), module loading {data['lazy_loading']}. Each ratio is estimate / "
        "real; allocated includes the cuBLAS workspace on both sides. The allocated peak is "
        "estimated twice: the tensors' own bytes (`peak_bytes`), and the replayed caching "
        "allocator's blocks, each charged in full (`allocator.peak_allocated_bytes`, which is "
        "`allocated_bytes` with the workspace): what `max_memory_allocated` counts.",
        "",
        "| model | setting | allocated peak, tensors (est / real) | allocated peak, blocks "
        "(est / real) | reserved peak (est / real) | least cap that runs (est / real) | "
        "CUDA context (est / real) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        setting = f"{r['mode']}, batch {r['batch_size']}, {r['precision']}" + (
            f", {r['optimizer']}" if r["optimizer"] else ""
        )
        if "error" in r:
            lines.append(f"| {r['model']} | {setting} | {r['error']} | | | | |")
            continue
        e, real = r["estimate"], r["real"]
        blocks = e["replay_allocated_peak_bytes"]
        real_allocated = real["allocated_peak_bytes"]
        cap = (
            f"{r['estimated_cap_bytes'] / mib:,.0f} / {r['least_cap_bytes'] / mib:,.0f} MiB "
            f"({r['ratio_cap']:.3f})"
            if "least_cap_bytes" in r
            else ""
        )
        lines.append(
            f"| {r['model']} | {setting} | "
            f"{(e['peak_bytes'] + e['cublas_workspace_bytes']) / mib:,.0f} / "
            f"{real_allocated / mib:,.0f} MiB ({r['ratio_allocated']:.3f}) | "
            f"{blocks / mib:,.0f} / {real_allocated / mib:,.0f} MiB "
            f"({blocks / real_allocated:.3f}) | "
            f"{e['reserved_peak_bytes'] / mib:,.0f} / {real['reserved_peak_bytes'] / mib:,.0f} "
            f"MiB ({r['ratio_reserved']:.3f}) | {cap} | "
            f"{e['context_bytes'] / mib:,.0f} / {real['context_bytes'] / mib:,.0f} MiB |"
        )
    return "\n".join(lines)


def _fresh_speed() -> str:
    """What a person waits for, each in a fresh process, cold and warm cache
    (benchmarks/fresh_speed.py)."""
    path = RESULTS / "fresh_speed.json"
    if not path.exists():
        return "Not measured yet: run `python3 benchmarks/fresh_speed.py`."
    data = json.loads(path.read_text())

    def s(x: float) -> str:
        return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.1f} s"

    lines = [
        f"{data['cpus']} CPUs, Python {data['python']}; each time inside a fresh process "
        "(imports and building the model apart, shown last).",
        "",
        "| what | cold cache | warm cache | target |",
        "|---|---:|---:|---|",
    ]
    widgets = {"resnet50": "ResNet-50 at 224", "gpt2": "GPT-2 small, 2 x 128 tokens"}
    for key, label in widgets.items():
        if key not in data:
            continue
        cold, warm = data[key]["cold"], data[key]["warm"]
        rows = [
            ("`show_memory(..., device='cuda')` to its first figure", "show_memory_s", ""),
            ("a batch-slider move (median of 20, event loop running)", "move_median_s", "<= 5 ms"),
            ("a new precision (bf16)", "new_precision_s", ""),
            ("a new lever (checkpointing)", "new_lever_s", ""),
            ("a new sequence length (512)", "new_seq_len_s", ""),
            ("imports / building the model", "import_s", ""),
        ]
        for what, field, target in rows:
            if field in cold:
                extra = f" / {s(cold['build_s'])}" if field == "import_s" else ""
                extra_w = f" / {s(warm['build_s'])}" if field == "import_s" else ""
                lines.append(
                    f"| {label}: {what} | {s(cold[field])}{extra} | {s(warm[field])}{extra_w} "
                    f"| {target} |"
                )
    llamas = {"llama2-7b": "Llama-2-7B", "llama2-70b": "Llama-2-70B"}
    for key, label in llamas.items():
        if key not in data:
            continue
        cold, warm = data[key]["cold"], data[key]["warm"]
        target = " | <= 15 s / <= 25 s" if key == "llama2-70b" else " |"
        lines.append(
            f"| {label}'s shape on meta: `profile_model` + first bf16/AdamW answer / + an "
            f"answer at 4,096 tokens (from the build) | "
            f"{s(cold['build_s'] + cold['first_bf16_s'])} / "
            f"{s(cold['build_s'] + cold['at_4096_s'])} | "
            f"{s(warm['build_s'] + warm['first_bf16_s'])} / "
            f"{s(warm['build_s'] + warm['at_4096_s'])}{target} |"
        )
        lines.append(
            f"| ... peak RSS | {cold['max_rss_bytes'] / 2**30:.2f} GiB | "
            f"{warm['max_rss_bytes'] / 2**30:.2f} GiB | |"
        )
    return "\n".join(lines)


def _levers_cuda() -> str:
    """The activation levers on a real GPU (benchmarks/levers_cuda.py)."""
    path = RESULTS / "levers_cuda.json"
    if not path.exists():
        return "No real-GPU results are recorded."
    data = json.loads(path.read_text())
    mib = 1 << 20
    lines = [
        f"{data['gpu']}, torch {data['torch']}; bf16, AdamW, batch 4 x 512 tokens; allocated "
        "peak (`max_memory_allocated`) measured by `measure()`, against the estimate's "
        "`allocated_bytes` (the caching allocator's blocks, each charged in full) and its "
        "`peak_bytes` (the tensors' own bytes).",
        "",
        "| model | lever | measured | `allocated_bytes` | ratio | `peak_bytes` | ratio | "
        "host (estimated) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        host = f"{r['host_bytes'] / mib:,.0f} MiB" if r.get("host_bytes") else ""
        peak = f"{r['estimated_bytes'] / mib:,.0f} MiB" if "estimated_bytes" in r else ""
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['lever']} | not measured ({r['error'].split(':')[0]}) "
                f"| | | {peak} | | {host} |"
            )
            continue
        lines.append(
            f"| {r['model']} | {r['lever']} | {r['measured_bytes'] / mib:,.0f} MiB | "
            f"{_allocated(r)} | {peak} | {r['ratio']:.3f} | {host} |"
        )
    return "\n".join(lines)


def _allocated(r: dict[str, Any]) -> str:
    """A row's ``allocated_bytes`` estimate and its ratio to the measured peak, as two
    cells (empty where the row has none: rows recorded before it existed, generation)."""
    if r.get("estimated_allocated_bytes") is None:
        return " | "
    ratio = r["estimated_allocated_bytes"] / r["measured_bytes"]
    return f"{r['estimated_allocated_bytes'] / (1 << 20):,.0f} MiB | {ratio:.3f}"


def _compile_cuda() -> str:
    """torch.compile's step on a real GPU, measured (benchmarks/compile_cuda.py), with the
    estimate of each setting (``--estimate``) where it was made."""
    path = RESULTS / "compile_cuda.json"
    if not path.exists():
        return "No real-GPU results are recorded."
    data = json.loads(path.read_text())
    mib = 1 << 20

    def size(r: dict[str, Any], key: str) -> str:
        return f"{r[key] / mib:,.0f} MiB" if key in r else ""

    lines = [
        f"{data['gpu']}, torch {data['torch']}; bf16, AdamW, batch 4 x 512 tokens; allocated "
        "peak (`max_memory_allocated`) measured by `measure()`, and the estimate from "
        '`profile_model(device="cuda")` of the plain model (compiled settings: Inductor\'s '
        "CPU buffer plan, UNCONFIRMED against Triton's).",
        "",
        "| model | step | measured | estimated | ratio | partitioned graphs run node by node "
        "| partitioner's saved set | estimated saved set |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        if "error" in r:
            measured = f"not run ({r['error'].split(':')[0]})"
        else:
            measured = size(r, "measured_bytes")
        ratio = ""
        if "measured_bytes" in r and "estimated_bytes" in r:
            ratio = f"{r['estimated_bytes'] / r['measured_bytes']:.3f}"
        est = size(r, "estimated_bytes")
        if "estimate_error" in r:
            est = f"not estimated ({r['estimate_error'].split(':')[0]})"
        lines.append(
            f"| {r['model']} | {r['setting']} | {measured} | {est} | {ratio} | "
            f"{size(r, 'graphs_measured_bytes')} | {size(r, 'partitioner_saved_bytes')} | "
            f"{size(r, 'estimated_saved_bytes')} |"
        )
    return "\n".join(lines)


def _quantized_cuda() -> str:
    """Quantized weights and float8 training on a real GPU (benchmarks/quantized_cuda.py)."""
    path = RESULTS / "quantized_cuda.json"
    if not path.exists():
        return "No real-GPU results are recorded."
    data = json.loads(path.read_text())
    mib = 1 << 20
    versions = ", ".join(
        f"{k} {data[k]}" for k in ("torch", "bitsandbytes", "torchao") if k in data
    )
    lines = [
        f"{data['gpu']}, {versions}; bf16; allocated peak (`max_memory_allocated`) measured "
        "by `measure()`, against the estimate's `allocated_bytes` (the caching allocator's "
        "blocks, each charged in full; generation has no allocator replay yet) and its "
        "`peak_bytes` (the tensors' own bytes).",
        "",
        "| model | setting | measured | `allocated_bytes` | ratio | `peak_bytes` | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        if "error" in r:
            measured = f"not run ({r['error'].split(':')[0]})"
        else:
            measured = f"{r['measured_bytes'] / mib:,.0f} MiB"
        if "estimated_bytes" in r:
            est, ratio = f"{r['estimated_bytes'] / mib:,.0f} MiB", f"{r['ratio']:.3f}"
            allocated = _allocated(r)
        else:
            est, ratio, allocated = "not estimated", "", " | "
        lines.append(
            f"| {r['model']} | {r['setting']} | {measured} | {allocated} | {est} | {ratio} |"
        )
    return "\n".join(lines)


def _accuracy_compile() -> str:
    """The compiled step's estimate against the measured one on the CPU
    (benchmarks/accuracy_compile.py)."""
    path = RESULTS / "accuracy_compile.json"
    if not path.exists():
        return (
            "Not run yet: `python benchmarks/accuracy_compile.py`, then "
            "`python benchmarks/report.py`."
        )
    data = json.loads(path.read_text())
    models = ", ".join(dict.fromkeys(r["model"] for r in data["rows"]))
    grid = {
        "quick": "the quick grid only (`--quick`: the MLP and Llama, batch 4, fp32)",
        "full": f"the full grid ({models})",
        "partial": f"the grid's first models only ({models}); the others are still to be run",
        "merged": f"the full grid ({models}), its settings run in several invocations "
        "(`--merge`; the minutes are the last one's)",
    }.get(data.get("grid", ""), "an earlier grid (AdamW, batch 4)")
    head = (
        f"{len(data['rows'])} configurations, {grid}; torch {data['torch']}, transformers "
        f"{data['transformers']}, {data['cpus']} CPUs, {data['seconds'] / 60:.0f} minutes. "
        "Peaks in bytes (allocated, CPU), AdamW; compiled: `measure(compile=...)` with "
        '`True` (the whole model, "model") or `"blocks"` (each repeated block), Inductor\'s '
        "generated code; graphs: the same partitioned graphs run node by node; "
        'estimate: `profile_model(device="cpu").estimate(compile=..., '
        "activation_memory_budget=...)`; saved: what the forward leaves for the backward, "
        "less its outputs. Targets: the peak and the saved set to the byte."
    )
    return head + "\n\n" + data["summary"]


def _accuracy_quantized() -> str:
    """Quantized weights and float8 training, estimated against the real libraries' step on
    the CPU (benchmarks/accuracy_quantized.py)."""
    path = RESULTS / "accuracy_quantized.json"
    if not path.exists():
        return (
            "Not run yet: `python benchmarks/accuracy_quantized.py`, then "
            "`python benchmarks/report.py`."
        )
    data = json.loads(path.read_text())
    versions = ", ".join(
        f"{k} {data[k]}" for k in ("torch", "transformers", "bitsandbytes", "torchao", "peft")
        if k in data
    )  # fmt: skip
    grid = {
        "quick": "the quick grid only (`--quick`: the Llama, batch 1, 16 tokens); the full "
        "grid is still to be run",
        "mixed": "some formats from the quick grid, some from the full one",
    }.get(data.get("grid", "full"), "the full grid")
    seconds = f"{data['seconds']:.0f} s"
    if "rerun" in data:  # written by --only: the earlier run's time, then the rerun's
        seconds = (
            f"{data['seconds_before']:.0f} s, then {seconds} rerunning {', '.join(data['rerun'])}"
        )
    head = (
        f"{versions}; {data['cpus']} CPUs, {seconds}; {grid}. Peaks are "
        "allocated bytes on the CPU; ratio: estimate / measured. Storage: each quantized "
        "layer's weight with its quant state, the estimate's stored layout against the real "
        "library's tensors, layer by layer."
    )
    return head + "\n\n" + data["summary"]


# Which page of docs/ holds each marked section.
PAGES = {
    "accuracy": "docs/accuracy.md",
    "accuracy-seq": "docs/accuracy.md",
    "accuracy-levers": "docs/accuracy.md",
    "optimizers": "docs/accuracy.md",
    "accuracy-distributed": "docs/accuracy.md",
    "accuracy-parallel": "docs/accuracy.md",
    "accuracy-cuda": "docs/accuracy.md",
    "levers-cuda": "docs/accuracy.md",
    "compile-cuda": "docs/accuracy.md",
    "quantized-cuda": "docs/accuracy.md",
    "accuracy-compile": "docs/accuracy.md",
    "accuracy-quantized": "docs/accuracy.md",
    "isa": "docs/accuracy.md",
    "deepspeed-states": "docs/guides/multi-gpu.md",
    "speed": "docs/speed.md",
    "fresh-speed": "docs/speed.md",
}


def main() -> None:
    sections = {
        "accuracy": _accuracy(),
        "accuracy-seq": _accuracy_seq(),
        "accuracy-levers": _accuracy_levers(),
        "optimizers": _optimizers(),
        "accuracy-distributed": _accuracy_distributed(),
        "accuracy-parallel": _accuracy_parallel(),
        "accuracy-cuda": _accuracy_cuda(),
        "levers-cuda": _levers_cuda(),
        "compile-cuda": _compile_cuda(),
        "quantized-cuda": _quantized_cuda(),
        "accuracy-compile": _accuracy_compile(),
        "accuracy-quantized": _accuracy_quantized(),
        "deepspeed-states": _deepspeed_states(),
        "isa": _isa(),
        "speed": _speed(),
        "fresh-speed": _fresh_speed(),
    }
    for page in sorted(set(PAGES.values())):
        path = ROOT / page
        text = path.read_text()
        for name, body in sections.items():
            if PAGES[name] != page:
                continue
            if f"<!-- {name} -->" not in text:
                raise SystemExit(f"{page} has no <!-- {name} --> ... <!-- /{name} --> section")
            pattern = re.compile(rf"<!-- {name} -->.*?<!-- /{name} -->", re.S)
            text = pattern.sub(lambda _m, n=name, b=body: f"<!-- {n} -->\n{b}\n<!-- /{n} -->", text)
        path.write_text(text)


if __name__ == "__main__":
    main()
