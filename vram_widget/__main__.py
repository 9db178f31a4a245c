"""``python -m vram_widget``: profile a zoo model and print its memory for a few settings."""

from __future__ import annotations

import argparse

from . import profile_model, zoo


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:8.3f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vram_widget", description=__doc__)
    parser.add_argument("--model", default="resnet18", choices=sorted(zoo.ZOO))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    entry = zoo.ZOO[args.model]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device=args.device)
    print(profile)
    print(f"{'precision':9s} {'optimizer':13s} {'mode':9s} {'peak':>12s} {'+ extras':>12s}  where")
    for precision in ("fp32", "bf16", "amp-bf16"):
        for optimizer, mode in (("sgd", "train"), ("adam", "train"), (None, "inference")):
            est = profile.estimate(args.batch_size, precision, optimizer, mode)
            print(
                f"{precision:9s} {optimizer!s:13s} {mode:9s} {_gib(est.peak_bytes)} "
                f"{_gib(est.extras.total_bytes)}  {est.peak_phase}/{est.peak_module}"
            )
    est = profile.estimate(args.batch_size)
    print(f"\nper-layer table (fp32, adam, batch {args.batch_size}):")
    frame = est.to_dataframe()
    print(frame[frame.param_count.gt(0) | frame.activation_bytes.gt(0)].to_string(max_rows=40))
    print(f"\nFLOPs per step: {est.flops:,} ({est.macs:,} MACs)")
    for gib in (16, 24, 80):
        print(f"largest batch in {gib} GiB: {profile.max_batch_size(gib * 2**30):,}")


if __name__ == "__main__":
    main()
