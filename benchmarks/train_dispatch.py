"""Training steps per second: batches made on the host, one step a call, against batches made on
the device, one step or K steps a call (``Preset.batches``, ``Preset.steps_per_dispatch``).

For each cell, in one process and in alternating rounds, the three ways train the same seeds'
models (each way its own copies) with the benchmark's own code: ``host, 1`` makes every seed's
batch with numpy (``train_batch``) and calls ``SeedGroup.step`` once a step, as runs did before
device batches; ``device, 1`` calls ``SeedGroup.train`` once a step, the batches made inside the
program; ``device, K`` runs K steps a call (a ``lax.scan`` over steps). The first call of each
way compiles and is timed apart; the rates are the medians over rounds of steps per second (a
step trains every seed of the cell), after compilation. The cells:

* ``text``: gpu-long's model (4 x 256, 8 heads, MLP 1024), context 256, batch 32, RoPE;
* ``decoder``: colab-tpu's model (4 x 256, 8 heads, MLP 1024) on copy in the papers' format,
  lengths 1-20, batch 64, RoPE.

``--small`` scales both down for a CPU (2 x 64, 4 heads, MLP 256; text context 64, batch 16;
copy lengths 1-10, batch 32).

    python benchmarks/train_dispatch.py                          # an accelerator: gpu-long's sizes
    python benchmarks/train_dispatch.py --small --steps 64 --rounds 3   # a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.bench.cell import Cell, SeedGroup, build, encodings_for, train_batch
from posenc_jax.bench.device_batches import DeviceBatches, seed_key
from posenc_jax.bench.presets import PRESETS
from posenc_jax.bench.tasks import make_task


def _preset(cell: str, small: bool):
    """The preset a cell trains with: gpu-long's (text) or colab-tpu's (decoder) settings, or
    smaller ones for a CPU."""
    if cell == "text":
        preset = dataclasses.replace(PRESETS["gpu-long"], batches="host", steps_per_dispatch=1)
        if small:
            preset = dataclasses.replace(
                preset, model_dim=64, num_layers=2, num_heads=4, mlp_dim=256, text_context=64, batch_size=16
            )
    else:
        preset = dataclasses.replace(PRESETS["colab-tpu"], batches="host", steps_per_dispatch=1)
        if small:
            preset = dataclasses.replace(
                preset, model_dim=64, num_layers=2, num_heads=4, mlp_dim=256, train_length=10, batch_size=32
            )
    return preset


def _cell(cell: str, preset, corpus: str | None) -> Cell:
    if cell == "text":
        return Cell(preset.resolve(make_task("text", corpus=corpus)), "rope", "softmax")
    return Cell(preset.resolve(make_task("copy", format="paper")), "rope", "softmax")


class Way:
    """One way of training the seeds: ``run(first, steps)`` trains steps ``first .. first + steps``
    and waits for them."""

    def __init__(self, cell: Cell, preset, seeds, batches: str, per_call: int):
        self.cell, self.preset, self.seeds = cell, preset, list(seeds)
        self.batches, self.per_call = batches, per_call
        self.name = f"{batches}, {per_call}"
        configs = encodings_for(cell.encoding, cell.settings.head_dim, cell.train_tokens, cell.max_tokens)
        pairs = [build(cell, configs, seed) for seed in self.seeds]
        self.group = SeedGroup([m for m, _ in pairs], [o for _, o in pairs])
        if batches == "device":
            self.make = DeviceBatches(cell.task, cell.lengths, preset.batch_size)
            self.data, self.keys = self.group.replicate(
                (self.make.data, jnp.stack([seed_key(seed) for seed in self.seeds]))
            )

    def run(self, first: int, steps: int) -> float:
        """Trains ``steps`` steps from ``first``; returns the seconds, the host's work included."""
        began = time.perf_counter()
        losses = None
        for step in range(first, first + steps, self.per_call):
            if self.batches == "device":
                losses = self.group.train(self.make, self.data, self.keys, step, self.per_call)
            else:
                per_seed = [train_batch(self.cell.settings, s, step) for s in self.seeds]
                losses = self.group.step({name: np.stack([b[name] for b in per_seed]) for name in per_seed[0]})
        jax.block_until_ready((losses, self.group.state))
        return time.perf_counter() - began


def measure(cell_name: str, *, small: bool, seeds, steps: int, rounds: int, per_call: int, corpus) -> dict:
    preset = _preset(cell_name, small)
    cell = _cell(cell_name, preset, corpus)
    ways = [Way(cell, preset, seeds, "host", 1), Way(cell, preset, seeds, "device", 1)]
    ways.append(Way(cell, preset, seeds, "device", per_call))
    compile_seconds = {way.name: way.run(0, way.per_call) for way in ways}  # the first call compiles
    rates = {way.name: [] for way in ways}
    first = per_call  # every way past its first call; a multiple of K, as in a run
    for _ in range(rounds):
        for way in ways:
            rates[way.name].append(steps / way.run(first, steps))
        first += steps
    size = f"{preset.num_layers} x {preset.model_dim}, {preset.num_heads} heads, batch {preset.batch_size}"
    tokens = cell.train_tokens
    return {
        "cell": f"{cell_name} ({cell.task_name} / {cell.encoding}, {size}, {tokens} tokens, {len(seeds)} seeds)",
        "rates": {name: statistics.median(r) for name, r in rates.items()},
        "compile": compile_seconds,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="text,decoder", help="text, decoder or both (comma-separated)")
    parser.add_argument("--small", action="store_true", help="models and batches scaled down for a CPU")
    parser.add_argument("--seeds", type=int, default=3, help="seeds trained together (gpu-long's 3)")
    parser.add_argument("--steps", type=int, default=256, help="steps per way per round (a multiple of --per-call)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-call", type=int, default=32, help="K, the steps a dispatch of the third way")
    parser.add_argument("--corpus", default=None, help="the text task's corpus (default: the pinned stdlib corpus)")
    args = parser.parse_args(argv)
    if args.steps % args.per_call:
        parser.error(f"--steps {args.steps} must be a multiple of --per-call {args.per_call}")
    device = jax.devices()[0]
    print(
        f"{device.platform} ({device.device_kind}) x {jax.local_device_count()}; {args.rounds} rounds of {args.steps} "
        "steps; steps per second (every seed of the cell a step), median over rounds, after compilation"
    )
    for cell_name in args.cells.split(","):
        r = measure(
            cell_name,
            small=args.small,
            seeds=range(args.seeds),
            steps=args.steps,
            rounds=args.rounds,
            per_call=args.per_call,
            corpus=args.corpus,
        )
        print(r["cell"])
        host = r["rates"]["host, 1"]
        for name, rate in r["rates"].items():
            print(
                f"  batches {name:>12s} step(s) a call: {rate:8.1f} steps/s  ({rate / host:5.2f}x host, 1)   "
                f"first call {r['compile'][name]:.1f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
