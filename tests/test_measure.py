"""Tests for ``measure``: the real, measured step the estimate is checked against.

The CPU numbers below are worked out by hand from what PyTorch allocates; each test says
which tensors are live at the peak. Two kernel details recur:

* ``output.float().mean()`` (the default loss) allocates the 4-byte loss; ``.float()`` of a
  float32 tensor is the tensor itself.
* A Python float passed to a tensor op (``t / 2.0``, ``t.mul_(0.999)``) is wrapped into a 0-dim
  float64 tensor (8 B), which the CPU kernel copies to the op's dtype (4 B for float32); both
  die with the op. They matter only where they are live at the peak (Adam's ``denom``).
"""

from __future__ import annotations

import copy
import gc
import weakref
from itertools import pairwise

import pytest
import torch
from models import hf_gpt2
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vram_widget._estimating.options import Mode, OptimizerName, Precision, parse_optimizer
from vram_widget._profiling.cpu_trace import _MARKER, _cpu_trace
from vram_widget._profiling.measure import measure
from vram_widget._profiling.measure_session import _measure
from vram_widget._profiling.measurement import Measurement
from vram_widget._profiling.probe import KernelProbe
from vram_widget._profiling.step import (
    ModelInputs,
    cast_floating,
    inference_pass,
    make_optimizer,
    storage_dtype,
    training_iteration,
)

aten = torch.ops.aten


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(10, 20, bias=False)


def _x() -> torch.Tensor:
    return torch.randn(4, 10)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _chain_is_consistent(events) -> bool:
    """Each event's running total is the previous one plus its own bytes (no event missing
    or out of order between them: the allocator updates the total under its lock)."""
    return all(b.total_allocated == a.total_allocated + b.nbytes for a, b in pairwise(events))


# --------------------------------------------------------------------------------------------
# The CPU allocator's events: order, completeness
# --------------------------------------------------------------------------------------------


def test_allocator_events_in_order_simple() -> None:
    # empty(1000) = 4000 B, then empty(500) = 2000 B: 6000 B live, then both freed.
    from torch.profiler import ProfilerActivity, profile, record_function

    with (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
        record_function(_MARKER),
    ):
        a = torch.empty(1000)
        b = torch.empty(500)
        del a, b
    trace = _cpu_trace(prof)
    assert [e.nbytes for e in trace.during] == [4000, 2000, -4000, -2000]
    assert trace.peak_above_start() == 6000
    assert _chain_is_consistent(trace.during)


def test_trace_is_complete_and_ordered() -> None:
    _, trace = _measure(_mlp(), torch.randn(8, 32), None, "adam", "fp32", "train")
    assert trace is not None
    everything = trace.before + trace.during + trace.after
    assert _chain_is_consistent(everything)
    assert sum(e.nbytes for e in everything) == 0  # all measure allocated, it freed
    assert sum(e.nbytes for e in trace.during) == 0  # steady state: the step gives all back
    times = [e.time_ns for e in everything]
    assert times == sorted(times)


def test_resident_matches_the_allocator() -> None:
    # The resident bytes (unique storages of parameters, buffers, optimizer state, inputs)
    # are exactly what the allocator handed out, net, before iteration 2.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    result, trace = _measure(model, torch.randn(2, 3, 8, 8), None, "adamw", "fp32", "train")
    assert trace is not None
    assert result.resident_bytes == sum(e.nbytes for e in trace.before)


# --------------------------------------------------------------------------------------------
# Hand-worked numbers
# --------------------------------------------------------------------------------------------


def test_linear_sgd_by_hand() -> None:
    # Resident: weight 20x10 fp32 = 800 B, input 4x10 = 160 B -> 960 B.
    # Peak, in backward, when MmBackward allocates the weight's gradient:
    #   output 4x20 = 320 (held until the iteration ends), loss 4,
    #   grad of loss (ones_like) 4, grad of output (MeanBackward: expand / 80) 320,
    #   weight gradient 800  ->  1448 B above resident.
    # SGD without momentum updates in place (param.add_(grad, alpha=-lr)): no temporaries.
    m = measure(_linear(), _x(), optimizer="sgd")
    assert m.resident_bytes == 960
    assert m.peak_bytes == 960 + 320 + 4 + 4 + 320 + 800 == 2408
    assert m.transient_bytes == 1448
    assert (m.device, m.precision, m.optimizer, m.mode, m.batch_size) == (
        "cpu",
        Precision.FP32,
        OptimizerName.SGD,
        Mode.TRAIN,
        4,
    )
    assert m.max_reserved_bytes is None


def test_linear_sgd_momentum_by_hand() -> None:
    # Resident adds the momentum buffer (800 B): 1760 B. The step's temporaries (the wrapped
    # momentum scalar, 12 B) stay far below the backward peak, which is unchanged: 1448 B.
    m = measure(_linear(), _x(), optimizer="sgd-momentum")
    assert m.resident_bytes == 800 + 160 + 800 == 1760
    assert m.peak_bytes == 1760 + 1448 == 3208


def test_linear_adam_by_hand() -> None:
    # Resident: weight 800 + input 160 + exp_avg 800 + exp_avg_sq 800 + step (0-dim fp32) 4
    #   = 2564 B.
    # The CPU default is the single-tensor loop (torch/optim/adam.py, _single_tensor_adam):
    # step_t += 1, exp_avg.lerp_, exp_avg_sq.mul_().addcmul_() are in place; then
    #   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    # allocates sqrt (800) and the division (800) while sqrt is alive. At that moment live:
    #   output 320 + loss 4 + weight grad 800   (end of backward: 1124)
    #   + sqrt 800 + wrapped bias_correction2_sqrt (float64 8 + its float32 copy 4) + div 800
    #   = 2736 B above resident, more than backward's 1448.
    m = measure(_linear(), _x(), optimizer="adam")
    assert m.resident_bytes == 800 + 160 + 800 + 800 + 4 == 2564
    assert m.peak_bytes == 2564 + 320 + 4 + 800 + 800 + 8 + 4 + 800 == 5300


def test_linear_inference_by_hand() -> None:
    # Resident: weight 800 + input 160 (no optimizer state in inference) = 960 B.
    # Peak: the output, 320 B (no autograd graph under no_grad).
    m = measure(_linear(), _x(), optimizer="adam", mode="inference")
    assert m.resident_bytes == 960
    assert m.peak_bytes == 960 + 320 == 1280
    assert m.optimizer is None and m.mode is Mode.INFERENCE


def test_parameter_free_model_skips_the_optimizer() -> None:
    # ReLU on a 4x10 input: resident = input 160 B; the loss needs no backward.
    # Peak: relu output 160 + loss 4 + mean's wrapped divisor (8 + 4) = 176 B above resident.
    m = measure(nn.ReLU(), torch.randn(4, 10), optimizer="adam")
    assert m.optimizer is None
    assert m.resident_bytes == 160
    assert m.peak_bytes == 160 + 160 + 4 + 8 + 4


def test_resident_in_half_precision_is_exact() -> None:
    # MLP 32-64-8: 2632 parameters. Adam: params + exp_avg + exp_avg_sq in the storage dtype,
    # plus one float32 step per parameter tensor (4 tensors x 4 B); input 1x32.
    fp32 = measure(_mlp(), torch.randn(1, 32), precision="fp32")
    bf16 = measure(_mlp(), torch.randn(1, 32), precision="bf16")
    amp = measure(_mlp(), torch.randn(1, 32), precision="amp-bf16")
    assert fp32.resident_bytes == 3 * 2632 * 4 + 16 + 32 * 4 == 31728
    assert bf16.resident_bytes == 3 * 2632 * 2 + 16 + 32 * 2 == 15872
    assert amp.resident_bytes == fp32.resident_bytes  # fp32 master weights and inputs


# --------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------


def _bf16_linear_scratch_bytes(x: torch.Tensor) -> int:
    """The most scratch this CPU's bf16 ``addmm`` kernels allocate inside one call of the
    MLP's two layers, measured here by the probe: where oneDNN has a native bf16 path
    (avx512_bf16, AMX) it packs the operands into blocks it allocates; elsewhere it may not."""
    probe = KernelProbe()
    bf = torch.bfloat16
    w1, w2 = torch.zeros(32, 64, dtype=bf), torch.zeros(64, 8, dtype=bf)
    sigs = [
        probe.request(aten.addmm.default, (torch.zeros(64, dtype=bf), x.to(bf), w1), {}),
        probe.request(
            aten.addmm.default, (torch.zeros(8, dtype=bf), torch.zeros(16, 64, dtype=bf), w2), {}
        ),
    ]
    return max(probe.workspace_bytes(sig) for sig in sigs)


def test_bf16_peak_below_fp32() -> None:
    # bf16 halves every tensor of the step; the CPU kernel's own scratch is what it is on this
    # processor (measured here, not assumed), so the comparison leaves it out. Without the
    # scratch term this test failed on a CPU with avx512_bf16: 27,664 B (bf16) vs 20,768 B.
    # (Not fp16 on CPU: its addmm allocates a float32 scratch block larger than what the
    # half-size weights save at this size.)
    x = torch.randn(16, 32)
    scratch = _bf16_linear_scratch_bytes(x)
    assert scratch >= 0
    for mode in ("train", "inference"):
        fp32 = measure(_mlp(), x, mode=mode)
        bf16 = measure(_mlp(), x, precision="bf16", mode=mode)
        # every stored tensor halves, but Adam's four float32 step counters (4 x 4 B)
        steps = 16 if mode == "train" else 0
        assert (bf16.resident_bytes - steps) * 2 == fp32.resident_bytes - steps
        assert bf16.peak_bytes - scratch < fp32.peak_bytes, (mode, scratch)


def test_larger_batch_larger_peak() -> None:
    one = measure(_mlp(), torch.randn(1, 32))
    eight = measure(_mlp(), torch.randn(8, 32))
    assert eight.peak_bytes > one.peak_bytes
    assert (one.batch_size, eight.batch_size) == (1, 8)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rmsprop", None])
def test_every_setting_runs(precision: str, optimizer: str | None) -> None:
    m = measure(_mlp(), torch.randn(2, 32), optimizer=optimizer, precision=precision)
    assert m.peak_bytes > m.resident_bytes > 0
    assert m.precision == precision


# --------------------------------------------------------------------------------------------
# Independent check: live storages seen by a TorchDispatchMode on real tensors
# --------------------------------------------------------------------------------------------


class _LiveStorages(TorchDispatchMode):
    """Sums the bytes of the storages ops create, from creation until the storage dies
    (a weakref finalizer on the storage object, which PyTorch keeps alive as long as the
    storage). Blocks a kernel allocates internally are invisible here."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _died(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.known and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    weakref.finalize(storage, self._died, key)
        self.peak = max(self.peak, self.current)
        return out


def _dispatch_peak(model: nn.Module, x: torch.Tensor, optimizer: str | None, mode: str) -> int:
    """The same protocol, measured by ``_LiveStorages`` instead of the profiler."""
    run_mode = Mode(mode)
    dtype = storage_dtype(Precision.FP32)
    clone = copy.deepcopy(model).train(run_mode is Mode.TRAIN)
    inputs = ModelInputs.from_user(cast_floating(x, dtype).clone())
    params = [p for p in clone.parameters() if p.requires_grad]
    name = parse_optimizer(optimizer)
    opt = make_optimizer(name, params) if name is not None and run_mode is Mode.TRAIN else None

    def iterate() -> None:
        if run_mode is Mode.TRAIN:
            training_iteration(clone, inputs, None, opt, Precision.FP32, "cpu", params=params)
        else:
            inference_pass(clone, inputs, Precision.FP32, "cpu")

    iterate()
    resident = [*clone.parameters(), *clone.buffers(), *inputs.tensors()]
    if opt is not None:
        resident += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in resident}
    resident_bytes = sum(s.nbytes() for s in storages.values())
    tracker = _LiveStorages({id(s) for s in storages.values()})
    gc.disable()
    try:
        with tracker:
            iterate()
    finally:
        gc.enable()
    return resident_bytes + tracker.peak


@pytest.mark.parametrize(
    ("model", "shape", "optimizer", "mode", "profiler_only"),
    [
        # no kernel-internal block at the peak: both agree to the byte
        (_linear, (4, 10), "sgd", "train", 0),
        (_linear, (4, 10), "adam", "inference", 0),
        (
            lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True),
            (2, 9, 32),
            "adagrad",
            "train",
            0,
        ),
        # Adam's peak is at `sqrt / bias_correction2_sqrt`: the wrapped Python float (8 B)
        # and its float32 copy (4 B) are made outside any op's outputs
        (_linear, (4, 10), "adam", "train", 12),
        (_mlp, (16, 32), "adam", "train", 12),
    ],
)
def test_profiler_agrees_with_live_storages(model, shape, optimizer, mode, profiler_only) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape)
    measured = measure(model(), x, optimizer=optimizer, mode=mode)
    torch.manual_seed(0)
    assert measured.peak_bytes - _dispatch_peak(model(), x, optimizer, mode) == profiler_only


def test_profiler_sees_kernel_internal_blocks() -> None:
    # oneDNN's convolution allocates a scratch block inside the op; only the allocator sees it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
    x = torch.randn(4, 3, 32, 32)
    measured = measure(model, x, mode="inference")
    assert measured.peak_bytes >= _dispatch_peak(model, x, None, "inference")


# --------------------------------------------------------------------------------------------
# The model passed in is never changed
# --------------------------------------------------------------------------------------------


def test_model_and_inputs_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 2)
    )
    model.eval()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    x = torch.randn(4, 8, requires_grad=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    x_before = x.detach().clone()
    torch.manual_seed(123)
    rng = torch.random.get_rng_state()

    for precision in ("fp32", "bf16", "amp-bf16"):
        measure(model, x, optimizer="adam", precision=precision)
    measure(model, x, mode="inference")

    assert torch.equal(torch.random.get_rng_state(), rng)
    assert model.training is False and not any(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert v.dtype == state[k].dtype and v.device == state[k].device
        assert torch.equal(v, state[k]), k  # bitwise
        assert v.data_ptr() == ptrs[k]
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    assert torch.equal(x.detach(), x_before) and x.grad is None


def test_training_flag_kept_when_training() -> None:
    model = _mlp().train()
    measure(model, torch.randn(2, 32), mode="inference")
    assert model.training and all(m.training for m in model.modules())


# --------------------------------------------------------------------------------------------
# Inputs and errors
# --------------------------------------------------------------------------------------------


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids)) * scale


def test_tuple_and_dict_inputs() -> None:
    ids = torch.randint(0, 50, (3, 5))
    scale = torch.ones(3, 5, 1)
    by_position = measure(_TwoInputs(), (ids, scale), precision="bf16")
    by_name = measure(_TwoInputs(), {"ids": ids, "scale": scale}, precision="bf16")
    assert by_position == by_name
    # integer ids keep their dtype (3x5 int64 = 120 B); the float scale is cast (15 x 2 B)
    params = (50 * 8 + 8 * 4 + 4) * 2
    assert by_name.resident_bytes == 3 * params + 3 * 4 + 120 + 30
    assert by_name.batch_size == 3


def test_runs_inside_no_grad_and_inference_mode() -> None:
    expected = measure(_linear(), _x(), optimizer="sgd")
    with torch.no_grad():
        assert measure(_linear(), _x(), optimizer="sgd") == expected
    with torch.inference_mode():
        assert measure(_linear(), _x(), optimizer="sgd") == expected


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"precision": "fp8"}, "'fp32', 'bf16', 'fp16', 'amp-bf16', 'amp-fp16'"),
        ({"optimizer": "lion"}, "'sgd', 'sgd-momentum', 'adam'"),
        ({"mode": "eval"}, "'train', 'inference'"),
    ],
)
def test_bad_options_list_valid_values(kwargs: dict[str, str], what: str) -> None:
    with pytest.raises(ValueError, match="valid values") as info:
        measure(_linear(), _x(), **kwargs)
    assert what in str(info.value)


def test_options_parsed_case_insensitively() -> None:
    m = measure(_linear(), _x(), optimizer="SGD", precision="FP32", mode="Train")
    assert m == measure(_linear(), _x(), optimizer="sgd")


def test_errors() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        measure(lambda x: x, _x())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch dimension"):
        measure(_linear(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        measure(nn.Linear(2, 2, device="meta"), torch.randn(1, 2))


def test_refuses_to_run_inside_another_profiler() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]), pytest.raises(RuntimeError, match="profiler"):
        measure(_linear(), _x())


def test_measurement_is_frozen() -> None:
    m = measure(_linear(), _x())
    assert isinstance(m, Measurement)
    with pytest.raises(AttributeError):
        m.peak_bytes = 0  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# CUDA (needs a GPU)
# --------------------------------------------------------------------------------------------

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@_no_cuda
def test_cuda_linear_sgd() -> None:
    # The caching allocator rounds every block up to 512 B: weight 800 -> 1024, input
    # 160 -> 512, so resident = 1536 B; the peak holds (at least) the output, the loss,
    # the output's gradient and the weight's gradient, each a 512-B-rounded block.
    model = _linear().cuda()
    m = measure(model, _x(), optimizer="sgd")  # the input is moved to the GPU
    assert m.device == "cuda"
    assert m.resident_bytes == 1024 + 512
    assert m.peak_bytes >= m.resident_bytes + 512 + 512 + 512 + 1024
    assert m.max_reserved_bytes is not None and m.max_reserved_bytes >= m.peak_bytes
    assert model.weight.grad is None and model.weight.device.type == "cuda"


@pytest.mark.gpu
@_no_cuda
def test_cuda_counts_only_what_measure_made() -> None:
    model = _mlp().cuda()
    x = torch.randn(8, 32, device="cuda")
    first = measure(model, x)
    ballast = torch.empty(1 << 20, device="cuda")  # allocated by the caller, not by measure
    second = measure(model, x)
    del ballast
    assert second.peak_bytes == first.peak_bytes
    assert second.resident_bytes == first.resident_bytes
    rng = torch.cuda.get_rng_state()
    measure(nn.Sequential(nn.Dropout(), nn.Linear(4, 4)).cuda(), torch.randn(2, 4))
    assert torch.equal(torch.cuda.get_rng_state(), rng)


def test_snapshot_needs_cuda() -> None:
    with pytest.raises(ValueError, match="snapshot=True records the CUDA caching allocator"):
        measure(_linear(), _x(), optimizer="sgd", snapshot=True)


@pytest.mark.gpu
@_no_cuda
def test_cuda_snapshot_compares_with_the_prediction() -> None:
    # The real step's recorded snapshot beside the prediction: the same allocations in the
    # same order (the counts agree), and the predicted reserved peak against the measured.
    from vram_widget import profile_model

    model = _mlp().cuda()
    x = torch.randn(8, 32, device="cuda")
    real = measure(model, x, optimizer="adam", snapshot=True)
    assert real.snapshot is not None and real.snapshot["device_traces"]
    est = profile_model(model, inputs=x).estimate(8, optimizer="adam")
    table = est.compare_snapshot(real.snapshot)
    assert table.attrs["note"] == "", table.attrs["note"]
    assert (table["predicted_bytes"] > 0).any()


def _tiny_gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    return hf_gpt2()


def test_generate_is_measured_on_the_model_s_own_generate() -> None:
    # mode="generate": model.generate(do_sample=False, exactly new_tokens), prefill and
    # decode with GPT-2's own KV cache; the model passed in stays as it was
    model = _tiny_gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    was_training = model.training
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    m = measure(model, {"input_ids": ids}, mode="generate", new_tokens=32)
    assert (m.mode, m.new_tokens, m.optimizer) == (Mode.GENERATE, 32, None)
    weights = sum(p.numel() * 4 for p in model.parameters())  # tied lm_head counted once
    assert m.resident_bytes == weights + ids.numel() * 8  # the weights and the prompt
    # the cache at the last decode step: 2 (k, v) x 2 layers x 47 positions x 64 x 4 B x 2
    assert m.peak_bytes - m.resident_bytes >= 2 * 2 * (16 + 31) * 64 * 4 * 2
    forward = measure(model, {"input_ids": ids}, mode="inference")
    assert m.peak_bytes > forward.peak_bytes  # a forward, and a cache kept besides
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.training == was_training


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"new_tokens": 0}, r"needs new_tokens, an int >= 1 .* got 0"),
        ({}, r"needs new_tokens, an int >= 1 .* got None"),
        ({"new_tokens": 60}, r"16 tokens plus new_tokens=60 is 76 positions, beyond .* 64"),
        ({"new_tokens": 4, "gpus": 2}, r"measured on one device \(gpus=1\)"),
    ],
)
def test_generate_bad_settings_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        measure(_tiny_gpt2(), {"input_ids": ids}, mode="generate", **kwargs)  # type: ignore[arg-type]


def test_generate_needs_a_cache_protocol() -> None:
    with pytest.raises(ValueError, match=r"needs a model that generates with a cache .* Linear"):
        measure(nn.Linear(4, 4), torch.zeros(2, 4), mode="generate", new_tokens=4)
    with pytest.raises(ValueError, match="new_tokens is for mode='generate'"):
        measure(nn.Linear(4, 4), torch.zeros(2, 4), mode="inference", new_tokens=4)
