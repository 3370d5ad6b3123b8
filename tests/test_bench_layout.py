"""The benchmark's layout: settings flow one way, and a task is one module (its size cap: tests/test_sizes.py)."""

import ast
import dataclasses
import pathlib
from fractions import Fraction
from typing import ClassVar

import numpy as np
import pytest

from posenc_jax.bench import extrapolate, presets, results
from posenc_jax.bench.cost import cost
from posenc_jax.bench.tasks import TASKS, format_note, make_task, task_names, title
from posenc_jax.bench.tasks.base import Generated, TaskEntry, pad_rows

BENCH = pathlib.Path(presets.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_what_a_cell_reads_never_goes_back_to_the_presets():
    """A cell, what it measures, its seeds, the cost model and a task's resolved settings import no
    preset: the runner resolves each task's settings once and hands them down."""
    downstream = ("cell.py", "evaluation.py", "seeds.py", "cost.py", "settings.py")
    for name in downstream:
        imported = _imports(BENCH / name)
        assert not {m for m in imported if m.startswith(("posenc_jax.bench.preset", "posenc_jax.bench.extrapolate"))}, (
            name
        )
    # Only the preset itself applies a task's overrides.
    callers = [p.name for p in BENCH.rglob("*.py") if ".for_task(" in p.read_text()]
    assert callers == ["preset.py"]


def test_a_tasks_resolved_settings_are_the_preset_with_its_overrides():
    cpu = presets.PRESETS["cpu-full"]
    for name in ("copy", "text", "parity"):
        settings = cpu.resolve(cpu.task(name))
        own = cpu.for_task(name)
        assert (settings.steps, settings.num_layers, settings.seeds) == (own.steps, own.num_layers, cpu.seeds)
        assert settings.lengths == cpu.lengths(settings.task) and settings.preset == "cpu-full"
    assert cpu.resolve(cpu.task("copy")).num_layers == 4 != cpu.num_layers  # an override applied
    assert [v.label for v in cpu.resolve(cpu.task("copy")).variants("rope", "softmax")][0] == "rope+pi@eval"


@dataclasses.dataclass(frozen=True)
class _Majority(Generated):
    """Bits; the answer is whether ones are the majority (a task made here, registered as one module would)."""

    name: str = "majority"
    kind: ClassVar[str] = "encoder"
    metric: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    vocab_size: ClassVar[int] = 4
    slots_differ: ClassVar[bool] = False

    def max_tokens(self, n: int) -> int:
        return n + 1

    def batch(self, rng, lengths, *, split="train", pad_to=None):
        xs = [rng.integers(0, 2, int(n)) for n in lengths]
        total = pad_to or max(len(x) for x in xs) + 1
        inputs = pad_rows([[*x, 2] for x in xs], total, 3)
        targets = pad_rows([[3] * len(x) + [int(2 * x.sum() > len(x))] for x in xs], total, 3)
        weights = np.zeros((len(xs), total), np.float32)
        for i, x in enumerate(xs):
            weights[i, len(x)] = 1.0
        return {
            "inputs": inputs,
            "targets": targets,
            "weights": weights,
            "positions": np.arange(total, dtype=np.int32),
            "key_mask": inputs != 3,
        }

    def score(self, predictions, batch):
        w = batch["weights"]
        return ((predictions == batch["targets"]) * w).sum(-1) / w.sum(-1)

    def chance(self, n: int) -> float:
        return 0.5

    def baselines(self, n: int) -> dict:
        return self.baseline_scores(n, Fraction(1, 2), Fraction(1))


def test_a_new_task_is_one_registration(monkeypatch, tmp_path):
    """What a task module does (its class and one ``register_task``) is all the runner, the cost
    model, the baselines and the report need."""
    monkeypatch.setitem(
        TASKS, "majority", TaskEntry(lambda **settings: _Majority(), "Majority of bits (encoder)", short="majority")
    )
    assert "majority" in task_names() and isinstance(make_task("majority"), _Majority)
    assert title("majority") == "Majority of bits (encoder)" and format_note("majority", "ours") == ""
    with pytest.raises(ValueError, match="task 'majority' has no 'paper' format"):
        make_task("majority", format="paper")
    preset = dataclasses.replace(presets.PRESETS["smoke"], tasks=("majority",), encodings=("rope",))
    preset.validate()
    resolved = extrapolate._tasks(preset, None)
    known = extrapolate.baselines(resolved, tmp_path)
    assert known["majority"]["lengths"]["4"] == {"chance": 0.5, "position-only": 0.5, "content-only": 1.0}
    assert cost(preset).cells == 1
    assert results._short("majority") == "majority"
