"""``posenc-bench``: the library's benchmarks from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

__all__ = ["main"]

_INSTALL = 'pip install -e ".[bench]"  (from a clone; or: pip install "posenc_jax[bench]")'


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _at_least(least: int) -> tuple:
    return f">= {least}", lambda value: value >= least


_POSITIVE = ("a finite number > 0", lambda value: math.isfinite(value) and value > 0)
# Each numeric flag of extrapolate and probe (but --processes, checked where it is used): (the setting
# it sets, what it must be, the test, what it means, with an example).
_NUMBERS = {
    "--seeds": ("seeds", *_at_least(0), "the random seeds, e.g. --seeds 0,1,2"),
    "--steps": ("steps", *_at_least(1), "training steps per seed, e.g. --steps 200"),
    "--model-dim": ("model_dim", *_at_least(1), "the model's width, e.g. --model-dim 64"),
    "--layers": ("num_layers", *_at_least(1), "the number of layers, e.g. --layers 2"),
    "--heads": ("num_heads", *_at_least(1), "attention heads per layer, e.g. --heads 4"),
    "--batch-size": ("batch_size", *_at_least(1), "training examples per step, e.g. --batch-size 32"),
    "--learning-rate": ("learning_rate", *_POSITIVE, "AdamW's peak learning rate, e.g. --learning-rate 1e-3"),
    "--train-length": ("train_length", *_at_least(1), "the longest training length, e.g. --train-length 8"),
    "--eval-lengths": ("eval_lengths", *_at_least(1), "the test lengths, e.g. --eval-lengths 8,16,32"),
    "--text-context": ("text_context", *_at_least(2), "the text task's training window, e.g. --text-context 64"),
    "--text-lengths": ("text lengths", *_at_least(1), "the text task's test lengths, e.g. --text-lengths 64,128"),
    "--text-eval-characters": ("text_eval_characters", *_at_least(1), "test characters every text length scores"),
    "--learned-threshold": (
        "learned_threshold",
        "> 0 and <= 1",
        lambda value: 0 < value <= 1,
        "the score that counts as learned, e.g. --learned-threshold 0.95",
    ),
    "--query-init-scale": ("query_init_scale", *_POSITIVE, "the factor on the initial queries, e.g. 0.1"),
}


def _check_numbers(args, command: str) -> None:
    """Stops with one line naming the setting and its flag when a numeric flag is out of its range
    (0, a negative, NaN), before anything is built from it."""
    for flag, (name, rule, ok, meaning) in _NUMBERS.items():
        given = getattr(args, flag[2:].replace("-", "_"), None)
        if given is None:
            continue
        many = isinstance(given, tuple)
        bad = [value for value in (given if many else (given,)) if not ok(value)]
        if bad:
            flagged = f"{flag} {','.join(map(str, given))}" if many else flag
            raise SystemExit(
                f"posenc-bench {command}: {name} must {'each ' if many else ''}be {rule}, got {bad[0]} ({flagged}): "
                f"{meaning}"
            )


def _require_bench_extra(*, progress: bool, plots: bool, command: str) -> None:
    """Stops at once, with the line that fixes it, when the bench extra is missing, rather than
    at the first progress bar or after the whole run at the first plot."""
    needed = [("tqdm", "progress bars", progress), ("matplotlib", "plots", plots)]
    missing = [(name, use) for name, use, wanted in needed if wanted and importlib.util.find_spec(name) is None]
    if missing:
        what = ", ".join(f"{name} (for the {use})" for name, use in missing)
        raise SystemExit(
            f"posenc-bench {command}: {what} not installed; install the bench extra:\n    {_INSTALL}\n"
            f"or run without them: --no-progress --no-plots"
        )


def _preset_from(args):
    from posenc_jax.bench import presets

    if args.preset not in presets.PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; presets: {', '.join(presets.PRESETS)}")
    preset = presets.PRESETS[args.preset]
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
        "text_eval_characters": args.text_eval_characters,
        "learned_threshold": args.learned_threshold,
        "protocol": args.protocol,
        "task_format": args.task_format,
    }
    preset = dataclasses.replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    if args.text_lengths is not None:
        bad = [n for n in args.text_lengths if n < preset.text_context or n % preset.text_context]
        if bad or not args.text_lengths:
            raise SystemExit(
                f"posenc-bench extrapolate: --text-lengths {','.join(map(str, args.text_lengths))}: each must be a "
                f"multiple of the text context {preset.text_context} (set it with --text-context), got {bad or 'none'}"
            )
        preset = dataclasses.replace(preset, text_multiples=tuple(n // preset.text_context for n in args.text_lengths))
    if args.text_eval_characters is None and (args.text_lengths or args.text_context):
        # Every length scores the same characters: at least the preset's number, a multiple of every length.
        unit = math.lcm(*(preset.text_context * m for m in preset.text_multiples))
        preset = dataclasses.replace(preset, text_eval_characters=-(-preset.text_eval_characters // unit) * unit)
    if args.eval_lengths is not None and preset.tasks == ("text",):
        raise SystemExit(
            "posenc-bench extrapolate: --eval-lengths sets the algorithmic tasks' lengths and this run has only "
            "the text task; give the text task's lengths in characters with --text-lengths"
        )
    return preset


def _bars_wanted(no_progress: bool) -> bool:
    """Progress bars only on a terminal: written to a log file, each redraw is a line of its own
    (thousands per run); the one line per finished cell is printed either way."""
    return not no_progress and sys.stderr.isatty()


def _extrapolate(args) -> int:
    _check_numbers(args, "extrapolate")
    _require_bench_extra(progress=not args.no_progress, plots=not args.no_plots, command="extrapolate")
    from posenc_jax import bench

    preset = _preset_from(args)
    try:
        preset.validate()
    except ValueError as error:
        raise SystemExit(f"posenc-bench extrapolate: {error}") from None
    out = pathlib.Path(args.out or f"results/extrapolation/{preset.name}")
    if args.processes != 1:
        return _in_processes(args, out)
    host = None
    try:
        if args.distributed:
            import jax

            if not jax.distributed.is_initialized():  # a caller may have, with its own coordinator
                jax.distributed.initialize()
            host = (jax.process_index(), jax.process_count())
        elif args.host is not None:
            from posenc_jax.bench.hosts import parse_host

            host = parse_host(args.host)
    except ValueError as error:
        raise SystemExit(f"posenc-bench extrapolate: {error}") from None
    began = time.perf_counter()
    print(
        f"posenc-bench extrapolate: preset {preset.name}, {len(preset.encodings)} encodings x "
        f"{len(preset.tasks)} tasks x {len(preset.seeds)} seeds -> {out}",
        flush=True,
    )
    try:
        out = bench.run(  # with --host, the host's own folder in out
            preset,
            out,
            corpus=args.corpus,
            progress=_bars_wanted(args.no_progress),
            plots=not args.no_plots,
            keep_checkpoints=args.keep_checkpoints,
            host=host,
            repair=args.repair,
        )
    except ValueError as error:
        raise SystemExit(f"posenc-bench extrapolate: {error}") from None
    print((out / "report.md").read_text())
    wrote = "results.jsonl, run.json, report.md" + ("" if args.no_plots else " and plots")
    print(f"wrote {out}/{wrote} in {time.perf_counter() - began:.0f}s")
    return 0


def _without(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option`` and its value (``--option N`` or ``--option=N``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def _in_processes(args, out: pathlib.Path) -> int:
    """``--processes N``: the same command as ``--host i/N`` in N child processes, then their folders merged."""
    count = args.processes
    if count < 1:
        raise SystemExit(f"posenc-bench extrapolate: --processes must be at least 1, got {count}")
    if args.host is not None or args.distributed:
        raise SystemExit(
            "posenc-bench extrapolate: --processes deals the cells to processes of this machine; it does not combine "
            "with --host or --distributed (run --processes on each host instead of either)"
        )
    own = [a for a in _without(_without(args.argv, "--processes"), "--out") if a != "--no-plots"]
    child = [*own, "--out", str(out), "--no-plots"]  # the merge draws the plots, once
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # each process takes GPU memory as it needs it
    program = "import sys; from posenc_jax.bench.cli import main; sys.exit(main(sys.argv[1:]))"
    print(f"posenc-bench extrapolate: {count} processes, the cells dealt round them (--host i/{count})", flush=True)
    began = time.perf_counter()
    # Each in a session of its own, so that an interrupt (Ctrl-C, `timeout -s INT`) reaches it once, from here.
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", program, *child, "--host", f"{i}/{count}"], env=env, start_new_session=True
        )
        for i in range(count)
    ]
    try:
        codes = [worker.wait() for worker in workers]
    except KeyboardInterrupt:
        for worker in workers:
            worker.send_signal(signal.SIGINT)
        for worker in workers:
            worker.wait()
        raise SystemExit(
            "posenc-bench extrapolate: interrupted; each process stopped, keeping its finished cells and "
            f"checkpoints: run the same command again to resume, or `posenc-bench merge {out} --partial` to report "
            "the finished cells now"
        ) from None
    if any(codes):
        failed = ", ".join(f"{i}/{count} (exit {code})" for i, code in enumerate(codes) if code)
        raise SystemExit(
            f"posenc-bench extrapolate: process {failed} failed; the others' cells are kept: run the same command "
            "again to resume"
        )
    merged = _merge(argparse.Namespace(out=str(out), folders=[], no_plots=args.no_plots))
    print(f"trained in {count} processes in {time.perf_counter() - began:.0f}s")
    return merged


def _merge(args) -> int:
    _require_bench_extra(progress=False, plots=not args.no_plots, command="merge")
    from posenc_jax.bench import report as reporting
    from posenc_jax.bench.hosts import merge

    out = pathlib.Path(args.out)
    try:
        merge(out, folders=args.folders or None, partial=getattr(args, "partial", False))
        reporting.write_report(out, plots=not args.no_plots)
        if not args.no_plots:
            reporting.plot(out)
    except ValueError as error:
        raise SystemExit(f"posenc-bench merge: {error}") from None
    print((out / "report.md").read_text())
    named = args.folders or sorted(out.glob("host-*-of-*"))
    print(f"merged {', '.join(str(p) for p in named)} into {out}")
    return 0


def _probe(args) -> int:
    _check_numbers(args, "probe")
    _require_bench_extra(progress=not args.no_progress, plots=True, command="probe")
    from posenc_jax import bench
    from posenc_jax.bench import probe

    settings = dict(
        encodings=args.encodings,
        normalizers=args.normalizers,
        seeds=args.seeds,
        steps=args.steps,
        query_init_scale=args.query_init_scale,
    )
    try:
        preset = probe.preset_with(args.preset, **settings)
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
        bench.run_probe(args.preset, out, progress=not args.no_progress, **settings)
    except ValueError as error:
        raise SystemExit(f"posenc-bench probe: {error}") from None
    print((out / "report.md").read_text())
    return 0


def _queue(args) -> int:
    _require_bench_extra(
        progress=not (args.no_progress or args.list), plots=not (args.no_plots or args.list), command="queue"
    )
    from posenc_jax.bench import queue

    entries = queue.QUEUE
    if args.only is not None:
        entries = tuple(entry for entry in queue.QUEUE if entry.name == args.only)
        if not entries:
            names = ", ".join(entry.name for entry in queue.QUEUE)
            raise SystemExit(f"posenc-bench queue: no entry {args.only!r} in the queue; entries: {names}")
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget >= 0):
        raise SystemExit(f"posenc-bench queue: --budget must be a number of seconds >= 0, got {args.budget}")
    unit_seconds = queue.UNIT_SECONDS if args.unit_seconds is None else args.unit_seconds
    if not (math.isfinite(unit_seconds) and unit_seconds >= 0):
        raise SystemExit(f"posenc-bench queue: --unit-seconds must be a number of seconds >= 0, got {unit_seconds}")
    root = pathlib.Path(args.root)
    try:
        backend, rates, rates_name = queue.rates_for(args.device)
        if args.list:
            plans = queue.plan(entries, root, rates, unit_seconds=unit_seconds)
            print(
                f"posenc-bench queue: pending units (a cell's seeds, up to {unit_seconds:g} s together) under "
                f"{root}/, in the order they run, with the cost model's estimate at {rates_name} "
                f"(jax backend {backend})"
            )
            print(queue.describe(plans, rates_name))
            return 0
        done = queue.run_queue(
            entries,
            root,
            budget=args.budget,
            backend=backend,
            progress=_bars_wanted(args.no_progress),
            plots=not args.no_plots,
            unit_seconds=unit_seconds,
        )
    except ValueError as error:
        raise SystemExit(f"posenc-bench queue: {error}") from None
    return 1 if done["blocked"] else 0


class _Catalogue(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout; the catalogue is computed only when help is shown."""

    def _format_text(self, text):
        if text == "<catalogue>":
            from posenc_jax.bench.presets import catalogue

            text = catalogue()
        return super()._format_text(text)


def _parser() -> argparse.ArgumentParser:
    """The command line: ``extrapolate``, ``merge``, ``probe`` and ``queue``, each with its handler."""
    import posenc_jax

    parser = argparse.ArgumentParser(prog="posenc-bench", description="Benchmarks of posenc_jax.")
    parser.add_argument("--version", action="version", version=f"posenc-bench (posenc_jax) {posenc_jax.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_extrapolate, _add_merge, _add_probe, _add_queue):
        add(sub)
    return parser


def _add_extrapolate(sub) -> None:
    """``extrapolate``: what to run (preset, encodings, tasks, seeds, sizes, protocol) and how (its run handling)."""
    ex = sub.add_parser(
        "extrapolate",
        help="train short, test long, for each encoding and task",
        description="Train small Transformers on short inputs with each positional encoding and test them on "
        "longer ones. Re-running a command resumes it.",
        epilog="<catalogue>",
        formatter_class=_Catalogue,
    )
    from posenc_jax.bench.presets import PRESETS, PROTOCOLS
    from posenc_jax.bench.tasks import TASK_FORMATS

    ex.add_argument("--preset", default="cpu", help=f"one of {', '.join(PRESETS)} (default cpu; listed below)")
    ex.add_argument(
        "--encodings",
        type=_names,
        help="comma-separated registered encoding names; a+b for a hybrid (e.g. rope+randomized)",
    )
    ex.add_argument("--tasks", type=_names, help="comma-separated task names (listed below)")
    ex.add_argument("--seeds", type=_ints, help="comma-separated seeds (trained together)")
    ex.add_argument("--out", help="output folder (default results/extrapolation/<preset>)")
    ex.add_argument("--steps", type=int)
    ex.add_argument("--model-dim", type=int)
    ex.add_argument("--layers", type=int)
    ex.add_argument("--heads", type=int)
    ex.add_argument("--batch-size", type=int)
    ex.add_argument("--learning-rate", type=float)
    ex.add_argument("--train-length", type=int, help="longest training length of the algorithmic tasks")
    ex.add_argument(
        "--eval-lengths", type=_ints, help="comma-separated evaluation lengths of the algorithmic tasks (symbols)"
    )
    ex.add_argument("--text-context", type=int, help="training context of the text task (characters)")
    ex.add_argument(
        "--text-lengths",
        type=_ints,
        help="comma-separated evaluation lengths of the text task (characters, multiples of --text-context)",
    )
    ex.add_argument(
        "--text-corpus",
        "--corpus",
        dest="corpus",
        help="a text file or folder for the text task, or wikitext103 / tinyshakespeare "
        "(Hugging Face hub, needs the data extra); its SHA-256 replaces the preset's pin in run.json. "
        "Default: 78 standard-library Python files pinned by SHA-256 (refused where they differ)",
    )
    ex.add_argument(
        "--text-eval-characters",
        type=int,
        help="test characters every text length scores (a multiple of every text length)",
    )
    ex.add_argument(
        "--learned-threshold",
        type=float,
        help="score at the longest training length a seed must reach to count as learned (default 0.95)",
    )
    ex.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        help="fixed-budget (default: every encoding trains the same steps, steps to criterion recorded) or "
        "to-criterion (each seed stops once it has learned; the earlier method, named in every row)",
    )
    ex.add_argument(
        "--task-format",
        choices=TASK_FORMATS,
        help="ours (the benchmark's compact task formats) or paper (the formats of the papers' code: instruction "
        "words, separators and alphabets; decoder and encoder tasks only); default: the preset's",
    )
    _add_run_handling(ex)
    ex.set_defaults(handler=_extrapolate)


def _add_run_handling(ex) -> None:
    """``extrapolate``'s output, resuming and hosts: progress, plots, checkpoints, repair, hosts, processes."""
    ex.add_argument(
        "--no-progress", action="store_true", help="no progress bars (needs no tqdm; bars show only on a terminal)"
    )
    ex.add_argument("--no-plots", action="store_true", help="skip the PNG plots (needs no matplotlib)")
    ex.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each finished cell's trained models (orbax checkpoints); by default they are deleted once its "
        "rows are written, and only an unfinished cell's stay, to resume from",
    )
    ex.add_argument(
        "--repair",
        action="store_true",
        help="resume a folder whose run.json is missing, unreadable or edited by hand (which otherwise stops the run), "
        "saying so in a warning and in run.json's repairs; a damaged line of results.jsonl is deleted by hand",
    )
    ex.add_argument(
        "--host",
        help="INDEX/COUNT: this host's share of a run over COUNT hosts (every COUNT-th cell, from the INDEX-th), "
        "written to <out>/host-INDEX-of-COUNT; then `posenc-bench merge <out>`",
    )
    ex.add_argument(
        "--processes",
        type=int,
        default=1,
        help="N: train N cells at a time, in N processes on this machine (sharing its devices: small models on one "
        "GPU are bound by each process's host work), as --host i/N, then merge their folders into --out",
    )
    ex.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (a TPU pod slice, a GPU cluster) and take --host from its "
        "process index and count",
    )


def _add_merge(sub) -> None:
    """``merge``: host folders (or any folders of one preset's settings) joined into one."""
    mg = sub.add_parser(
        "merge",
        help="join the host folders of a run over several hosts (--host), or any results folders of one "
        "preset's settings, into one, and write its report",
    )
    mg.add_argument("out", help="the run's --out folder, holding host-INDEX-of-COUNT folders")
    mg.add_argument(
        "folders",
        nargs="*",
        help="results folders of one preset's settings to join instead (default: every host-INDEX-of-COUNT "
        "folder in out); no cell may be in two",
    )
    mg.add_argument("--no-plots", action="store_true", help="skip the PNG plots (needs no matplotlib)")
    mg.add_argument(
        "--partial",
        action="store_true",
        help="leave out folders with no finished cell yet (an interrupted run's), naming them in run.json and the "
        "report, instead of refusing them",
    )
    mg.set_defaults(handler=_merge)


def _add_probe(sub) -> None:
    """``probe``: the blind-spot probe."""
    pr = sub.add_parser(
        "probe", help="the blind-spot probe (Su 2022; Luo et al.): n identical tokens, per encoding x normaliser"
    )
    pr.add_argument("--preset", default="default", help="smoke or default")
    pr.add_argument("--encodings", type=_names)
    pr.add_argument("--normalizers", type=_names, help="softmax, l2, relu2, urpe")
    pr.add_argument("--seeds", type=_ints)
    pr.add_argument("--steps", type=int)
    pr.add_argument(
        "--query-init-scale",
        type=float,
        help="multiply every layer's initial query projection by this factor (e.g. 0.1), shrinking the initial "
        "scores; Su 2022 advises it for L2-normalised attention in a standard Attention + FFN block",
    )
    pr.add_argument("--out", help="output folder (default results/probe)")
    pr.add_argument("--no-progress", action="store_true")
    pr.set_defaults(handler=_probe)


def _add_queue(sub) -> None:
    """``queue``: the accelerator queue."""
    qu = sub.add_parser(
        "queue",
        help="run the accelerator queue: pending units (a cell's seeds) in priority order, into folders under docs/",
        description="Runs the accelerator queue (posenc_jax/bench/queue.py): its entries in priority order (gpu-long "
        "to 5 seeds; text at 10 seeds for the Press, Kerple/Sandwich and FIRE claims; PI and YaRN fine-tuned against "
        "the fine-tuned RoPE control; cpu-full's copy, duplicate and reverse; Kazemnejad et al.'s comparison at their "
        "lengths), each as units: one task x encoding and as many of its seeds as train together within "
        "--unit-seconds by the estimate, trained and evaluated by the runner alone. "
        "A unit whose rows are all in its folder is skipped, so running the command again goes on where it stopped. "
        "After each unit it rewrites the folder's report.md and plots and prints what is left, with the cost model's "
        "estimate for the device it finds (jax.default_backend(): the H200 fit on a GPU, the CPU fit on a CPU).",
    )
    qu.add_argument(
        "--list", action="store_true", help="print every pending unit with its estimate and the total; run nothing"
    )
    qu.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="start no unit whose estimate does not fit the time left of this many seconds (from the command's "
        "start), and stop there",
    )
    qu.add_argument("--only", metavar="NAME", help="run (or list) this entry of the queue alone")
    qu.add_argument(
        "--unit-seconds",
        type=float,
        metavar="SECONDS",
        help="the longest a unit of several seeds may be by the estimate (default 240; 0: one seed a unit)",
    )
    qu.add_argument(
        "--root", default="docs", metavar="DIR", help="the folder the entries' folders are in (default docs)"
    )
    qu.add_argument(
        "--device",
        choices=("cpu", "gpu", "tpu"),
        help="estimate for this JAX backend instead of the one found (e.g. --list --device gpu on a CPU)",
    )
    qu.add_argument("--no-plots", action="store_true", help="skip the PNG plots (needs no matplotlib)")
    qu.add_argument("--no-progress", action="store_true", help="no progress bars")
    qu.set_defaults(handler=_queue)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:  # Ctrl-C: one line that says what is kept and how to go on, not a traceback
        if args.command in ("extrapolate", "queue"):
            said = (
                "interrupted; the rows measured so far and the last checkpoints are kept: run the same command "
                "again to resume"
            )
        else:
            said = "interrupted: run the same command again"
        print(f"\nposenc-bench {args.command}: {said}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
