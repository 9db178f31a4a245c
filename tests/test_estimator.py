"""Unit tests of the numpy layer (``table``, ``estimator``) on a hand-built profile: no torch.

The synthetic step (rows: the root module, "fc", the loss and optimizer pseudo-rows):

    storages   0 weight      Parameter  resident  800 B            (row fc)
               1 input       Input      resident  40 B / sample
               2 fc output   Activation           80 B / sample    (row fc; saved)
               3 scratch     Temporary            16 B + 8 B / sample
               4 weight grad Gradient             800 B            (row fc)
    events     0 forward    fc    +s2
               1 forward    fc    +s3
               2 forward    fc    -s3
               3 backward   root  +s4      (backward_start = 3)
               4 backward   fc    -s2
               -- the optimizer's step is spliced in here (optimizer_at = 5) --
               5 zero_grad  root  -s4
    optimizer  temporaries +100 +200 -200 -100; state 800 + 800 + 4 B (row fc)
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
from torch import nn

from vram_widget import profile_model
from vram_widget._estimating.accelerator import (
    CUBLAS_WORKSPACE_BYTES_SM90,
    CUDA_CONTEXT_BYTES,
    cuda_block_bytes,
)
from vram_widget._estimating.allocator import OutOfMemory
from vram_widget._estimating.estimator import MemoryEstimate, estimate
from vram_widget._estimating.options import (
    CATEGORY_CODE,
    PHASE_CODE,
    Category,
    Device,
    Mode,
    OptimizerName,
    Phase,
    Precision,
)
from vram_widget._estimating.table import (
    ModuleRows,
    NotAffineError,
    OptimizerTrace,
    Poly,
    Timeline,
    fit_timeline,
    interpolate_columns,
)

ROOT, FC, LOSS, OPT = 0, 1, 2, 3
C = CATEGORY_CODE
P = PHASE_CODE


def _i64(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def make_rows() -> ModuleRows:
    return ModuleRows(
        names=("", "fc", "(loss)", "(optimizer)"),
        types=("Net", "Linear", "loss", "optimizer"),
        depths=np.asarray([0, 1, 0, 0], dtype=np.int32),
        param_count=_i64(0, 200, 0, 0),
        trainable_param_count=_i64(0, 200, 0, 0),
        buffer_count=_i64(0, 0, 0, 0),
    )


def make_timeline(*, workspace: bool = False) -> Timeline:
    event_storage = [2, 3, 3, 4, 2, 4]
    a = _i64(0, 16, -16, 800, 0, -800)
    b = _i64(80, 8, -8, 0, -80, 0)
    module = [FC, FC, FC, ROOT, FC, ROOT]
    phase = [P[Phase.FORWARD]] * 3 + [P[Phase.BACKWARD]] * 2 + [P[Phase.ZERO_GRAD]]
    storage_category = np.asarray(
        [
            C[Category.PARAMETER],
            C[Category.INPUT],
            C[Category.ACTIVATION],
            C[Category.TEMPORARY],
            C[Category.GRADIENT],
        ],
        dtype=np.int8,
    )
    ws: dict[str, np.ndarray] = {
        "workspace_alloc_at": _i64(),
        "workspace_free_at": _i64(),
        "workspace_grid": _i64(2, 3, 5),
        "workspace_bytes": np.zeros((0, 3), np.int64),
    }
    if workspace:
        # the scratch (storage 3) is a measured kernel workspace: 100 B at batch 1,
        # 800 B at 8 and at 32
        ws = {
            "workspace_alloc_at": _i64(1),
            "workspace_free_at": _i64(2),
            "workspace_grid": _i64(1, 8, 32),
            "workspace_bytes": np.asarray([[100, 800, 800]], dtype=np.int64),
        }
    return Timeline(
        event_bytes=Poly.affine(a, b),
        event_module=np.asarray(module, dtype=np.int32),
        event_phase=np.asarray(phase, dtype=np.int8),
        event_category=storage_category[event_storage],
        # the op running at each event: the forward's addmm, the backward's AddmmBackward0
        event_op=np.asarray([0, 0, 0, 1, 1, -1], np.int32),
        op_names=("aten.addmm", "AddmmBackward0"),
        storage_bytes=Poly.affine(_i64(800, 0, 0, 16, 800), _i64(0, 40, 80, 8, 0)),
        storage_category=storage_category,
        storage_module=np.asarray([FC, -1, FC, FC, FC], dtype=np.int32),
        storage_resident=np.asarray([True, True, False, False, False]),
        flops_forward=Poly.affine(_i64(0, 0, 0, 0), _i64(0, 400, 0, 0)),
        flops_backward=Poly.affine(_i64(0, 0, 0, 0), _i64(0, 400, 0, 0)),
        output_shapes=(((0, 1), (10, 0)), ((0, 1), (10, 0)), None, None),
        backward_start=3,
        optimizer_at=5,
        uses_matmul=True,
        exact=True,
        nonaffine_row=None,
        **ws,
    )


def make_optimizer() -> OptimizerTrace:
    return OptimizerTrace(
        event_bytes=_i64(100, 200, -200, -100),
        state_bytes=_i64(0, 1604, 0, 0),
        state_block_bytes=_i64(800, 800, 4),
    )


def run(
    batch: int,
    *,
    opt: OptimizerTrace | None = None,
    mode: Mode = Mode.TRAIN,
    device: Device = Device.CPU,
    timeline: Timeline | None = None,
) -> MemoryEstimate:
    return estimate(
        make_rows(),
        timeline or make_timeline(),
        opt,
        batch_size=batch,
        precision=Precision.FP32,
        optimizer=OptimizerName.ADAM if opt is not None else None,
        mode=mode,
        device=device,
    )


# --------------------------------------------------------------------------------------------
# The peak, where it is, and what is live there
# --------------------------------------------------------------------------------------------


def test_peak_in_the_optimizer_at_small_batch() -> None:
    # batch 2: resident = weight 800 + input 80 + optimizer state 1604 = 2484.
    # events: +160 +32 -32 +800 -160 | +100 +200 -200 -100 | -800
    # live:   2644 2676 2644 3444 3284 | 3384 3584 3384 3284 | 2484
    est = run(2, opt=make_optimizer())
    assert est.live_bytes.tolist() == [2644, 2676, 2644, 3444, 3284, 3384, 3584, 3384, 3284, 2484]
    assert est.peak_bytes == 3584
    assert est.peak_phase is Phase.OPTIMIZER
    assert est.peak_module == "(optimizer)" and est.peak_op == ""
    assert est.peak_location == "(optimizer), optimizer"
    assert est.peak_breakdown == {
        Category.PARAMETER: 800,
        Category.BUFFER: 0,
        Category.GRADIENT: 800,
        Category.OPTIMIZER_STATE: 1604,
        Category.ACTIVATION: 0,  # +160 then -160 before the peak
        Category.TEMPORARY: 300,  # the optimizer's two live temporaries
        Category.INPUT: 80,
        Category.COMMUNICATION: 0,  # one device: no data-parallel buffers
        Category.KV_CACHE: 0,  # a training step keeps no cache
    }
    assert sum(est.peak_breakdown.values()) == est.peak_bytes


def test_peak_moves_to_backward_at_large_batch() -> None:
    # batch 20: resident 800 + 800 + 1604 = 3204; +1600 +176 -176 +800 -> 5604 in backward,
    # allocated by the root row (the gradient's AccumulateGrad).
    est = run(20, opt=make_optimizer())
    assert est.peak_bytes == 3204 + 1600 + 800 == 5604
    assert est.peak_phase is Phase.BACKWARD
    assert est.peak_module == "Net"  # the root, by its class name
    assert est.peak_breakdown[Category.ACTIVATION] == 1600
    assert est.peak_breakdown[Category.GRADIENT] == 800
    assert est.peak_breakdown[Category.TEMPORARY] == 0


def test_without_an_optimizer() -> None:
    # batch 2, no optimizer: resident 880; peak 880 + 160 + 800 = 1840 in backward.
    est = run(2)
    assert len(est.live_bytes) == 6
    assert est.peak_bytes == 1840
    assert est.peak_phase is Phase.BACKWARD
    assert est.optimizer_state_bytes == 0 and est.optimizer is None


def test_optimizer_is_spliced_at_optimizer_at() -> None:
    est = run(2, opt=make_optimizer())
    phases = est.event_phase.tolist()
    modules = est.event_module.tolist()
    assert phases[:5] == [P[Phase.FORWARD]] * 3 + [P[Phase.BACKWARD]] * 2
    assert phases[5:9] == [P[Phase.OPTIMIZER]] * 4
    assert phases[9] == P[Phase.ZERO_GRAD]
    assert modules[5:9] == [OPT] * 4
    assert modules[:5] == [FC, FC, FC, ROOT, FC] and modules[9] == ROOT
    # the live bytes just before the splice are the end of backward (3284), and the
    # optimizer's temporaries rise from there
    assert est.live_bytes[4] == 3284 and est.live_bytes[6] == 3584


def test_totals_and_layer_rows() -> None:
    est = run(2, opt=make_optimizer())
    assert est.parameter_bytes == 800
    assert est.input_bytes == 80
    assert est.buffer_bytes == 0
    assert est.gradient_bytes == 800
    assert est.optimizer_state_bytes == 1604
    assert est.activation_bytes == 160
    assert (est.flops_forward, est.flops_backward, est.flops, est.macs) == (800, 800, 1600, 800)
    layers = est.layers
    assert layers.name == ("", "fc", "(loss)", "(optimizer)")
    assert layers.param_bytes.tolist() == [0, 800, 0, 0]
    assert layers.gradient_bytes.tolist() == [0, 800, 0, 0]
    assert layers.optimizer_state_bytes.tolist() == [0, 1604, 0, 0]
    assert layers.activation_bytes.tolist() == [0, 160, 0, 0]
    assert layers.output_shape == ((2, 10), (2, 10), None, None)
    assert layers.output_numel.tolist() == [20, 20, 0, 0]
    df = est.to_dataframe()
    assert df["param_bytes"].sum() == est.parameter_bytes
    assert df["activation_bytes"].sum() == est.activation_bytes
    assert df["flops_forward"].sum() + df["flops_backward"].sum() == est.flops


def test_inference_mode_ignores_optimizer_and_backward() -> None:
    est = run(2, opt=make_optimizer(), mode=Mode.INFERENCE)
    assert len(est.live_bytes) == 6  # no splice
    assert est.optimizer is None
    assert est.gradient_bytes == est.activation_bytes == est.optimizer_state_bytes == 0
    assert est.flops_backward == 0 and est.flops_forward == 800
    assert est.peak_bytes == 880 + 160 + 800  # the synthetic events are replayed as given


@pytest.mark.parametrize(
    ("batch", "module", "op", "location"),
    [
        # No optimizer; resident 800 + 40 B. Event 3 (root, backward, +800 grad): 1600 + 120 B;
        # event 1 (fc, forward): 816 + 128 B.
        # B = 10: event 3 (2800 > 2096): in the root's own code, so its op is named
        (10, "Net", "AddmmBackward0", "Net: AddmmBackward0, backward"),
        # B = 200: event 1 (26416 > 25600): a leaf module, whose type names the op
        (200, "fc", "", "fc, forward"),
    ],
)
def test_peak_location_names_module_and_op(batch: int, module: str, op: str, location: str) -> None:
    est = run(batch)
    assert (est.peak_module, est.peak_op, est.peak_location) == (module, op, location)


def test_peak_never_above_resident() -> None:
    tl = make_timeline()
    empty = Timeline(
        **{
            **tl.__dict__,
            "event_bytes": Poly.affine(_i64(), _i64()),
            "event_module": np.zeros(0, np.int32),
            "event_phase": np.zeros(0, np.int8),
            "event_category": np.zeros(0, np.int8),
            "event_op": np.zeros(0, np.int32),
            "backward_start": 0,
            "optimizer_at": 0,
        }
    )
    est = run(3, timeline=empty)
    assert est.peak_bytes == 800 + 120
    assert est.peak_phase is Phase.FORWARD
    assert est.peak_module == "Net"  # the root, by its class
    assert est.peak_op == ""
    assert est.peak_breakdown[Category.INPUT] == 120


def test_workspaces_are_interpolated() -> None:
    # The scratch is a workspace measured at batch 1, 8, 32: 100, 800, 800 B.
    # At batch 4: 100 + (800 - 100) * 3 // 7 = 400; beyond the grid: the last slope (0).
    tl = make_timeline(workspace=True)
    assert tl.events_at(4).tolist() == [320, 400, -400, 800, -320, -800]
    assert tl.events_at(64).tolist()[1:3] == [800, -800]
    est = run(4, timeline=tl)
    assert est.live_bytes.tolist()[:3] == [960 + 320, 960 + 720, 960 + 320]


# --------------------------------------------------------------------------------------------
# CUDA extras: every block rounded up to 512 B
# --------------------------------------------------------------------------------------------


def test_cuda_rounding_by_hand() -> None:
    # batch 2. Resident blocks: weight 800 -> 1024, input 80 -> 512; optimizer state
    # 800 -> 1024, 800 -> 1024, 4 -> 512: 4096 B.
    # Events rounded: +512 +512 -512 +1024 -512 | +512 +512 -512 -512 | -1024
    # running: 512 1024 512 1536 1024 1536 2048 1536 1024 0 -> max 2048.
    # Rounded peak 4096 + 2048 = 6144; tensor peak 3584: the allocator adds 2560 B.
    est = run(2, opt=make_optimizer(), device=Device.CUDA)
    assert est.peak_bytes == 3584
    assert est.extras.allocator_rounding_bytes == 6144 - 3584 == 2560
    # a training step with a matmul: two workspaces, the forward thread's and autograd's
    # device thread's (accelerator.cublas_workspace_bytes)
    assert est.extras.cublas_workspace_bytes == 2 * CUBLAS_WORKSPACE_BYTES_SM90
    assert est.extras.cublas_workspace_count == 2
    assert est.extras.cuda_context_bytes == CUDA_CONTEXT_BYTES
    assert est.total_bytes == 3584 + 2560 + 2 * CUBLAS_WORKSPACE_BYTES_SM90 + CUDA_CONTEXT_BYTES


def test_cuda_rounding_without_matmul_or_optimizer() -> None:
    # batch 20, no optimizer: resident 800 -> 1024, input 800 -> 1024 (2048).
    # Events: +1600 -> 2048, +176 -> 512, -512, +800 -> 1024, -2048, -1024:
    # running 2048 2560 2048 3072 1024 0 -> 3072. Rounded peak 5120; tensor peak
    # 1600 + 1600 + 800 = 4000.
    tl = Timeline(**{**make_timeline().__dict__, "uses_matmul": False})
    est = run(20, timeline=tl, device=Device.CUDA)
    assert est.peak_bytes == 4000
    assert est.extras.allocator_rounding_bytes == 5120 - 4000
    assert est.extras.cublas_workspace_bytes == 0


def test_cpu_has_no_extras() -> None:
    est = run(2, opt=make_optimizer(), device=Device.CPU)
    assert est.extras.total_bytes == 0 and est.total_bytes == est.peak_bytes


def test_cuda_block_bytes() -> None:
    assert cuda_block_bytes(_i64(0, 1, 511, 512, 513, 1024, 1025)).tolist() == [
        0,
        512,
        512,
        512,
        1024,
        1024,
        1536,
    ]


# --------------------------------------------------------------------------------------------
# Polynomial arithmetic and the fit
# --------------------------------------------------------------------------------------------


def test_affine_at_small_is_int64() -> None:
    f = Poly.affine(_i64(1, 2), _i64(10, 3))
    out = f.at(5)
    assert out.dtype == np.int64 and out.tolist() == [51, 17]


def test_affine_at_beyond_int64_returns_python_ints() -> None:
    f = Poly.affine(_i64(1, 2), _i64(2**40, 3))
    out = f.at(2**30)
    assert out.dtype == object
    assert all(type(v) is int for v in out)
    assert out.tolist() == [1 + 2**70, 2 + 3 * 2**30]
    # just below the switch it stays exact int64
    assert Poly.affine(_i64(0), _i64(2**31)).at(2**30).tolist() == [2**61]


def test_affine_at_empty() -> None:
    assert Poly.affine(_i64(), _i64()).at(10**30).size == 0


def test_affine_fit() -> None:
    f = Poly.fit((2, 4), (_i64(10, 7), _i64(16, 7)))
    assert f.coef[:, 0].tolist() == [4, 7] and f.coef[:, 1].tolist() == [3, 0]


def test_huge_batch_peak_is_a_python_int() -> None:
    # At batch 2**56 the fc output alone is 80 * 2**56 B: Poly.at switches to Python ints
    # (its bound passes 2**62), and the peak stays exact. (No FLOPs in this timeline: see
    # the next test.)
    batch = 2**56
    tl = make_timeline()
    zero = Poly.affine(_i64(0, 0, 0, 0), _i64(0, 0, 0, 0))
    no_flops = Timeline(**{**tl.__dict__, "flops_forward": zero, "flops_backward": zero})
    est = run(batch, opt=make_optimizer(), timeline=no_flops)
    assert isinstance(est.peak_bytes, int)
    # Past batch 98 the forward scratch (8 B/sample) outweighs the 784 B the gradient adds
    # over it: the peak is at event 1, resident 800 + 40 b + 1604, + 80 b, + 16 + 8 b.
    assert est.peak_bytes == 800 + 1604 + 16 + 128 * batch
    assert est.peak_phase is Phase.FORWARD and est.peak_module == "fc"
    assert est.input_bytes == 40 * batch
    assert est.activation_bytes == 80 * batch


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_totals_exact_beyond_int64() -> None:
    batch = 2**62
    est = run(batch, opt=make_optimizer())
    assert est.peak_bytes == 800 + 1604 + 16 + 128 * batch
    assert est.flops_forward == 400 * batch
    assert est.activation_bytes == 80 * batch
    assert sum(est.peak_breakdown.values()) == est.peak_bytes


def test_interpolation() -> None:
    grid = _i64(1, 8, 32)
    values = np.asarray([[100, 800, 800], [0, 70, 310]], dtype=np.int64)
    assert interpolate_columns(grid, values, 1).tolist() == [100, 0]
    assert interpolate_columns(grid, values, 20).tolist() == [800, 190]
    assert interpolate_columns(grid, values, 64).tolist() == [800, 630]
    assert interpolate_columns(_i64(4), values[:, :1], 99).tolist() == [100, 0]


class _Trace:
    """A minimal raw trace for ``fit_timeline`` (the fields it reads)."""

    def __init__(
        self, batch: int, per_sample: int = 8, extra_event: bool = False, per_pair: int = 0
    ) -> None:
        self.batch_size = batch
        self.event_storage = _i64(2, 2)
        nbytes = per_pair * batch * batch + per_sample * batch + 4
        self.event_bytes = _i64(nbytes, -nbytes)
        self.event_module = np.asarray([1, 1], np.int32)
        self.event_phase = np.asarray([0, 1], np.int8)
        self.event_op = np.asarray([0, 0], np.int32)
        self.op_names = ("aten.mul",)
        if extra_event:
            self.event_storage = _i64(2, 2, 2)
            self.event_bytes = _i64(per_sample * batch + 4, 0, -(per_sample * batch + 4))
            self.event_module = np.asarray([1, 1, 1], np.int32)
            self.event_phase = np.asarray([0, 0, 1], np.int8)
            self.event_op = np.asarray([0, 0, 0], np.int32)
        self.storage_category = np.asarray([0, 6, 4], np.int8)
        self.storage_module = np.asarray([1, -1, 1], np.int32)
        self.storage_resident = np.asarray([True, True, False])
        self.storage_bytes = _i64(64, 12 * batch, nbytes)
        self.flops_forward = _i64(0, 6 * batch, 0, 0)
        self.flops_backward = _i64(0, 12 * batch, 0, 0)
        self.step_starts: tuple[int, ...] = ()  # not a generation
        self.step_flops = np.zeros((0, 0), np.int64)
        self.output_shapes = (None, (batch, 3), None, None)
        self.workspace_storages = _i64()
        self.backward_start = 1
        self.optimizer_at = len(self.event_bytes)
        self.uses_matmul = False


def test_fit_timeline_exact() -> None:
    tl = fit_timeline((_Trace(2), _Trace(3)), _Trace(5))
    assert tl.exact and tl.nonaffine_row is None
    assert tl.event_bytes.coef.tolist() == [[4, 8], [-4, -8]]
    assert tl.storage_bytes.at(10).tolist() == [64, 120, 84]
    assert tl.flops_forward.at(7).tolist() == [0, 42, 0, 0]
    assert tl.output_shapes[1] == ((0, 1), (3, 0))
    # per Category, in order: parameters 64, inputs 120 (no communication buffers)
    assert tl.resident_by_category(10).tolist() == [64, 0, 0, 0, 0, 0, 120, 0, 0]


def test_fit_timeline_flags_a_nonaffine_model() -> None:
    # at batch 5 the per-sample bytes differ: the check fails at row 1 (the table only
    # flags it; the profiler is what warns)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tl = fit_timeline((_Trace(2), _Trace(3)), _Trace(5, per_sample=9))
    assert not tl.exact and tl.nonaffine_row == 1


def test_fit_timeline_quadratic_in_the_batch() -> None:
    # A B x B similarity matrix of fp32 (4 B per pair) plus 8 B per sample plus 4 B: the
    # line through batch 2 (36 B) and 3 (64 B) says 120 B at 5, where it is 144 B; the
    # quadratic through 2, 3 and 5 is checked exactly at 8 (4 * 64 + 64 + 4 = 324 B).
    line = fit_timeline((_Trace(2, per_pair=4), _Trace(3, per_pair=4)), _Trace(5, per_pair=4))
    assert not line.exact and line.check_peaks == (5, 64 + 60 + 120, 64 + 60 + 144)
    fit = (_Trace(2, per_pair=4), _Trace(3, per_pair=4), _Trace(5, per_pair=4))
    tl = fit_timeline(fit, _Trace(8, per_pair=4))
    assert tl.exact and tl.event_bytes.degree == 2
    assert tl.event_bytes.at(1000).tolist() == [4_008_004, -4_008_004]
    assert not fit_timeline(fit, _Trace(8, per_pair=5)).exact  # a wrong check is caught


def test_fit_timeline_refuses_mismatched_traces() -> None:
    with pytest.raises(NotAffineError, match="batch 2 and 3"):
        fit_timeline((_Trace(2), _Trace(3, extra_event=True)), _Trace(5))


# --------------------------------------------------------------------------------------------
# No torch in the numpy layer
# --------------------------------------------------------------------------------------------


_NO_TORCH = (
    "import sys; import vram_widget._estimating.estimator, vram_widget._estimating.table, "
    "vram_widget._estimating.profile, vram_widget._estimating.tradeoff, "
    "vram_widget._estimating.levers, vram_widget._estimating.allocator; "
    "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
)


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_numpy_layer_modules_do_not_import_torch() -> None:
    # The modules themselves, loaded under a bare package (its __init__ not run: that one
    # re-exports the profiler, which is torch).
    stub = (
        "import sys, types, pathlib, importlib.util; "
        "spec = importlib.util.find_spec('vram_widget'); "
        "pkg = types.ModuleType('vram_widget'); "
        "pkg.__path__ = list(spec.submodule_search_locations); "
        "sys.modules['vram_widget'] = pkg; "
    )
    result = _run_python(stub + _NO_TORCH)
    assert result.returncode == 0, result.stderr


def test_numpy_layer_does_not_import_torch() -> None:
    result = _run_python(_NO_TORCH)
    assert result.returncode == 0, result.stderr


def test_cublas_workspace_follows_the_target_compute_capability() -> None:
    # cuBLAS workspace per handle: 32 MiB = 33,554,432 B on compute capability 9.x, and
    # ":4096:2:16:8" = 4096 KiB * 2 + 16 KiB * 8 = 8,519,680 B before it
    # (CublasHandlePool.cpp; accelerator.cublas_workspace_bytes), two of them in this training
    # step (the forward thread's and autograd's device thread's), one in inference. The CUDA
    # context follows it too (accelerator.cuda_context, lazy loading): 775 MiB on 9.x,
    # 400 MiB on an A100 (the any-GPU row). The rest is unchanged.
    profile = profile_model(nn.Linear(16, 16), input_size=(16,), device="cuda")
    hopper = profile.estimate(4)
    ampere = profile.estimate(4, compute_capability=(8, 0))
    assert hopper.extras.cublas_workspace_bytes == 2 * 33_554_432
    assert profile.estimate(4, mode="inference").extras.cublas_workspace_bytes == 33_554_432
    assert profile.estimate(4, compute_capability=(9, 0)).extras == hopper.extras
    assert ampere.extras.cublas_workspace_bytes == 2 * 8_519_680
    assert ampere.peak_bytes == hopper.peak_bytes
    assert hopper.extras.cuda_context_bytes - ampere.extras.cuda_context_bytes == 375 * 2**20
    assert hopper.total_bytes - ampere.total_bytes == 2 * (33_554_432 - 8_519_680) + 375 * 2**20
    # max_batch_size counts the extras of the GPU it is told about (on the allocated basis:
    # total_bytes against the capacity; the device basis replays the workspace too).
    capacity = hopper.total_bytes
    for capability, extras in (((9, 0), hopper.extras), ((8, 0), ampere.extras)):
        b = profile.max_batch_size(capacity, compute_capability=capability, basis="allocated")
        at = [profile.estimate(n, compute_capability=capability) for n in (b, b + 1)]
        assert at[0].extras.cublas_workspace_bytes == extras.cublas_workspace_bytes
        assert at[0].total_bytes <= capacity < at[1].total_bytes
    assert profile.max_batch_size(
        capacity, compute_capability=(8, 0), basis="allocated"
    ) > profile.max_batch_size(capacity, basis="allocated")
    with pytest.raises(ValueError, match="compute_capability"):
        profile.estimate(4, compute_capability=(9,))  # type: ignore[arg-type]


def test_batch_one_as_profiled_where_it_is_not_the_line() -> None:
    # A step whose batch-1 run allocates 20 B per sample where batches 2 and 3 allocate 8:
    # the fit (a line through 2 and 3) says 12 B at batch 1; the batch-1 timeline, made from
    # its one trace, says 24 at any batch (no slope) and is used at batch 1 only.
    line = fit_timeline((_Trace(2), _Trace(3)), _Trace(5))
    one = fit_timeline((_Trace(1, per_sample=20),), _Trace(1, per_sample=20))
    assert one.event_bytes.at(1).tolist() == [24, -24] == one.event_bytes.at(7).tolist()
    assert line.events_at(1).tolist() == [12, -12]
    tl = Timeline(**{**line.__dict__, "batch_one": one})
    rows = make_rows()

    def peak(batch: int) -> int:
        return estimate(
            rows, tl, None, batch_size=batch, precision=Precision.FP32, optimizer=None,
            mode=Mode.TRAIN, device=Device.CPU,
        ).peak_bytes  # fmt: skip

    # resident: storage 0 (64 B) + storage 1 (12 B per sample); the event's bytes on top
    assert peak(1) == 64 + 12 + 24
    assert peak(2) == 64 + 24 + 20  # the line: 8 * 2 + 4


def test_reserved_bytes_replay_a_linear_step_by_hand() -> None:
    # Linear(1024, 1024), batch 1, fp32, SGD, device="cuda", replayed through the caching
    # allocator (allocator). The 4 MiB weight opens a 20 MiB large segment (16 MiB left,
    # split). Everything small (the 4 KiB bias and its gradient, the 4 KiB input and output,
    # the loss) shares one 2 MiB segment. The two cuBLAS workspaces of a training step (the
    # forward thread's and autograd's device thread's) go through the allocator too: on an
    # H100 (9.0) 32 MiB each, a segment of its own (>= 10 MiB: rounded to 2 MiB), so
    # 20 + 2 + 32 + 32 = 86 MiB in 4 segments; on an A100 (8.0) 8,519,680 B (8.125 MiB)
    # each: the first is cut from the weight's segment (7.875 MiB left), the second does not
    # fit there and opens a second 20 MiB segment (a 1-10 MiB request), and the 4 MiB weight
    # gradient takes the best fit, the 7.875 MiB block: 20 + 20 + 2 = 42 MiB. Nothing is
    # cached that could be released, so the device needs all of it plus the CUDA context.
    profile = profile_model(nn.Linear(1024, 1024), input_size=(1024,))
    h100 = profile.estimate(1, "fp32", "sgd")
    assert h100.reserved_bytes == 86 * 2**20 and h100.allocator is not None
    assert h100.allocator.segments == 4
    assert h100.device_bytes == 86 * 2**20 + CUDA_CONTEXT_BYTES
    a100 = profile.estimate(1, "fp32", "sgd", compute_capability=(8, 0))
    # the A100's CUDA context: the any-GPU lazy row, 400 MiB (accelerator.cuda_context)
    assert a100.reserved_bytes == 42 * 2**20 and a100.device_bytes == 42 * 2**20 + 400 * 2**20
    # fits exactly at device_bytes, not 2 MiB below
    assert a100.fits_device(a100.device_bytes) is True
    assert a100.fits_device(a100.device_bytes - 2**21) is False
    # with Adam the residents are the weight, exp_avg and exp_avg_sq (4 MiB each): 8 MiB
    # left in the 20 MiB segment, less than an A100 workspace (8.125 MiB), so the first opens
    # a second 20 MiB segment (a 1-10 MiB request) and the second is cut from it (3.75 MiB
    # left); the weight gradient takes the 8 MiB block: 20 + 20 + 2 = 42 MiB
    adam = profile.estimate(1, "fp32", "adam", compute_capability=(8, 0))
    assert adam.reserved_bytes == 42 * 2**20
    # whole blocks: the replay's allocated peak is at least the estimate's, and reserved
    # at least that
    for est in (h100, a100, adam):
        assert est.allocator is not None and est.reserved_bytes is not None
        assert est.reserved_bytes >= est.allocator.peak_allocated_bytes >= est.peak_bytes
    cpu = profile_model(nn.Linear(1024, 1024), input_size=(1024,), device="cpu")
    assert cpu.estimate(1).reserved_bytes is None  # no caching allocator on the CPU
    assert cpu.estimate(1).device_bytes is None and cpu.estimate(1).fits_device(2**30) is None


@pytest.fixture(scope="module")
def resnet18_64() -> Any:
    from vram_widget import zoo

    return profile_model(zoo.resnet18(), input_size=(3, 64, 64))


@pytest.mark.parametrize(("batch", "optimizer"), [(8, "adamw"), (32, "adamw"), (64, "sgd")])
def test_device_bytes_is_the_least_capacity_a_search_of_caps_finds(
    resnet18_64: Any, batch: int, optimizer: str
) -> None:
    # device_bytes climbs from the 512-byte-block peak by each failed replay's shortfall.
    # Checked against a plain bisection over allocator replays under caps in 2 MiB steps,
    # here in the test: the same least capacity, strictly between the whole blocks in use
    # and the unconstrained reserved peak (ResNet-18 at 3x64x64 fragments: cached segments
    # must go).
    est = resnet18_64.estimate(batch, "fp32", optimizer)
    assert est.device_bytes is not None and est.reserved_bytes is not None
    context, step = est.extras.cuda_context_bytes, 2**21

    def runs(cap: int) -> bool:
        try:
            est.replayed(capacity_bytes=cap)
        except OutOfMemory:
            return False
        return True

    lo = (est.peak_bytes - 1) // step  # runs(lo * step) is False
    hi = -(-est.reserved_bytes // step)  # the unconstrained run: True
    assert not runs(lo * step) and runs(hi * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(mid * step):
            hi = mid
        else:
            lo = mid
    assert est.device_bytes == context + hi * step
    assert est.peak_bytes + context < est.device_bytes < est.reserved_bytes + context


@pytest.mark.parametrize(
    ("batch", "optimizer", "expandable"),
    [(1, "sgd", False), (8, "adamw", False), (32, "adamw", False), (64, "sgd", False),
     (16, "adamw", True)],
)  # fmt: skip
def test_fits_compares_device_bytes_on_cuda_and_total_bytes_on_cpu(
    resnet18_64: Any, batch: int, optimizer: str, expandable: bool
) -> None:
    # One number decides "fits": fits(c) is device_bytes <= c on CUDA, for every capacity
    # swept around it (1 byte and 512 KiB steps, across the 2 MiB steps device_bytes
    # climbs in), and replaying the allocator under device_bytes less the context runs the
    # step. On the CPU it is total_bytes <= c, and basis="allocated" is that on CUDA too.
    est = resnet18_64.estimate(batch, "fp32", optimizer, expandable_segments=expandable)
    device, context = est.device_bytes, est.extras.cuda_context_bytes
    assert device is not None
    caps = [device + k * 2**19 for k in range(-12, 13)] + [device - 1, device + 1]
    for cap in caps:
        assert est.fits(cap) is (device <= cap), cap - device
        assert est.fits_device(cap) is (device <= cap), cap - device
        assert est.fits(cap, basis="allocated") is (est.total_bytes <= cap)
    if not expandable:  # the replay under a cap (expandable segments: no cap is replayed)
        est.replayed(capacity_bytes=device - context)  # runs: no OutOfMemory
    cpu = profile_model(nn.Linear(1024, 1024), input_size=(1024,), device="cpu").estimate(batch)
    total = cpu.total_bytes
    assert cpu.device_bytes is None and cpu.fits_device(total) is None
    for cap in [total + k * 2**19 for k in range(-4, 5)] + [total - 1, total + 1]:
        assert cpu.fits(cap) is (total <= cap) is cpu.fits(cap, basis="allocated")


@pytest.mark.parametrize("name", ["resnet18", "transformer_encoder", "causal_decoder", "lstm"])
def test_reserved_is_at_least_the_whole_blocks_in_use(name: str) -> None:
    # Invariants of any replay: the allocator's allocated peak (whole blocks) is at least the
    # estimate's, and what it reserves at least that; every estimate of the profile has one.
    from vram_widget import zoo

    entry = zoo.ZOO[name]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2))
    for batch, optimizer in ((1, "sgd"), (8, "adamw")):
        est = profile.estimate(batch, "fp32", optimizer)
        assert est.allocator is not None and est.reserved_bytes is not None
        assert est.reserved_bytes >= est.allocator.peak_allocated_bytes >= est.peak_bytes
        # with expandable segments every remainder of 512 B is split: the same whole
        # blocks at most, and reserved at least those
        grown = est.replayed(expandable_segments=True)
        assert grown is not None
        assert grown.peak_reserved_bytes >= grown.peak_allocated_bytes >= est.peak_bytes


def test_memory_snapshot_opens_in_pytorch_memory_viewer(tmp_path: Any) -> None:
    # The predicted step in torch.cuda.memory._snapshot() format: PyTorch's own viewer code
    # (torch.cuda._memory_viz, no GPU needed) reads it. Each segment's blocks tile it; every
    # allocation of the trace is freed, except the residents'; frames name module and phase.
    import pickle

    import torch.cuda._memory_viz as memory_viz

    from vram_widget import zoo

    profile = profile_model(zoo.resnet18(), input_size=(3, 64, 64))
    est = profile.estimate(8, "fp32", "adamw")
    snapshot = est.memory_snapshot()
    assert snapshot is not None and est.allocator is not None
    segments = snapshot["segments"]
    assert sum(s["total_size"] for s in segments) == est.allocator.reserved_at_end_bytes
    for segment in segments:
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    trace = snapshot["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    frees = [e for e in trace if e["action"] == "free_completed"]
    residents = [e for e in allocs if e["frames"][0]["name"] == "resident"]
    assert len(allocs) - len(frees) == len(residents) > 0
    named = {e["frames"][0]["filename"] for e in allocs}
    assert "layer1.0.conv1 (Conv2d)" in named
    assert {e["frames"][0]["name"] for e in allocs} >= {"forward", "backward", "optimizer"}
    assert "Active Memory Timeline" in memory_viz.trace_plot(snapshot)
    assert "Allocator State History" in memory_viz.segment_plot(snapshot)
    assert memory_viz.segsum(snapshot).startswith("Summary of segments")
    # saved as torch.cuda.memory._dump_snapshot saves a real one
    path = tmp_path / "predicted.pickle"
    est.save_memory_snapshot(str(path))
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"] == segments
    cpu = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu").estimate(2)
    assert cpu.memory_snapshot() is None
    with pytest.raises(ValueError, match='device="cuda"'):
        cpu.save_memory_snapshot(str(tmp_path / "cpu.pickle"))


def test_expandable_segments_is_a_setting_of_the_estimate() -> None:
    from vram_widget import zoo

    profile = profile_model(zoo.resnet18(), input_size=(3, 64, 64))
    plain = profile.estimate(16, "fp32", "adamw")
    grown = profile.estimate(16, "fp32", "adamw", expandable_segments=True)
    assert grown.expandable_segments and not plain.expandable_segments
    assert grown.peak_bytes == plain.peak_bytes  # allocated bytes do not depend on it
    replayed = plain.replayed(expandable_segments=True)
    assert replayed is not None and grown.reserved_bytes == replayed.peak_reserved_bytes
    # pages are not unmapped in the replay: the device needs the pages mapped at the peak
    assert grown.device_bytes == replayed.peak_reserved_bytes + CUDA_CONTEXT_BYTES
    assert grown.fits_device(grown.device_bytes) and not grown.fits_device(grown.device_bytes - 1)
    snapshot = grown.memory_snapshot()
    assert snapshot is not None and all(s["is_expandable"] for s in snapshot["segments"])
    cpu = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    with pytest.raises(ValueError, match=r'CUDA caching allocator.*device="cpu"'):
        cpu.estimate(2, expandable_segments=True)


def test_compare_snapshot_pairs_allocations_by_module_and_phase() -> None:
    # A "measured" trace made from the prediction's own second iteration with one allocation
    # 512 B larger: the comparison puts the +512 B on that allocation's module and phase, and
    # 0 everywhere else.
    import copy

    from vram_widget import zoo

    est = profile_model(zoo.mlp(hidden=(16,)), input_size=(784,)).estimate(4, optimizer="sgd")
    snapshot = est.memory_snapshot()
    assert snapshot is not None
    allocs = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    step = [e for e in allocs if e["frames"][0]["name"] != "resident"]
    second = copy.deepcopy(step[len(step) // 2 :])
    changed = second[1]
    changed["size"] += 512
    table = est.compare_snapshot({"device_traces": [second]})
    assert table.attrs["note"] == ""
    top = table.iloc[0]
    assert (top["module"], top["phase"], top["difference_bytes"]) == (
        changed["frames"][0]["filename"],
        changed["frames"][0]["name"],
        512,
    )
    assert (table["difference_bytes"].iloc[1:] == 0).all()
    # fewer measured allocations: said, and the common prefix compared
    short = est.compare_snapshot({"device_traces": [second[:3]]})
    assert "the first 3 are compared" in short.attrs["note"]


def test_allocated_bytes_charge_an_unsplit_block_in_full() -> None:
    """``allocated_bytes`` is what ``torch.cuda.max_memory_allocated()`` reads: a block the
    caching allocator does not split is charged whole. The 2944 x 1024 float32 weight is
    12,058,624 B (11.5 MiB), a request above 10 MiB, so its segment is rounded up to 2 MiB:
    12 MiB, whose 0.5 MiB remainder is under kSmallSize (1 MiB) and is not split off. So
    the weight is charged 12,582,912 B; the input (1,024 x 4 = 4,096 B) and the output
    (2,944 x 4 = 11,776 B, 23 x 512) are small blocks of their own size. The tensors' own
    bytes, ``peak_bytes``: 12,058,624 + 4,096 + 11,776 = 12,074,496; charged:
    12,582,912 + 4,096 + 11,776 = 12,598,784, the 524,288 B remainder more. The cuBLAS
    workspace is not in either (it is an extra of its own, 32 MiB on sm90, 8,519,680 B
    before)."""
    model = nn.Linear(1024, 2944, bias=False)
    profile = profile_model(model, input_size=(1024,), device="cuda", cache=False)
    for capability in ((9, 0), (8, 0)):
        est = profile.estimate(1, mode="inference", compute_capability=capability)
        assert est.peak_bytes == 12_074_496
        assert est.allocated_bytes == 12_598_784
    cpu = profile_model(model, input_size=(1024,), device="cpu", cache=False)
    assert cpu.estimate(1, mode="inference").allocated_bytes is None
