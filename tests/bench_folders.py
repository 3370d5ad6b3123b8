"""A results folder written by hand, for the tests of what the benchmark reads from one."""

import dataclasses
import json

from posenc_jax.bench import baselines, presets
from posenc_jax.bench.tasks import make_task


def write_folder(folder, values_by_encoding, *, train_length=8, lengths=(4, 8, 12, 16), preset=None):
    """A results folder: ``values_by_encoding[encoding][seed] = (at training length, beyond)``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for encoding, per_seed in values_by_encoding.items():
        for seed, (inside, beyond) in per_seed.items():
            for n in lengths:
                value = 1.0 if n < train_length else inside if n == train_length else beyond
                rows.append(
                    {
                        "task": "copy",
                        "encoding": encoding,
                        "seed": seed,
                        "length": n,
                        "metric": "exact_match",
                        "value": value,
                        "train_length": train_length,
                        "in_distribution": n <= train_length,
                        "steps": 100,
                    }
                )
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preset = preset or dataclasses.asdict(presets.PRESETS["cpu"])
    (folder / "run.json").write_text(json.dumps({"preset": preset}))
    task = make_task("copy")
    known = {"copy": {"lengths": {str(n): baselines.algorithmic_baselines(task, n) for n in lengths}}}
    (folder / "baselines.json").write_text(json.dumps(known))
