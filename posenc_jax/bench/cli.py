"""``posenc-bench``: the library's benchmarks from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

__all__ = ["main"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _extrapolate(args) -> int:
    from posenc_jax.bench import extrapolate, report

    if args.preset not in extrapolate.PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; presets: {', '.join(extrapolate.PRESETS)}")
    preset = extrapolate.PRESETS[args.preset]
    overrides = {
        "encodings": args.encodings,
        "tasks": args.tasks,
        "seeds": args.seeds,
        "steps": args.steps,
        "model_dim": args.model_dim,
        "num_layers": args.layers,
        "num_heads": args.heads,
        "batch_size": args.batch_size,
        "train_length": args.train_length,
        "eval_lengths": args.eval_lengths,
        "text_context": args.text_context,
        "learning_rate": args.learning_rate,
    }
    preset = dataclasses.replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    try:
        preset.validate()
    except ValueError as error:
        raise SystemExit(f"posenc-bench extrapolate: {error}") from None
    out = pathlib.Path(args.out or f"results/extrapolation/{preset.name}")
    began = time.perf_counter()
    print(
        f"posenc-bench extrapolate: preset {preset.name}, {len(preset.encodings)} encodings x "
        f"{len(preset.tasks)} tasks x {len(preset.seeds)} seeds -> {out}",
        flush=True,
    )
    try:
        record = extrapolate.run(preset, out, corpus=args.corpus, progress=not args.no_progress)
    except ValueError as error:
        raise SystemExit(f"posenc-bench extrapolate: {error}") from None
    rows = report.load_results(out / "results.jsonl")
    text = report.write_report(rows, out, preset=record["preset"], record=record, plots=not args.no_plots)
    if not args.no_plots:
        report.plot(rows, out)
    print(text)
    print(f"wrote {out}/results.jsonl, run.json, report.md and plots in {time.perf_counter() - began:.0f}s")
    return 0


def _probe(args) -> int:
    from posenc_jax.bench import extrapolate, probe, report

    try:
        preset = probe.preset_with(
            args.preset, encodings=args.encodings, normalizers=args.normalizers, seeds=args.seeds, steps=args.steps
        )
        preset.validate()
    except ValueError as error:
        raise SystemExit(f"posenc-bench probe: {error}") from None
    out = pathlib.Path(args.out or f"results/{preset.name}")
    print(
        f"posenc-bench probe: preset {preset.name}, {len(preset.encodings)} encodings x "
        f"{len(preset.normalizers)} normalisers x 2 (boundary tokens or not) -> {out}",
        flush=True,
    )
    try:
        record = extrapolate.run(preset, out, progress=not args.no_progress)
    except ValueError as error:
        raise SystemExit(f"posenc-bench probe: {error}") from None
    rows = report.load_results(out / "results.jsonl")
    print(probe.write_probe_report(rows, out, preset=record["preset"]))
    probe.heat_map(rows, out)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="posenc-bench", description="Benchmarks of posenc_jax.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extrapolate", help="train short, test long, for each encoding and task")
    ex.add_argument("--preset", default="cpu", help="smoke, cpu (default), cpu-full or paper")
    ex.add_argument(
        "--encodings",
        type=_names,
        help="comma-separated registered encoding names; a+b for a hybrid (e.g. rope+randomized)",
    )
    ex.add_argument("--tasks", type=_names, help="comma-separated task names")
    ex.add_argument("--seeds", type=_ints, help="comma-separated seeds")
    ex.add_argument("--out", help="output folder (default results/extrapolation/<preset>)")
    ex.add_argument("--steps", type=int)
    ex.add_argument("--model-dim", type=int)
    ex.add_argument("--layers", type=int)
    ex.add_argument("--heads", type=int)
    ex.add_argument("--batch-size", type=int)
    ex.add_argument("--learning-rate", type=float)
    ex.add_argument("--train-length", type=int, help="longest training length of the algorithmic tasks")
    ex.add_argument("--eval-lengths", type=_ints, help="comma-separated evaluation lengths")
    ex.add_argument("--text-context", type=int, help="training context of the text task")
    ex.add_argument(
        "--corpus",
        help="a text file or folder for the text task, or wikitext103 / tinyshakespeare "
        "(Hugging Face hub, needs the data extra); default: Python's stdlib sources",
    )
    ex.add_argument("--no-progress", action="store_true", help="no progress bars")
    ex.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ex.set_defaults(handler=_extrapolate)
    pr = sub.add_parser("probe", help="seed 004's probe: positions of n identical tokens, per encoding x normaliser")
    pr.add_argument("--preset", default="default", help="smoke or default")
    pr.add_argument("--encodings", type=_names)
    pr.add_argument("--normalizers", type=_names, help="softmax, l2, relu2, urpe")
    pr.add_argument("--seeds", type=_ints)
    pr.add_argument("--steps", type=int)
    pr.add_argument("--out", help="output folder (default results/probe)")
    pr.add_argument("--no-progress", action="store_true")
    pr.set_defaults(handler=_probe)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
