"""Seeds trained together (one compiled step for all) against seeds trained one by one, side by side.

For each (task, encoding) cell of the ``cpu`` preset's model, in one process and in
alternating rounds: the plain reference trains each seed in turn with
``posenc_jax.training.train_step`` (one jitted step per seed, as the runner did before
seeds trained together); the benchmark's ``SeedGroup`` trains all seeds with one step,
``vmap``-ed (the seeds batched) or ``map``-ped (``jax.lax.map``: one after another inside
the one program). All draw the same batches (the benchmark's ``train_batch``, generated
on the host inside the timed loop, as in a run). Prints the median over rounds of
seeds x steps per second, the median of the per-round speed-ups over one by one, and each
path's first step (compilation), which is outside the timed rounds.

    python benchmarks/seed_vmap.py                      # counting_copy and text, rope and alibi, 3 seeds
    python benchmarks/seed_vmap.py --seeds 2 --rounds 7 --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from posenc_jax.bench.cell import Cell, SeedGroup, build, encodings_for, train_batch
from posenc_jax.bench.presets import PRESETS
from posenc_jax.bench.tasks import make_task
from posenc_jax.training import train_step


def _cell(preset, task_name: str, encoding: str) -> Cell:
    return Cell(preset.resolve(make_task(task_name)), encoding, "softmax")


def _models(cell, preset, seeds):
    configs = encodings_for(cell.encoding, cell.settings.head_dim, cell.train_tokens, cell.max_tokens)
    return [build(cell, configs, seed) for seed in seeds]


def _one_by_one(cell, preset, seeds, pairs, steps, first):
    """Steps ``first .. first + steps`` of each seed in turn; returns the seconds."""
    began = time.perf_counter()
    loss = None
    for seed, (model, optimizer) in zip(seeds, pairs, strict=True):
        for step in range(first, first + steps):
            batch = {k: np.asarray(v) for k, v in train_batch(cell.settings, seed, step).items()}
            loss = train_step(model, optimizer, batch)
    jax.block_until_ready(loss)
    return time.perf_counter() - began


def _together(cell, preset, seeds, group, steps, first):
    began = time.perf_counter()
    losses = None
    for step in range(first, first + steps):
        per_seed = [train_batch(cell.settings, seed, step) for seed in seeds]
        losses = group.step({name: np.stack([b[name] for b in per_seed]) for name in per_seed[0]})
    jax.block_until_ready(losses)
    return time.perf_counter() - began


def measure(task_name: str, encoding: str, *, seeds, rounds: int, steps: int) -> dict:
    preset = PRESETS["cpu"]
    cell = _cell(preset, task_name, encoding)
    reference = _models(cell, preset, seeds)
    groups = {}
    for batched in (True, False):
        pairs = _models(cell, preset, seeds)
        groups[batched] = SeedGroup([m for m, _ in pairs], [o for _, o in pairs], batched=batched)
    # The first step compiles: timed apart, outside the rounds.
    compile_seconds = {"one": _one_by_one(cell, preset, seeds, reference, 1, 0)}
    for batched, group in groups.items():
        compile_seconds[batched] = _together(cell, preset, seeds, group, 1, 0)
    rates = {"one": [], True: [], False: []}
    first = 1
    for _ in range(rounds):
        rates["one"].append(len(seeds) * steps / _one_by_one(cell, preset, seeds, reference, steps, first))
        for batched, group in groups.items():
            rates[batched].append(len(seeds) * steps / _together(cell, preset, seeds, group, steps, first))
        first += steps
    ratio = {b: [t / o for t, o in zip(rates[b], rates["one"], strict=True)] for b in (True, False)}
    return {
        "cell": f"{task_name} / {encoding}",
        "rates": {k: statistics.median(v) for k, v in rates.items()},
        "ratio": {b: statistics.median(r) for b, r in ratio.items()},
        "compile": compile_seconds,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="counting_copy,text")
    parser.add_argument("--encodings", default="rope,alibi")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="training steps per seed per round")
    args = parser.parse_args(argv)
    seeds = list(range(args.seeds))
    print(
        f"cpu preset model (2 x 64, batch 32), {args.seeds} seeds, {args.rounds} rounds of {args.steps} steps; "
        f"{jax.devices()[0].device_kind} x {jax.local_device_count()}; seeds x steps per second, median over rounds"
    )
    print(
        f"{'cell':24s} {'one by one':>10s} {'vmap':>12s} {'map':>12s}   first step (compilation): one by one, vmap, map"
    )
    for task_name in args.tasks.split(","):
        for encoding in args.encodings.split(","):
            r = measure(task_name, encoding, seeds=seeds, rounds=args.rounds, steps=args.steps)
            rates, ratio, first = r["rates"], r["ratio"], r["compile"]
            print(
                f"{r['cell']:24s} {rates['one']:10.1f} {rates[True]:6.1f} ({ratio[True]:.2f}x) "
                f"{rates[False]:6.1f} ({ratio[False]:.2f}x)   "
                f"{first['one']:.1f}s, {first[True]:.1f}s, {first[False]:.1f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()
