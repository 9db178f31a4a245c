"""vram_widget._profiling.recorder helpers with hand-checked answers."""

from __future__ import annotations

import pytest
import torch

from vram_widget._profiling.recorder import _non_overlapping_and_dense


@pytest.mark.parametrize(
    ("t", "dense"),
    [
        (torch.empty(3, 4), True),
        (torch.empty(3, 4).t(), True),  # a permutation of a contiguous tensor
        (torch.empty(2, 3, 8, 8).to(memory_format=torch.channels_last), True),
        (torch.empty(3, 1, 4)[:, :, :], True),  # size-1 dims do not count
        (torch.empty(4, 6)[:, :3], False),  # a slice leaves gaps
        (torch.empty(4).expand(3, 4), False),  # stride 0: overlapping
        (torch.empty(3, 4)[::2], False),
    ],
)
def test_non_overlapping_and_dense(t: torch.Tensor, dense: bool) -> None:
    assert _non_overlapping_and_dense(t) is dense


_NUMBER_FORMS = {
    "h * 0.5": lambda h: h * 0.5,
    "torch.mul(0.5, h)": lambda h: torch.mul(0.5, h),
    "h.mul_(0.5)": lambda h: h.mul_(0.5),
    "h / 4": lambda h: h / 4,  # an int: int64, 8 B too
    "torch.div(2.0, h + 3)": lambda h: torch.div(2.0, h + 3),
}


class _Scaled(torch.nn.Module):
    """``b(form(a(x)))`` plus ``a(x).detach() / 4`` (no node, nothing kept)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(_NUMBER_FORMS[self.form](h)) + (h.detach() / 4).sum()


@pytest.mark.parametrize("form", sorted(_NUMBER_FORMS))
def test_a_number_autograd_keeps_lives_until_its_node_has_run(form: str) -> None:
    # Eager PyTorch wraps the number in an 8-byte 0-dim tensor; MulBackward0 / DivBackward0
    # keep it (the gradient of ``h`` needs it), so on the CPU those 8 B are allocated in the
    # forward and freed in the backward. ``h.detach() / 4`` makes no node: its 8 B (and the
    # 4-byte cast) live for the call only. The estimate equals the real step's peak.
    from vram_widget import measure, profile_model
    from vram_widget._estimating.options import PHASE_CODE, Mode, Phase, Precision

    torch.manual_seed(0)
    model = _Scaled(form)
    x = torch.randn(4, 16)
    profile = profile_model(model, inputs=x, device="cpu")
    trace = profile._source._run(Precision.FP32, 4, Mode.TRAIN)  # type: ignore[attr-defined]
    forward, backward = PHASE_CODE[Phase.FORWARD], PHASE_CODE[Phase.BACKWARD]
    lifetimes: dict[int, list[tuple[int, int]]] = {}
    for i, (sid, delta) in enumerate(zip(trace.event_storage, trace.event_bytes, strict=True)):
        lifetimes.setdefault(int(sid), []).append((int(delta), int(trace.event_phase[i])))
    kept = [ev for ev in lifetimes.values() if ev == [(8, forward), (-8, backward)]]
    assert len(kept) == 1  # the form's number, and not the 4 of ``h.detach() / 4``
    for mode, optimizer in (("train", "sgd"), ("train", "adam"), ("inference", None)):
        est = profile.estimate(4, optimizer=optimizer, mode=mode)
        real = measure(model, x, optimizer=optimizer, mode=mode)
        assert est.peak_bytes == real.peak_bytes, (mode, optimizer)
