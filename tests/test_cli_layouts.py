"""``--plan-layouts N`` on the command line: the plan of ModelProfile.plan_layouts, as a table
and as JSON, and the flags that name a layout refused beside it (exit code 2)."""

from __future__ import annotations

import json

import pytest

from vram_widget import profile_model, zoo
from vram_widget._display.cli import main

_ARGS = ["mlp", "--device", "cpu", "--gpu", "12MiB", "--batch-size", "8", "--precision", "fp32",
         "--plan-layouts", "2"]  # fmt: skip


def test_json_is_the_python_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    plan = profile.plan_layouts(12 * 2**20, gpus=2, batch_size=8, optimizer="adam")
    assert (out["gpus"], out["batch_size"], out["gpu"]["memory_bytes"]) == (2, 8, 12 * 2**20)
    assert [r["layout"] for r in out["layouts"]] == [r.label for r in plan.layouts]
    assert [r["peak_bytes"] for r in out["layouts"]] == [r.peak_bytes for r in plan.layouts]
    assert [r["fits"] for r in out["layouts"]] == [r.fits for r in plan.layouts]
    assert [r["communication_sent_bytes"] for r in out["layouts"]] == [
        r.communication_sent_bytes for r in plan.layouts
    ]
    # ddp over 2 ranks all-reduces the gradients once: 2 x 1/2 x the parameters' bytes
    ddp = next(r for r in out["layouts"] if r["layout"] == "dp=2 ddp")
    params = profile.estimate(8).parameter_bytes
    assert ddp["communication_sent_bytes_by_kind"] == {"all_reduce": params}
    # 12 MiB: the FSDP2 layouts (about 10.2 MiB a rank) fit, DDP's and ZeRO-1's do not
    assert out["best"] == "dp=2 zero2" == plan.layouts[0].label
    assert {r["layout"] for r in out["refused"]} == {
        "tp=2", "pp=2 gpipe m=2", "pp=2 1f1b m=2", "pp=2 interleaved-1f1b m=2",
    }  # fmt: skip
    assert all(r["reason"] for r in out["refused"])


def test_text_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_ARGS) == 0
    out = capsys.readouterr().out
    assert "layouts of 2 GPUs" in out and "batch 8 a step" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    # the fitting FSDP2 layouts first (ZeRO-2 moves 2 copies of the parameters, ZeRO-3 and
    # HSDP 3), then DDP (2) and ZeRO-1 (3), which do not fit
    assert [row[2] for row in rows] == ["zero2", "zero3", "hsdp", "ddp", "zero1"]
    assert [row[8] for row in rows] == ["yes", "yes", "yes", "no", "no"]
    assert "sent/step" in out and "sent/step: bytes a rank sends per step" in out
    assert rows[0][3] == "4"  # 8 samples over 2 data-parallel ranks
    assert "best: dp=2 zero2" in out
    assert "tp=2: tp=2: Sequential has no tensor-parallel plan" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpus", "2"], "--gpus cannot be given with it"),
        (["--tp", "2"], "--tp cannot be given with it"),
        (["--strategy", "zero3"], "--strategy cannot be given with it"),
        (["--mode", "inference", "--optimizer", "sgd"], "training only"),
    ],
)
def test_layout_flags_are_refused(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*_ARGS, *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_capacity_is_needed_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["mlp", "--device", "cpu", "--plan-layouts", "2"])
    assert "--plan-layouts needs a capacity" in capsys.readouterr().err
