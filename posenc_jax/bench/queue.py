"""The accelerator queue: the runs that need an accelerator, as units of a few minutes in priority order.

An accelerator is lent for minutes at a time and nothing on it survives the loan, so the unit of
work is one cell's seeds: one task x encoding and as many of its pending seeds as the cost model
puts within :data:`UNIT_SECONDS` together (the seeds of a cell train in one compiled program, so
on an accelerator five cost little more than one; a cell too long for that goes seed by seed),
trained and evaluated by the ordinary runner (:func:`posenc_jax.bench.extrapolate.run`) with the
preset restricted to it, its rows written to the entry's folder under ``docs/`` as they are
measured. :data:`QUEUE` declares the entries, in
priority order; :func:`plan` finds each entry's units whose rows are not all in its folder (the
runner's own :func:`~posenc_jax.bench.extrapolate.plan` decides, so a unit counts as done exactly
when the runner would skip it), each with the cost model's estimate (:func:`~posenc_jax.bench.cost.cell_cost`
of one seed at the rates of the device found: :func:`rates_for`); :func:`run_queue` runs them in
order, rewriting the folder's ``report.md`` and plots after each and saying what is left.

``posenc-bench queue`` is the command line (``--list``, ``--budget``, ``--only``, ``--root``).

A folder killed mid-unit stays consistent: the rows already measured stay (one whole line each),
the runner resumes the unit from its checkpoints when they are there (and trains it again when
they are not, as after a loan), and ``run.json`` asks for the unit's rows before it starts, so
the folder's report reads the rows of a unit cut short.

Within an entry the units go chunk by chunk (every cell's first seeds, then its next ones), so a
queue stopped part way leaves the cells of an entry with the same seeds, not some cells finished
and others missing. A unit two entries share (the text RoPE cell, whose fine-tuned scalings are their
own entry) is run and counted once, in the first.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence

from posenc_jax.bench.cost import CPU_ESTIMATE, H200_ESTIMATE, TPU_ESTIMATE, Rates, cell_cost, duration
from posenc_jax.bench.presets import PRESETS, Preset

__all__ = ["QUEUE", "RATES", "Entry", "EntryPlan", "Unit", "describe", "plan", "rates_for", "run_queue"]

_TEN_SEEDS = tuple(range(10))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of the queue: the cells of ``preset`` (restricted to ``tasks`` and ``encodings``)
    at ``seeds``, written to ``folder`` (relative to the queue's root, ``docs/`` by default).
    ``why`` says in a line what the entry settles."""

    name: str
    preset: str
    folder: str
    tasks: tuple[str, ...]
    encodings: tuple[str, ...]
    seeds: tuple[int, ...]
    why: str = ""

    def preset_of(self, presets: Mapping[str, Preset] = PRESETS) -> Preset:
        """The preset the entry's folder is a run of: the named one with the entry's lists."""
        if self.preset not in presets:
            raise ValueError(f"queue entry {self.name}: unknown preset {self.preset!r}; presets: {', '.join(presets)}")
        return dataclasses.replace(presets[self.preset], tasks=self.tasks, encodings=self.encodings, seeds=self.seeds)


# The queue, in the priority order of issue 53 ("The accelerator list"). The folders' results
# fingerprints (posenc_jax.bench.ledger.fingerprint) are those of the presets as they are now, so
# none of the folders of the runs made before the fixed-budget protocol can take these rows: the
# entries write to folders of their own (docs/extrapolation-gpu-long-partial, gpu-long's 3-seed
# run, was made under the earlier method and keeps its rows).
QUEUE: tuple[Entry, ...] = (
    Entry(
        name="gpu-long",
        preset="gpu-long",
        folder="extrapolation-gpu-long",
        tasks=("text",),
        encodings=PRESETS["gpu-long"].encodings,
        seeds=(0, 1, 2, 3, 4),
        why="the text claims trained at 256 characters and tested to 128x, every seed at one budget",
    ),
    Entry(
        name="text-claims",
        preset="gpu-text",
        folder="extrapolation-gpu-text-10-seeds",
        tasks=("text",),
        encodings=PRESETS["gpu-text"].encodings,
        seeds=_TEN_SEEDS,
        why="Press et al.'s, Kerple's and Sandwich's and FIRE's text claims at 10 seeds, with equivalence tests "
        "(margin 0.05 bits per character)",
    ),
    # PI and YaRN fine-tuned, and plain RoPE fine-tuned the same way as their control, are the
    # variants of gpu-text's RoPE cell (TaskSettings.variants, finetune_scalings): its units are
    # those of text-claims' RoPE cell, run once, there; `--only rope-finetune` runs them first.
    Entry(
        name="rope-finetune",
        preset="gpu-text",
        folder="extrapolation-gpu-text-10-seeds",
        tasks=("text",),
        encodings=("rope",),
        seeds=_TEN_SEEDS,
        why="Chen et al.'s PI and Peng et al.'s YaRN fine-tuned against RoPE fine-tuned the same way, 10 seeds",
    ),
    # None of cpu-full's folders holds copy, duplicate or reverse rows of its present settings
    # (docs/extrapolation-cpu-full has none of these tasks; docs/extrapolation-kazemnejad's rows of
    # them, 5 encodings, were made to criterion under the earlier method), so every encoding is
    # pending: the five the papers compare are the reference the other twenty are compared with.
    Entry(
        name="cpu-full-decoder",
        preset="cpu-full",
        folder="extrapolation-cpu-full-decoder",
        tasks=("copy", "duplicate", "reverse"),
        encodings=PRESETS["cpu-full"].encodings,
        seeds=PRESETS["cpu-full"].seeds,
        why="cpu-full's copy, duplicate and reverse (4 x 64, 10,000 steps), too long for the CPU",
    ),
    Entry(
        name="kazemnejad-long",
        preset="kazemnejad-long",
        folder="extrapolation-kazemnejad-long",
        tasks=PRESETS["kazemnejad-long"].tasks,
        encodings=PRESETS["kazemnejad-long"].encodings,
        seeds=PRESETS["kazemnejad-long"].seeds,
        why="Kazemnejad et al.'s comparison at their lengths (train 4-20, test 21-40), 4 x 256",
    ),
)

# The cost model's rates per JAX backend (jax.default_backend()), with what they were fitted to.
RATES: dict[str, tuple[Rates, str]] = {
    "gpu": (H200_ESTIMATE, "the H200 fit"),
    "cpu": (CPU_ESTIMATE, "the 2-core CPU fit"),
    "tpu": (TPU_ESTIMATE, "the TPU assumption (the H200's time)"),
}


def rates_for(backend: str | None = None) -> tuple[str, Rates, str]:
    """``(backend, rates, what they are)`` for ``backend`` (default: ``jax.default_backend()``)."""
    if backend is None:
        import jax

        backend = jax.default_backend()
    if backend not in RATES:
        raise ValueError(f"no cost-model rates for the {backend!r} backend; known: {', '.join(RATES)}")
    return (backend, *RATES[backend])


# The longest a unit may be, by the cost model, when it holds more than one seed: a command on a
# lent accelerator runs at most 10 minutes, and a unit cut short there loses what it trained.
UNIT_SECONDS = 240.0


@dataclasses.dataclass(frozen=True)
class Unit:
    """One cell's seeds left to run, trained together (the seeds of a cell share one compiled
    program, so on an accelerator k seeds cost little more than one): ``seconds`` is the cost
    model's estimate of training and evaluating them (compilation included)."""

    entry: str
    folder: pathlib.Path
    task: str
    encoding: str
    seeds: tuple[int, ...]
    seconds: float

    @property
    def key(self) -> tuple:
        return (str(self.folder), self.task, self.encoding, self.seeds)

    def __str__(self) -> str:
        seeds = ", ".join(map(str, self.seeds))
        return f"{self.task} {self.encoding} seed{'s' if len(self.seeds) > 1 else ''} {seeds}"


def _chunks(seeds: Sequence[int], cost: Callable[[tuple[int, ...]], float], limit: float) -> list[tuple[int, ...]]:
    """``seeds`` cut, in order, into runs as long as the cost model keeps each within ``limit``
    seconds (one seed at least)."""
    chunks: list[tuple[int, ...]] = []
    for seed in seeds:
        if chunks and cost((*chunks[-1], seed)) <= limit:
            chunks[-1] = (*chunks[-1], seed)
        else:
            chunks.append((seed,))
    return chunks


@dataclasses.dataclass
class EntryPlan:
    """An entry's folder, the results fingerprint its rows carry, its pending units, the units it
    shares with an earlier entry (``shared``: unit key -> that entry), and why it cannot run
    (``blocked``: rows of other settings in its folder), if it cannot."""

    entry: Entry
    folder: pathlib.Path
    settings: str
    units: list[Unit]
    shared: dict[tuple, str] = dataclasses.field(default_factory=dict)
    blocked: str = ""

    @property
    def seconds(self) -> float:
        return sum(unit.seconds for unit in self.units)


class _Rows:
    """The rows in a folder as the runner's plan asks about them (``done``), read without changing
    the file: a last row cut short by a kill is left out (the runner drops it and measures it again)."""

    def __init__(self, folder: pathlib.Path):
        import json

        self.rows = []
        self._done = set()
        path = folder / "results.jsonl"
        if not path.exists():
            return
        data = path.read_bytes()
        lines = data.split(b"\n")
        if lines and lines[-1].strip():  # no newline after it: cut short by a kill, unless whole
            try:
                json.loads(lines[-1])
            except ValueError:
                lines = lines[:-1]
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (row["task"], row["encoding"], int(row["seed"]), int(row["length"]))
            except (ValueError, TypeError, KeyError):
                raise ValueError(
                    f"{path} line {number} is no result row; the runner refuses the folder until it is fixed "
                    "(`posenc-bench extrapolate` names the fix)"
                ) from None
            self.rows.append((key, row.get("settings")))
        self._done = {key for key, _ in self.rows}

    def done(self, task: str, label: str, seed: int, length: int) -> bool:
        return (task, label, seed, int(length)) in self._done

    def settings(self) -> set:
        return {settings for _, settings in self.rows}


def _tasks_and_settings(preset: Preset) -> tuple[dict, str]:
    """The preset's tasks' resolved settings (checked against their lengths, as a run checks them) and the results
    fingerprint its rows carry; every task of an entry must give the same fingerprint, since a unit
    runs one task and a folder holds rows of one fingerprint."""
    from posenc_jax.bench.extrapolate import _tasks, pin_corpus
    from posenc_jax.bench.ledger import fingerprint

    tasks = _tasks(preset, None)
    found = {}
    for name, resolved in tasks.items():
        task = resolved.task
        alone = pin_corpus(dataclasses.replace(preset, tasks=(name,)), {name: task}, None)
        found[name] = fingerprint(alone, data=task.digest if name == "text" else None)
    if len(set(found.values())) > 1:
        raise ValueError(
            f"preset {preset.name}: its tasks' units would write rows of different settings ({found}; text rows "
            "carry the corpus's digest); give text an entry and folder of its own"
        )
    return tasks, next(iter(found.values()))


def plan(
    entries: Sequence[Entry] = QUEUE,
    root: str | pathlib.Path = "docs",
    rates: Rates = H200_ESTIMATE,
    *,
    presets: Mapping[str, Preset] = PRESETS,
    unit_seconds: float = UNIT_SECONDS,
) -> list[EntryPlan]:
    """Each entry's pending units under ``root``, in the order they run, with their estimates at
    ``rates``: a cell's pending seeds, as many together as fit ``unit_seconds`` by the estimate (0:
    one seed a unit). A cell-seed an earlier entry holds is run there alone."""
    from posenc_jax.bench import extrapolate

    root = pathlib.Path(root)
    seen: dict[tuple, str] = {}
    plans = []
    for entry in entries:
        preset = entry.preset_of(presets)
        preset.validate()
        tasks, settings = _tasks_and_settings(preset)
        folder = root / entry.folder
        rows = _Rows(folder)
        foreign = sorted(map(str, rows.settings() - {settings}))
        blocked = ""
        if foreign:
            blocked = (
                f"{folder} holds rows of other settings ({', '.join(foreign)}; the preset's are now {settings}): "
                "point the entry at a new folder"
            )
        cells = extrapolate.plan(preset, tasks, rows, log=lambda line: None)
        pending: dict[tuple, set] = {}  # (task, trained encoding) -> seeds with a row to measure
        planned: dict[tuple, object] = {}  # (task, trained encoding) -> its cell
        for cell, todo in cells:
            pending.setdefault((cell.task_name, cell.encoding), set()).update(todo)
            planned[cell.task_name, cell.encoding] = cell
        order = {
            "task": {t: i for i, t in enumerate(entry.tasks)},
            "encoding": {e: i for i, e in enumerate(entry.encodings)},
        }
        found = EntryPlan(entry, folder, settings, [], blocked=blocked)
        units = []
        for task, encoding in sorted(pending, key=lambda k: (order["task"][k[0]], order["encoding"][k[1]])):

            def cost(seeds, cell=planned[task, encoding]):
                return cell_cost(cell.settings.with_seeds(seeds), cell.encoding, cell.normalizer).seconds(rates)

            mine = []
            for seed in (s for s in entry.seeds if s in pending[task, encoding]):
                key = (str(folder), task, encoding, seed)
                if key in seen:
                    found.shared[key] = seen[key]
                else:
                    seen[key] = entry.name
                    mine.append(seed)
            for index, chunk in enumerate(_chunks(mine, cost, unit_seconds)):
                units.append((index, Unit(entry.name, folder, task, encoding, chunk, cost(chunk))))
        # Chunk by chunk (every cell's first seeds, then its next ones), so a queue stopped part
        # way leaves the cells of an entry with the same seeds.
        found.units = [unit for _, unit in sorted(units, key=lambda pair: pair[0])]
        plans.append(found)
    return plans


def describe(plans: Sequence[EntryPlan], rates_name: str, *, units: bool = True) -> str:
    """The plan as ``--list`` prints it: per entry its folder, pending units (each with its
    estimate, when ``units``) and their total; then the total of all."""
    lines = []
    for number, found in enumerate(plans, start=1):
        entry = found.entry
        shared = sorted(set(found.shared.values()))
        also = f", {len(found.shared)} more in {', '.join(shared)}" if found.shared else ""
        lines.append(
            f"{number}. {entry.name} -> {found.folder} (preset {entry.preset}, settings {found.settings}): "
            f"{len(found.units)} units pending{also}, about {duration(found.seconds)}"
        )
        if entry.why:
            lines.append(f"   {entry.why}")
        if found.blocked:
            lines.append(f"   BLOCKED: {found.blocked}")
        if units:
            lines += [f"   {str(unit):40s} about {duration(unit.seconds)}" for unit in found.units]
    pending = [unit for found in plans if not found.blocked for unit in found.units]
    lines.append(
        f"total: {len(pending)} units, about {duration(sum(u.seconds for u in pending))} at {rates_name}"
        + (f" ({sum(bool(p.blocked) for p in plans)} entries blocked)" if any(p.blocked for p in plans) else "")
    )
    return "\n".join(lines)


def _row_encodings(entry: Entry, labels: set) -> list[str]:
    """The entry's encodings that have rows among ``labels`` (row labels: ``rope``, ``alibi|l2``;
    a variant's, ``rope+pi@ft``, is its trained encoding's too, which has rows of its own)."""
    return [e for e in entry.encodings if e in labels or any(label.startswith(f"{e}|") for label in labels)]


def _note(folder: pathlib.Path, entry: Entry, settings: str, asked: dict | None = None) -> None:
    """Rewrites the folder's ``run.json`` (through its ledger, digests and all) so that it records
    the run the folder holds: the preset with the entry's tasks, encodings and seeds that have rows
    (a unit's own sitting records its one task, encoding and seed), the entry (``queue``), and, with
    ``asked``, the rows a unit about to run will write, so a report reads them if it is cut short."""
    from posenc_jax.bench.ledger import Ledger, read_json

    run_json = folder / "run.json"
    if not run_json.exists():
        return
    record = read_json(run_json, "run record")
    if record.get("settings") != settings or not isinstance(record.get("preset"), dict):
        return
    record.pop("digests", None)
    rows = _Rows(folder).rows
    labels = {key[1] for key, _ in rows}
    record["preset"] = {
        **record["preset"],
        "tasks": [t for t in entry.tasks if any(key[0] == t for key, _ in rows)],
        "encodings": _row_encodings(entry, labels),
        "seeds": sorted({key[2] for key, _ in rows}),
    }
    record["queue"] = {
        "entry": entry.name,
        "tasks": list(entry.tasks),
        "encodings": list(entry.encodings),
        "seeds": list(entry.seeds),
    }
    if asked:
        merged = {task: set(labels) for task, labels in (record.get("asked") or {}).items()}
        for task, more in asked.items():
            merged.setdefault(task, set()).update(more)
        record["asked"] = {task: sorted(labels) for task, labels in merged.items()}
    Ledger(folder, settings).save_record(record)


def _run_unit(unit: Unit, found: EntryPlan, preset: Preset, *, progress: bool, plots: bool, log) -> None:
    """Runs one unit with the runner (the preset restricted to its task, encoding and seed),
    holding the folder's lock, then writes the folder's record, report and plots."""
    from posenc_jax.bench import extrapolate
    from posenc_jax.bench import report as reporting
    from posenc_jax.bench.ledger import FolderLock, check_writable

    single = dataclasses.replace(preset, tasks=(unit.task,), encodings=(unit.encoding,), seeds=unit.seeds)
    check_writable(found.folder)
    with FolderLock(found.folder):
        tasks = extrapolate._tasks(single, None)
        _note(found.folder, found.entry, found.settings, extrapolate.asked(single, tasks))
        extrapolate.run(single, found.folder, progress=progress, log=log, lock=False)
        _note(found.folder, found.entry, found.settings)
        reporting.write_report(found.folder, plots=plots)
        if plots:
            reporting.plot(found.folder)


def run_queue(
    entries: Sequence[Entry] = QUEUE,
    root: str | pathlib.Path = "docs",
    *,
    budget: float | None = None,
    backend: str | None = None,
    presets: Mapping[str, Preset] = PRESETS,
    progress: bool = False,
    plots: bool = True,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    unit_seconds: float = UNIT_SECONDS,
) -> dict:
    """Runs the pending units of ``entries`` in order, each alone (:func:`_run_unit`), printing
    after each what is left with the cost model's estimate for the device found (``backend``:
    ``jax.default_backend()`` unless given).

    With ``budget`` (seconds from the call), no unit starts whose estimate does not fit the time
    left: the queue stops there. The estimate used is the cost model's times the ratio of this
    sitting's measured time to the model's for the units run so far (at least half the model's: a
    unit cut short by the end of a loan loses what it trained).

    Returns:
      ``{"ran": [units], "left": [units], "blocked": [entry names], "stopped": reason or ""}``.
    """
    began = clock()
    backend, rates, rates_name = rates_for(backend)
    plans = plan(entries, root, rates, presets=presets, unit_seconds=unit_seconds)
    blocked = [found.entry.name for found in plans if found.blocked]
    for found in plans:
        if found.blocked:
            log(f"posenc-bench queue: skipping {found.entry.name}: {found.blocked}")
    queue = [(unit, found) for found in plans if not found.blocked for unit in found.units]
    log(
        f"posenc-bench queue: {len(queue)} units pending, about {duration(sum(u.seconds for u, _ in queue))} "
        f"at {rates_name} (jax backend {backend})" + (f"; budget {duration(budget)}" if budget is not None else "")
    )
    ran, measured, modelled, stopped = [], 0.0, 0.0, ""
    for index, (unit, found) in enumerate(queue):
        pace = max(0.5, measured / modelled) if modelled else 1.0
        needed = unit.seconds * pace
        if budget is not None and needed > budget - (clock() - began):
            left = max(0.0, budget - (clock() - began))
            stopped = (
                f"the next unit ({found.entry.name}: {unit}) needs about {duration(needed)} and "
                f"{duration(left)} of the budget is left"
            )
            log(f"posenc-bench queue: stopping: {stopped}; " + ("nothing run" if not ran else f"{len(ran)} units run"))
            break
        log(f"posenc-bench queue: {found.entry.name}: {unit} -> {found.folder} (about {duration(unit.seconds)})")
        start = clock()
        _run_unit(unit, found, found.entry.preset_of(presets), progress=progress, plots=plots, log=log)
        took = clock() - start
        measured, modelled = measured + took, modelled + unit.seconds
        ran.append(unit)
        rest = [u for u, _ in queue[index + 1 :]]
        per_entry = {}
        for u in rest:
            per_entry[u.entry] = per_entry.get(u.entry, 0) + 1
        log(
            f"posenc-bench queue: done {found.entry.name}: {unit} in {duration(took)} (estimate "
            f"{duration(unit.seconds)}); left: {len(rest)} units, about {duration(sum(u.seconds for u in rest))} at "
            f"{rates_name}" + (f" ({', '.join(f'{k} {v}' for k, v in per_entry.items())})" if per_entry else "")
        )
    done = {u.key for u in ran}
    left = [u for u, _ in queue if u.key not in done]
    if not queue:
        log("posenc-bench queue: nothing pending" + (" (but blocked entries)" if blocked else ""))
    return {"ran": ran, "left": left, "blocked": blocked, "stopped": stopped}
