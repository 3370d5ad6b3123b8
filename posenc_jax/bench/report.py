"""The report of a results folder: ours, with baselines and published figures beside them (the
plots, which it re-exports, are :mod:`posenc_jax.bench.plots`).

Every score shown comes from a cell that learned its task in distribution
(:mod:`posenc_jax.bench.results`), as the mean over all its seeds with a 95% interval (inside
[0, 1] for a bounded score); tables and the plots' bands say the same thing. Orderings are
corrected for multiplicity over each task's table (Holm), and ties are claimed only by an
equivalence test. Unlearned cells read "not learned"
in the tables and are drawn hollow and grey in the plots, never as a score. Baselines
(chance, position-only, content-only; n-gram models for text) are rows in the tables and
lines in the plots.
"""

from __future__ import annotations

import pathlib

import numpy as np

import posenc_jax.bench.published as published
from posenc_jax.bench.plots import FAMILIES, family, figure, plot
from posenc_jax.bench.results import Results, cells, comparison, protocol, read, summarize
from posenc_jax.bench.tasks import format_note, title

__all__ = ["FAMILIES", "PUBLISHED", "family", "figure", "plot", "write_report"]

# Kazemnejad et al. 2023's decoder tasks, as posenc_jax/bench/published.json holds them (with their
# source: the authors' result rows, aggregated as BENCHMARKS.md says). Their "APE" is sinusoidal.
PUBLISHED_GROUP = "kazemnejad2023-test-21-40"
PUBLISHED = published.by_task(PUBLISHED_GROUP)
PUBLISHED_PROTOCOL = published.source_line(PUBLISHED_GROUP)
# The shape only: the appendix's perplexities are not re-verified against a stored copy of the
# paper (BENCHMARKS.md), so no number of theirs is printed with it.
TEXT_REFERENCE = (
    "Press et al. 2022 (arXiv:2108.12409; WikiText-103, 16 x 1024, trained at 512; the shape of their appendix's "
    "perplexities, not re-verified here): past the training length sinusoidal explodes, rotary degrades slowly, T5 "
    "holds a while, ALiBi stays flat."
)


def _protocol(preset: dict) -> list[str]:
    text = "text" in preset["tasks"]
    algorithmic = any(task != "text" for task in preset["tasks"])
    trained = protocol(preset)
    line = (
        f"Preset `{preset['name']}`: {preset['num_layers']} layers x {preset['model_dim']}, "
        f"{preset['num_heads']} heads, batch {preset['batch_size']}, AdamW lr {preset['learning_rate']} "
        f"(warmup + cosine over the step budget), seeds {list(preset['seeds'])}. "
    )
    if trained == "fixed-budget":
        line += f"Protocol `fixed-budget`: every encoding of a task trains the same {preset['steps']} steps"
    else:
        line += (
            "Protocol `to-criterion` (the earlier method: **each encoding trained its own number of steps**, so "
            f"comparisons mix the encoding with its budget): every {preset['check_every']} steps each seed was "
            f"scored on {preset['check_examples']} held-out examples at the longest training length, and a seed "
            f"stopped once it met the criterion at two checks in a row, or at its budget of {preset['steps']} steps"
        )
    overrides = [
        f"{task} {dict(o).get('steps')}" for task, o in preset.get("task_overrides") or () if "steps" in dict(o)
    ]
    line += f" ({', '.join(overrides)})." if overrides else "."
    if trained == "fixed-budget":
        line += (
            f" Steps to criterion (every {preset['check_every']} steps, {preset['check_examples']} held-out examples "
            "at the longest training length, two checks in a row) are recorded, not used to stop."
        )
    if algorithmic:
        line += (
            f" Algorithmic tasks train on lengths {preset.get('train_min_length', 1)}-{preset['train_length']} and "
            f"are tested at {list(preset['eval_lengths'])} ({preset['eval_examples']} examples each), in "
            + ("the paper's" if preset.get("task_format") == "paper" else "our own")
            + " task format."
        )
    if text:
        lengths = [preset["text_context"] * m for m in preset["text_multiples"]]
        line += (
            f" Text trains at {preset['text_context']} characters and is tested at {lengths}, every length on the "
            f"same {preset['text_eval_characters']:,} test characters in non-overlapping windows."
        )
    declared = "equivalence_margin" in preset
    gate = (
        f"**Learned first, every seed counted.** A cell is learned when the mean over all its seeds at the longest "
        f"training length is at least {preset['learned_threshold']} (text: below the best n-gram model by "
        f"{preset.get('text_margin', 0.2):g} bits per character on the same characters); only then are its scores "
        "beyond the training length reported, as the mean over all its seeds with a 95% interval (inside [0, 1] for "
        "exact match and accuracy), and the best seed beside it. `k/n` counts the seeds that passed on their own; "
        "no seed is dropped. Orderings are paired over seeds and Holm-corrected over each task's table; a tie is "
        f"claimed only by an equivalence test (TOST at 0.05) within {preset.get('equivalence_margin', 0.02):g} "
        f"accuracy or {preset.get('text_equivalence_margin', 0.05):g} bits per character"
        + (", margins declared in the preset before the run." if declared else ", margins declared after the run.")
    )
    lines = [line, "", gate, ""]
    paper = preset.get("paper_protocol")
    if paper is None:  # a run made before presets stated it: the preset of that name's
        from posenc_jax.bench.presets import PRESETS

        known = PRESETS.get(preset.get("name"))
        paper = known.paper_protocol if known is not None else ""
    if paper:
        lines += [f"**The paper's protocol, beside ours:** {paper}.", ""]
    return lines


def _steps(steps: dict) -> str:
    """The seeds' training steps: one number when they agree, else the median and range."""
    known = sorted(s for s in steps.values() if s is not None)
    if not known:
        return "-"
    if known[0] == known[-1]:
        return str(known[0])
    return f"{int(np.median(known))} ({known[0]}-{known[-1]})"


def _criterion(cell) -> str:
    """The seeds' steps to criterion: the median of those that got there, and how many did."""
    if not cell.criterion_steps:
        return "-"
    reached = sorted(s for s in cell.criterion_steps.values() if s is not None)
    if not reached:
        return f"never (0/{len(cell.criterion_steps)})"
    return f"{int(np.median(reached))} ({len(reached)}/{len(cell.criterion_steps)})"


def _published_cell(task: str, encoding: str) -> str:
    published = PUBLISHED.get(task, {})
    return f"{published[encoding]:.3f}" if encoding in published else "-"


def _baseline_rows(task: str, results: Results, train_length: int) -> list[str]:
    """Table rows of the algorithmic baselines: at the training length and mean beyond it."""
    known = results.baselines.get(task, {}).get("lengths")
    if not known:
        return []
    lengths = sorted(int(n) for n in known)
    rows = []
    for name in ("chance", "position-only", "content-only"):
        inside = known.get(str(train_length), {}).get(name)
        outside = [known[str(n)][name] for n in lengths if n > train_length and known[str(n)][name] is not None]
        if inside is None:
            continue
        beyond = f"{np.mean(outside):.3f}" if outside else "-"
        rows.append(f"| *{name} (baseline)* | - | {inside:.3f} | {beyond} | - | - | - |")
    return rows


def _text_sections(task: str, results: Results, summaries) -> list[str]:
    ngram = results.baselines.get(task, {}).get("ngram")
    lines = []
    if ngram:
        best = min(ngram, key=lambda b: b["bits_per_char"])
        lines += [
            "Count-based n-gram models (fitted on the train split, scored on the same test characters with their full "
            "history):",
            "",
            "| model | bits/char |",
            "|---|---|",
            *(f"| {b['order']}-gram, {b['smoothing'].replace('_', '-')} | {b['bits_per_char']:.3f} |" for b in ngram),
            "",
        ]
        learned = [c for c in summaries if c.learned]
        best_model = min((c.at_training.mean for c in learned), default=None)
        margin = float(results.setting(task, "text_margin", 0.2))
        if best_model is None:
            lines += [
                f"**The text models are too small to read these curves:** the best n-gram model scores "
                f"{best['bits_per_char']:.3f} bits per character, and no learned Transformer beats it by {margin:g} "
                f"(best: {'none learned' if best_model is None else f'{best_model:.3f}'}).",
                "",
            ]
    buckets = {}
    for row in results.rows:
        if row["task"] == task and "buckets" in row:
            buckets.setdefault(row["encoding"], {}).setdefault(row["length"], []).append(row)
    if buckets:
        longest = max(n for per in buckets.values() for n in per)
        names = list(next(r for per in buckets.values() for r in per.get(longest, []))["buckets"])
        lines += [
            f"Bits per character by position within the {longest}-character windows (mean over all seeds; "
            "positions below the training length, then doublings of it):",
            "",
            "| encoding | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for c in summaries:
            rows = buckets.get(c.encoding, {}).get(longest, [])
            if not c.learned or not rows:
                lines.append(f"| {c.encoding} | " + " | ".join(["not learned"] * len(names)) + " |")
                continue
            means = [np.mean([r["buckets"][b] for r in rows]) for b in names]
            lines.append(f"| {c.encoding} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
        lines.append("")
    return lines


def _ordering_lines(task: str, results: Results) -> list[str]:
    family = comparison(results, task)
    pairs = family.orderings
    if not pairs:
        return []
    resolved = family.resolved
    margin, declared = results.margin(task)
    budgets = (
        " Budgets differ between encodings (to-criterion), so an ordering mixes the encoding with its steps."
        if results.protocol == "to-criterion"
        else ""
    )
    lines = [
        f"Orderings beyond the training length (paired over all seeds; p-values Holm-corrected over this task's "
        f"{len(pairs)} pairs at 0.05): {len(resolved)} of {len(pairs)} pairs resolved.{budgets}"
    ]
    if resolved:
        lines += [
            "",
            "| better | worse | difference [95% interval] | corrected p | seeds |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {p.better} | {p.worse} | {p.difference} | {p.corrected_p:.3g} | {p.difference.n} |" for p in resolved
        ]
    unresolved = family.unresolved
    if unresolved:
        lines += ["", "Unresolved (not told apart, which is not a tie): "]
        lines[-1] += "; ".join(f"{p.better} vs {p.worse}" for p in unresolved) + "."
    tied = family.equivalent()
    when = "declared before the run" if declared else "declared after the run"
    lines += [
        "",
        f"Equivalent within ±{margin:g} (TOST, Holm-corrected over the pairs; margin {when}): "
        + ("; ".join(f"{a} and {b}" for a, b in tied) if tied else "none")
        + ".",
    ]
    return [*lines, ""]


def _devices(cells) -> str | None:
    """Which cells ran on which device, from a merged record's cells (``"NVIDIA H200 x 1, jax
    0.11.2: copy (nope, t5), reverse (nope); cpu x 1, ...: ..."``), or None where every cell ran
    on the same device (or none says)."""
    by_device: dict[str, dict[str, list[str]]] = {}
    for cell in cells:
        by_device.setdefault(cell.get("device", ""), {}).setdefault(cell["task"], []).append(cell["encoding"])
    if len(by_device) < 2:
        return None
    return "; ".join(
        f"{device}: " + ", ".join(f"{task} ({', '.join(encodings)})" for task, encodings in tasks.items())
        for device, tasks in by_device.items()
    )


def _missing_cells(record: dict, rows: list[dict]) -> list[str]:
    """A line naming the cells the run asked for (``run.json``'s ``asked``) that have no rows yet:
    a run still going, or stopped, is read as partial, never as complete."""
    asked = record.get("asked")
    if not isinstance(asked, dict):
        return []
    have = {(row["task"], row["encoding"]) for row in rows}
    missing = [f"{task} {label}" for task, labels in asked.items() for label in labels if (task, label) not in have]
    if not missing:
        return []
    total = sum(len(labels) for labels in asked.values())
    named = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
    have_rows = total - len(missing)
    return [f"**Partial.** {have_rows} of the {total} cells the run asked for have rows; none yet: {named}.", ""]


def write_report(results: Results | str | pathlib.Path, out: pathlib.Path | None = None, *, plots: bool = True) -> str:
    """Writes ``report.md`` into ``out`` (default: the results folder) and returns its text."""
    if not isinstance(results, Results):
        out = pathlib.Path(results) if out is None else out
        results = read(results)
    out = pathlib.Path(out)
    preset, record = results.preset, results.record
    if preset and "check_every" not in preset:
        raise ValueError(
            f"{out}: this run's preset {preset.get('name')!r} records no check_every: it predates the gate and the "
            "protocols the report reads (every cell learned-first, steps to criterion), so its report.md stays as "
            "written then; rerun the preset with the current benchmark for a report of today's reading"
        )
    pipeline_check = preset.get("name") == "smoke"
    lines = _front_matter(preset, record, pipeline_check)
    summaries = cells(results)
    tasks = list(dict.fromkeys(c.task for c in summaries))
    lines += _missing_cells(record, results.rows)
    if len(tasks) > 1 and not pipeline_check:
        lines += [
            "## Overview",
            "",
            "Beyond the training length: the mean over all seeds [95% interval]; exact match or accuracy, "
            "higher is better; text in bits per character, lower is better. `not learned (k/n)`: the mean over all "
            "seeds did not pass the gate at the training length (k of n seeds passed on their own).",
            "",
            summarize(results),
            "",
        ]
    for task in tasks:
        lines += _task_section(task, [c for c in summaries if c.task == task], results, pipeline_check, plots)
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def _front_matter(preset: dict, record: dict, pipeline_check: bool) -> list[str]:
    """The report's title and what every table shares: the smoke preset's warning, the protocol, the corpus,
    the devices and commits that made the rows, and what a partial merge leaves out."""
    lines = ["# Length extrapolation", ""]
    if pipeline_check:
        lines += [
            "**A pipeline check, not a result.** The smoke preset trains tiny models for a few steps to "
            "exercise every step of the benchmark in seconds; its numbers say nothing about the encodings. "
            "Run `--preset cpu` (or `cpu-full`) for results.",
            "",
        ]
    if preset:
        lines += _protocol(preset)
    if record.get("text_corpus"):
        lines += [f"Text corpus: {record['text_corpus']}.", ""]
    if record.get("versions"):
        commits = record.get("commits") or []
        made = ", ".join(f"{c['commit'] and c['commit'][:10]}{' (dirty)' if c['dirty'] else ''}" for c in commits)
        package = f"posenc_jax {record['versions'].get('posenc_jax')}"
        made_by = f"rows made by commit{'s' if len(commits) > 1 else ''} {made or 'unknown'}"
        ran = _devices(record.get("cells") or [])
        if ran:  # a merge of folders run on different devices
            line = f"Devices (the cells' training and evaluation ran on one each): {ran}. {package}; {made_by}."
        else:
            device, jax_version = record["device"], record["versions"]["jax"]
            line = f"Device: {device['kind']} x {device['count']}; {package}, jax {jax_version}; {made_by}."
        lines += [line, ""]
    if record.get("unfinished"):
        lines += [
            f"**Partial.** Merged without {len(record['unfinished'])} folder(s) that had finished no cell: "
            f"{', '.join(record['unfinished'])}. Their cells are missing from every table.",
            "",
        ]
    return lines


def _task_section(task: str, here: list, results: Results, pipeline_check: bool, plots: bool) -> list[str]:
    """One task's section: its gate, its table (with the published column where there is one), the
    baselines, the notes its rows need, its text sections, its ordering and its plot."""
    preset = results.preset
    lines = []
    first = here[0]
    threshold, higher = results.threshold(task)
    direction = "higher" if higher else "lower"
    gate = (
        f"all-seed mean at least {threshold}"
        if higher
        else f"all-seed mean below {threshold:.3f} bits per character (best n-gram less the margin)"
    )
    lines += [
        f"## {title(task)}",
        "",
        f"Task `{task}`; {first.metric.replace('_', ' ')}, {direction} is better. Learned: {gate} at length "
        f"{first.train_length}.",
        "",
    ]
    published = not pipeline_check and task in PUBLISHED
    best = "min" if not higher else "max"
    header = (
        f"| encoding | seeds learned | at training length ({first.train_length}) | beyond training "
        f"(> {first.train_length}) | best seed ({best}) | steps | steps to criterion |"
    )
    sep = "|---|---|---|---|---|---|---|"
    if published:
        header += " published, test 21-40 (other protocol) |"
        sep += "---|"
    lines += [header, sep]
    for c in here:
        row = (
            f"| {c.encoding} | {len(c.learned_seeds)}/{c.seeds} | {c.text('at_training')} | "
            f"{c.text('extrapolation')} | {'-' if c.best is None else f'{c.best:.3f}'} | {_steps(c.steps)} | "
            f"{_criterion(c)} |"
        )
        if published:
            row += f" {_published_cell(task, c.encoding)} |"
        lines.append(row)
    lines += [*(r + (" |" if published else "") for r in _baseline_rows(task, results, first.train_length)), ""]
    if any(c.encoding.endswith("@eval") for c in here):
        lines.append(
            "Rows `rope+<scaling>@eval` are the trained RoPE model evaluated with that RoPE scaling, "
            "sized at each length (factor = test tokens / training tokens): evaluation only, no training."
        )
    if any(c.encoding.endswith("@ft") for c in here):
        multiple, steps = preset.get("finetune_multiple"), preset.get("finetune_steps")
        lines.append(
            f"Rows `rope+<scaling>@ft` are the trained RoPE model given that scaling for {multiple}x the training "
            f"context and fine-tuned {steps} steps there (as Chen et al. 2023 and Peng et al. 2023 do), "
            "then evaluated with that one scaling at every length; `rope@ft` is plain RoPE fine-tuned the same way."
        )
    if published:
        lines.append(
            f"Published column: {PUBLISHED_PROTOCOL}; same task, not the same protocol, so compare the "
            "ordering, not the numbers."
        )
    note = "" if pipeline_check else format_note(task, preset.get("task_format", "ours"))
    if note:
        lines.append(note)
    if task == "text":
        lines += ["", *_text_sections(task, results, here)]
        if not pipeline_check:
            lines.append(f"Reference shape: {TEXT_REFERENCE}")
    lines += ["", *_ordering_lines(task, results)]
    if plots:
        lines.append(f"![{task}]({task}.png)")
    lines.append("")
    return lines
