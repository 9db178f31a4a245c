"""Activation offloading (``offload_activations``): the forms and their refusals, hand-worked
numbers on a small MLP, the emulation's decisions against torchtune's own
``OffloadActivations`` and torch's ``save_on_cpu`` run on real CPU tensors, and ``measure()``
of the real ``save_on_cpu`` step on the CPU."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from vram_widget import Recipe, profile_model
from vram_widget._estimating.offloading import Offload, resolve_offload
from vram_widget._estimating.options import PHASE_CODE, Phase
from vram_widget._profiling.measure import measure
from vram_widget._profiling.offloading import OffloadEmulation, torchtune_offloading

B = 256  # batch
D = 64  # width
ACT = B * D * 4  # one activation, fp32: 65,536 B
WEIGHT = D * D * 4  # one weight, fp32: 16,384 B
SCALARS = 8  # the loss and its gradient, 4 B each


def mlp(layers: int = 4) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(D, D, bias=False), nn.ReLU()]
    return nn.Sequential(*blocks)


def _sum(y: torch.Tensor) -> torch.Tensor:
    return y.sum()


@pytest.fixture(scope="module")
def profile() -> Any:
    return profile_model(mlp(), input_size=(D,), loss_fn=_sum)


# --- forms and refusals ---------------------------------------------------------------------


def test_forms_resolve() -> None:
    assert resolve_offload(None) is None and resolve_offload(False) is None
    assert resolve_offload(True) is Offload.TORCHTUNE
    assert resolve_offload("torchtune") is Offload.TORCHTUNE
    assert resolve_offload("save_on_cpu") is Offload.SAVE_ON_CPU
    with pytest.raises(ValueError, match=r"'nvme'.*'torchtune'.*'save_on_cpu'"):
        resolve_offload("nvme")
    with pytest.raises(TypeError, match=r"offload_activations=1 \(int\)"):
        resolve_offload(1)
    r = Recipe.from_keywords(offload_activations=True)
    assert r.levers.offload_activations is True


def test_refusals_name_the_problem(profile: Any) -> None:
    with pytest.raises(ValueError, match="offload_activations='nvme'"):
        profile.estimate(B, offload_activations="nvme")
    with pytest.raises(ValueError, match=r"mode='inference'.*saves none"):
        profile.estimate(B, mode="inference", offload_activations=True)
    with pytest.raises(ValueError, match="gpus=1"):
        profile.estimate(B, gpus=2, offload_activations="save_on_cpu")
    cpu = profile_model(mlp(1), input_size=(D,), loss_fn=_sum, device="cpu")
    with pytest.raises(ValueError, match=r"device='cpu'.*in host memory already.*device='cuda'"):
        cpu.estimate(B, offload_activations="save_on_cpu")
    with pytest.raises(ValueError, match="mode='inference'"):
        measure(mlp(1), torch.randn(2, D), mode="inference", offload_activations="torchtune")


# --- hand-worked numbers --------------------------------------------------------------------
# The 4-layer MLP (Linear(64, 64, bias=False) + ReLU, x4) at batch 256, fp32, no optimizer,
# loss y.sum(). Autograd saves, in this order (mm saves mat2 = W.t() when its input needs a
# gradient, then its input; ReLU its result):
#   x, r1, W2.t(), r1, r2, W3.t(), r2, r3, W4.t(), r3, r4      (ri: the i-th ReLU's output)
# 8 activations of B x D x 4 = 65,536 B and 3 weight views of D x D x 4 = 16,384 B.
# Resident on the device: the 4 weights (65,536 B) and x (65,536 B) = 131,072 B.


def _forward_end(est: Any) -> int:
    """Device bytes live after the forward's last event (resident ones included)."""
    last = np.flatnonzero(est.event_phase == PHASE_CODE[Phase.FORWARD])[-1]
    return int(est.live_bytes[last])


def test_save_on_cpu_hand_worked(profile: Any) -> None:
    plain = profile.estimate(B, optimizer=None)
    off = profile.estimate(B, optimizer=None, offload_activations="save_on_cpu")
    # every saved tensor copied to the host, one copy per save (r1 twice):
    # 8 x 65,536 + 3 x 16,384 = 573,440
    assert off.host_bytes == 8 * ACT + 3 * WEIGHT == 573_440
    assert plain.host_bytes == 0
    # after the forward: plain keeps r1, r2, r3 (saved) and y = r4 (the output) and the loss:
    # 131,072 + 4 x 65,536 + 4 = 393,220; offloaded, only y and the loss:
    # 131,072 + 65,536 + 4 = 196,612
    resident = 4 * WEIGHT + ACT
    assert _forward_end(plain) == resident + 4 * ACT + 4 == 393_220
    assert _forward_end(off) == resident + ACT + 4 == 196_612
    # plain peak, at the last Linear's backward: resident + y + r1..r3 + relu4's grad +
    # W4's grad + the grad of its input: 131,072 + 65,536 + 3 x 65,536 + 65,536 + 16,384 +
    # 65,536 + 8 = 540,680
    assert plain.peak_bytes == resident + 6 * ACT + WEIGHT + SCALARS == 540_680
    # offloaded peak, at the first Linear but one (row 2): resident + y + the grads of W4, W3
    # + the gradient flowing in (65,536) + what its node brings back (W2.t() 16,384 and r1
    # 65,536) + W2's grad + the grad of its input: 131,072 + 65,536 + 2 x 16,384 + 65,536 +
    # 16,384 + 65,536 + 16,384 + 65,536 + 8 = 458,760
    assert off.peak_bytes == resident + 4 * ACT + 4 * WEIGHT + SCALARS == 458_760
    assert plain.peak_bytes - off.peak_bytes == 81_920
    assert off.exact and off.levers.offload_activations == "save_on_cpu"


def test_torchtune_hand_worked(profile: Any) -> None:
    tt = profile.estimate(B, optimizer=None, offload_activations=True)
    # the same 11 saves, all of at least 1,024 B and none an nn.Parameter (W.t() is a view):
    # the host holds what save_on_cpu's does
    assert tt.host_bytes == 8 * ACT + 3 * WEIGHT
    # its fwd_stash keeps the last 5 offloaded saves alive on the device after the forward:
    # r2 (7th save), r3 (8th, 10th), W4.t() (a view of a resident weight) and y (11th):
    # 131,072 + 3 x 65,536 + 4 = 327,684
    assert _forward_end(tt) == 4 * WEIGHT + ACT + 3 * ACT + 4 == 327_684
    assert tt.levers.describe().endswith("(torchtune's OffloadActivations)")


def test_host_bytes_is_affine_in_the_batch(profile: Any) -> None:
    # every offloaded save but the three weight views grows with the batch
    for batch in (3, 40, 1000):
        est = profile.estimate(batch, optimizer=None, offload_activations="save_on_cpu")
        assert est.host_bytes == 8 * batch * D * 4 + 3 * WEIGHT


# --- against the real hooks on CPU tensors ---------------------------------------------------


class _Stream:
    """A stand-in for a CUDA stream: its events order GPU work and change no memory."""

    def wait_event(self, _event: object) -> None: ...

    def wait_stream(self, _stream: object) -> None: ...

    def record_event(self) -> object:
        return object()


class _Host(torch.Tensor):
    """A host copy made by torchtune's pack hook; its ``.to("cuda")`` is logged."""

    brought: ClassVar[list[int]] = []

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if args and args[0] == "cuda":
            _Host.brought.append(id(self))
            return self.as_subclass(torch.Tensor).clone()
        return super().to(*args, **kwargs)


@contextlib.contextmanager
def _torchtune_on_cpu() -> Iterator[Any]:
    """torchtune's module with ``torch.cuda``'s streams stubbed and its host copies logged,
    so that its real pack / unpack code runs on CPU tensors."""
    module = torchtune_offloading()
    cuda = types.SimpleNamespace(
        default_stream=_Stream, Stream=_Stream, stream=lambda _s: contextlib.nullcontext()
    )

    def empty_like(t: torch.Tensor, pin_memory: bool = False, device: str = "cpu") -> Any:
        return torch.empty_like(t, device=device).as_subclass(_Host)

    proxy = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if n[0] != "_"})
    proxy.cuda, proxy.empty_like, proxy._C = cuda, empty_like, torch._C
    real, module.torch = module.torch, proxy
    try:
        yield module
    finally:
        module.torch = real


def test_torchtune_emulation_matches_its_own_hooks() -> None:
    torch.manual_seed(0)
    model = mlp(4)
    x = torch.randn(8, D)  # each activation 8 x 64 x 4 = 2,048 B: over the threshold
    _Host.brought = []
    with _torchtune_on_cpu() as module:
        manager = module.OffloadActivations(use_pin_memory=False)
        with manager:
            y = model(x)
        real_offloaded = sorted(k for k, (_t, modified) in manager.tracker.items() if modified)
        real_stash = sorted(manager.fwd_stash)
        host_ids = {id(t): k for k, (t, modified) in manager.tracker.items() if modified}
        y.sum().backward()
        real_back = [host_ids[h] for h in _Host.brought]
    em = OffloadEmulation(Offload.TORCHTUNE, lambda t: None, contextlib.nullcontext)
    with em.hooks():
        y = model(x)
    emulated_stash = sorted(em.fwd_stash)
    y.sum().backward()
    assert em.offloaded == real_offloaded == list(range(1, 12))
    assert emulated_stash == real_stash == [7, 8, 9, 10, 11]
    # the backward brings back from the host what left the stash, in the same order
    assert em.brought_back == real_back
    assert real_back and not set(real_back) & {11}  # y (the 11th) is handed back as it is
    assert em.host_bytes == 0 and not em.tracker


def test_torchtune_threshold_and_parameters_stay() -> None:
    # Linear(64, 512) then LayerNorm(512) at batch 8: addmm saves x (8 x 64 x 4 = 2,048 B,
    # offloaded); the LayerNorm its input (8 x 512 x 4 = 16,384 B, offloaded), its weight
    # and bias (nn.Parameters of 2,048 B: kept) and its mean and rstd (8 x 1 x 4 = 32 B,
    # under 1,024 B: kept)
    model = nn.Sequential(nn.Linear(D, 512), nn.LayerNorm(512))
    x = torch.randn(8, D)
    with _torchtune_on_cpu() as module:
        manager = module.OffloadActivations(use_pin_memory=False)
        with manager:
            model(x)
        real = [modified for _k, (_t, modified) in sorted(manager.tracker.items())]
        kept = sorted(
            t.numel() * t.element_size()
            for _t, (t, modified) in manager.tracker.items()
            if not modified
        )
    em = OffloadEmulation(Offload.TORCHTUNE, lambda t: None, contextlib.nullcontext)
    with em.hooks():
        model(x)
    assert em.plan == real
    assert real.count(True) == 2 and em.host_bytes == 2_048 + 16_384
    assert kept == [32, 32, 2_048, 2_048]


def test_save_on_cpu_emulation_matches_torch() -> None:
    model = mlp(2)
    x = torch.randn(8, D)
    packed: list[tuple[int, ...]] = []
    ctx = torch.autograd.graph.save_on_cpu()
    pack = ctx.pack_hook
    ctx.pack_hook = lambda t: (packed.append(tuple(t.shape)), pack(t))[1]
    with ctx:
        model(x).sum().backward()
    em = OffloadEmulation(Offload.SAVE_ON_CPU, lambda t: None, contextlib.nullcontext)
    with em.hooks():
        y = model(x)
    # every saved tensor, in torch's order: x, r1, W2.t(), r1, r2
    assert em.offloaded == list(range(1, len(packed) + 1))
    assert em.host_bytes == sum(int(np.prod(s)) * 4 for s in packed) == 4 * 8 * D * 4 + WEIGHT
    y.sum().backward()
    assert len(em.brought_back) == len(packed)


def test_measure_save_on_cpu_on_the_cpu_is_the_plain_step() -> None:
    # torch's save_on_cpu packs (tensor.device, tensor.cpu()) and a CPU tensor's .cpu() is
    # itself: the real CPU step holds what the plain step holds, to the byte
    torch.manual_seed(0)
    model, x = mlp(2), torch.randn(16, D)
    plain = measure(model, x, loss_fn=_sum, optimizer="sgd")
    off = measure(model, x, loss_fn=_sum, optimizer="sgd", offload_activations="save_on_cpu")
    assert off.peak_bytes == plain.peak_bytes and off.resident_bytes == plain.resident_bytes
    with pytest.raises(ValueError, match="needs CUDA"):
        measure(model, x, loss_fn=_sum, offload_activations="torchtune")


class _Decoder(nn.Module):
    """A torchtune-style decoder: its output projection is ``self.output``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, D, bias=False), nn.ReLU())
        self.output = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.output(self.body(x))
        return out


def test_output_projection_stays_on_the_device_under_torchtune() -> None:
    profile = profile_model(_Decoder(), input_size=(D,), loss_fn=_sum)
    tt = profile.estimate(B, optimizer=None, offload_activations="torchtune")
    everything = profile.estimate(B, optimizer=None, offload_activations="save_on_cpu")
    # saves: the body's mm keeps x, its ReLU r; the output's mm W_out.t() and r. torchtune
    # runs the output under NoOpManager: its two saves stay, x and r go (2 x 65,536);
    # save_on_cpu takes all four: 3 x 65,536 + 16,384
    assert tt.host_bytes == 2 * ACT == 131_072
    assert everything.host_bytes == 3 * ACT + WEIGHT == 212_992


def test_torchtune_file_loads_without_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    # where torchao is not installed at all (a None entry in sys.modules makes its import
    # fail), the loader stubs the packages above NF4Tensor too, and restores sys.modules
    import sys

    from vram_widget._profiling.offloading import _offloading_file, torchtune_offloading

    if _offloading_file() is None:
        pytest.skip("torchtune is not installed")
    for name in ("torchao", "torchao.dtypes", "torchao.dtypes.nf4tensor"):
        monkeypatch.setitem(sys.modules, name, None)
    module = torchtune_offloading()
    assert hasattr(module, "OffloadActivations")
    assert "torchao" not in sys.modules or sys.modules["torchao"] is None
