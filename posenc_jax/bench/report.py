"""The report and plots of a results folder: ours, with baselines and published figures beside them.

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

import functools
import pathlib

import numpy as np

import posenc_jax.bench.published as published
from posenc_jax.bench.results import BOUNDED, Results, cells, comparison, protocol, read, summarize
from posenc_jax.bench.stats import interval
from posenc_jax.bench.tasks import format_note, make_task
from posenc_jax.functional.core.registry import encoding_info

__all__ = ["FAMILIES", "PUBLISHED", "TITLES", "family", "figure", "plot", "write_report"]

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
# Titles a reader can parse: the task, then the model and the metric.
TITLES = {
    "counting_copy": "Counting copy: one symbol repeated n times, copy it (decoder)",
    "counting_replace": "Counting replace: s t then s n times, write t n times (decoder)",
    "copy": "Copy a random string (decoder)",
    "duplicate": "Duplicate a random string, y = x x (decoder)",
    "reverse": "Reverse a random string (decoder)",
    "reverse_string": "Reverse string (encoder)",
    "missing_duplicate": "Missing duplicate: which bit of w w is hidden (encoder)",
    "parity": "Parity of a bit string (encoder)",
    "bucket_sort": "Bucket sort (encoder)",
    "probe": "Probe: index of each of n identical tokens (encoder)",
    "probe_boundary": "Probe with [CLS] ... [SEP] boundary tokens (encoder)",
    "text": "Character-level language modelling (decoder)",
    "flip_flop": "Flip-flop: read back the last written bit (decoder)",
    "cope_count": "Counting: the printed variable's value after set and increment statements (decoder)",
}
# What a task's length counts, where it is not symbols of x (or characters, for text).
_UNITS = {"flip_flop": "instruction-bit pairs", "cope_count": "statements"}
# Families for the plots' small multiples, in panel order.
FAMILIES = ("absolute and none", "RoPE and its scalings", "additive biases", "relative, content-dependent")
# One colour family per encoding family (a sequential palette: each encoding of a family its own
# shade), and within a panel each line its own style and marker. Dotted is kept for the unlearned
# cells and the baselines.
_PALETTES = ("Blues", "Oranges", "Greens", "Purples")
_LINESTYLES = ("-", "--", "-.", (0, (6, 1.5)), (0, (3, 1, 1, 1, 1, 1)), (0, (8, 2, 2, 2)))
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
# Tasks with at most this many encodings are drawn in one panel, so that they are compared.
_ONE_PANEL = 6
# On text, a learned line that rises above this multiple of its bits per character at the
# training length has exploded; the zoomed row's y-range is fitted to the lines that did not.
_EXPLODED = 1.5


def family(label: str) -> str:
    """The family of a row label (``enc``, ``enc|normaliser``, ``a+b``, ``rope+pi@eval``,
    ``rope@ft``): by where its first part acts, from the registry."""
    base = label.split("|")[0].split("@")[0].split("+")[0]  # rope+pi@eval, rope@ft -> rope
    try:
        info = encoding_info(base)
    except ValueError:
        return FAMILIES[-1]
    if info.acts_on == "embeddings" or not info.hooks:
        return FAMILIES[0]
    if "rotate" in info.hooks:
        return FAMILIES[1]
    if info.acts_on == "shared_bias":
        return FAMILIES[2]
    return FAMILIES[3]


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
    pipeline_check = preset.get("name") == "smoke"
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
        here = [c for c in summaries if c.task == task]
        first = here[0]
        threshold, higher = results.threshold(task)
        direction = "higher" if higher else "lower"
        gate = (
            f"all-seed mean at least {threshold}"
            if higher
            else f"all-seed mean below {threshold:.3f} bits per character (best n-gram less the margin)"
        )
        lines += [
            f"## {TITLES.get(task, task)}",
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
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


@functools.cache
def _task(name: str, format: str = "ours"):
    try:
        return make_task(name, max_length=1 << 16, format=format)
    except ValueError:  # a task this version does not know: no chance line, default axis
        return None


def _panels(encodings: list[str]) -> list[tuple[str, list[str]]]:
    """``[(title, encodings)]``: one panel per family, or one for all when there are few to compare."""
    by_family = [(f, [e for e in encodings if family(e) == f]) for f in FAMILIES]
    by_family = [(f, members) for f, members in by_family if members]
    if len(encodings) <= _ONE_PANEL:
        return [("every encoding (colour: family)", [e for _, members in by_family for e in members])]
    return by_family


def _styles(panels: list[tuple[str, list[str]]]) -> dict[str, dict]:
    """Each encoding's colour (its family's palette, one shade per encoding of that family in the
    panel), line style and marker (one per encoding of the panel)."""
    import matplotlib

    styles = {}
    for _, members in panels:
        for name in FAMILIES:
            kin = [e for e in members if family(e) == name]
            palette = matplotlib.colormaps[_PALETTES[FAMILIES.index(name)]]
            shades = np.linspace(0.9, 0.4, len(kin)) if len(kin) > 1 else [0.75] * len(kin)
            for encoding, shade in zip(kin, shades, strict=True):
                styles[encoding] = {"color": palette(float(shade))}
        for index, encoding in enumerate(members):
            styles[encoding] |= {
                "linestyle": _LINESTYLES[index % len(_LINESTYLES)],
                "marker": _MARKERS[index % len(_MARKERS)],
            }
    return styles


def _curve(rows: list[dict], encoding: str, lengths: list[int], bounded: bool):
    """Mean over all seeds at each length, and its 95% interval (NaN where one seed)."""
    by_seed: dict[int, dict[int, float]] = {}
    for r in rows:
        if r["encoding"] == encoding:
            by_seed.setdefault(r["seed"], {})[r["length"]] = r["value"]
    mean, low, high = [], [], []
    for n in lengths:
        values = [v[n] for v in by_seed.values() if n in v]
        if len(values) > 1:
            found = interval(values, bounded=bounded)
            mean.append(found.mean), low.append(found.low), high.append(found.high)
        else:
            mean.append(values[0] if values else np.nan), low.append(np.nan), high.append(np.nan)
    return np.array(mean), np.array(low), np.array(high)


def _zoom(curves: dict, summaries: dict, train_length: int, lengths: list[int], ngram: float | None):
    """The y-range fitted to the learned lines that did not explode (each below ``_EXPLODED`` times its
    score at the training length), with the n-gram line; None when that range would hide nothing."""
    at = lengths.index(train_length) if train_length in lengths else 0
    learned = [e for e in curves if summaries[e].learned]
    kept = [e for e in learned if np.nanmax(curves[e][0]) <= _EXPLODED * curves[e][0][at]]
    if not kept or len(kept) == len(learned):
        return None
    values = np.concatenate([np.concatenate(curves[e]) for e in kept] + [[ngram] if ngram else []])
    low, high = np.nanmin(values), np.nanmax(values)
    pad = 0.06 * (high - low)
    return low - pad, high + pad


def figure(task_name: str, results: Results):
    """The matplotlib figure of one task: the metric against evaluation length, in small multiples by
    family (absolute and none, RoPE and its scalings, additive biases, relative), or in one panel
    when a task has few encodings to compare. One colour family per encoding family, a shade, line
    style and marker per encoding; learned cells as the mean over all seeds with a 95% interval
    band, unlearned cells hollow, grey and dotted (labelled "not learned"); baselines and the
    training length as lines. On text, a second row zooms to the learned lines that did not explode
    (the y-range of the differences the claims rest on), marking with ▲ where a line is above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = {c.encoding: c for c in cells(results) if c.task == task_name}
    rows = [r for r in results.rows if r["task"] == task_name]
    task = _task(task_name, (results.preset or {}).get("task_format", "ours"))
    text = task is not None and task.length_family == "text"
    sample = rows[0]
    bounded = sample["metric"] in BOUNDED
    lengths = sorted({r["length"] for r in rows})
    known = results.baselines.get(task_name, {})
    best = min(known["ngram"], key=lambda b: b["bits_per_char"]) if known.get("ngram") else None
    panels = _panels(list(summaries))
    styles = _styles(panels)
    curves = {e: _curve(rows, e, lengths, bounded) for e in summaries}
    zoom = (
        _zoom(curves, summaries, sample["train_length"], lengths, best and best["bits_per_char"])
        if text and not bounded
        else None
    )
    shape = (2 if zoom else 1, len(panels))
    fig, axes = plt.subplots(*shape, figsize=(4.4 * shape[1], 3.4 * shape[0] + 0.6), sharey="row", squeeze=False)
    # Legends go below the bottom row (outside the axes; the PNG's tight bounding box takes them in).
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.7 / fig.get_figheight(), wspace=0.12, hspace=0.32)
    for row, line_axes in enumerate(axes):
        for ax, (panel, members) in zip(line_axes, panels, strict=True):
            for encoding in members:
                mean, low, high = curves[encoding]
                style = styles[encoding]
                if not summaries[encoding].learned:
                    ax.plot(
                        lengths,
                        mean,
                        color="0.6",
                        lw=1,
                        ms=4,
                        markerfacecolor="none",
                        linestyle=":",
                        marker=style["marker"],
                        label=f"{encoding} (not learned)",
                    )
                else:
                    ax.plot(lengths, mean, lw=1.4, ms=4, label=encoding, **style)
                    ax.fill_between(lengths, low, high, color=style["color"], alpha=0.15, lw=0)
                if row == 1:  # the zoomed row: mark the points above its range
                    above = [n for n, v in zip(lengths, mean, strict=True) if v > zoom[1]]
                    ax.plot(
                        above,
                        [zoom[1]] * len(above),
                        linestyle="none",
                        marker="^",
                        ms=6,
                        color=style["color"] if summaries[encoding].learned else "0.6",
                        clip_on=False,
                        label="_above",
                    )
            if "lengths" in known:
                for name, line in (("position-only", (0, (1, 1))), ("content-only", (0, (4, 2))), ("chance", "-")):
                    values = [known["lengths"].get(str(n), {}).get(name) for n in lengths]
                    if all(v is not None for v in values):
                        ax.plot(lengths, values, color="k", lw=0.8, linestyle=line, alpha=0.6, label=f"{name} baseline")
            if best:
                ax.axhline(
                    best["bits_per_char"],
                    color="k",
                    lw=0.8,
                    linestyle=(0, (1, 1)),
                    alpha=0.6,
                    label=f"best n-gram ({best['order']}-gram)",
                )
            ax.axvline(
                sample["train_length"],
                color="0.35",
                linestyle="-.",
                linewidth=0.8,
                alpha=0.7,
                label=f"training length ({sample['train_length']})",
            )
            if text:
                ax.set_xscale("log", base=2)
                ax.set_xticks(lengths, [str(n) for n in lengths], rotation=45)
                ax.minorticks_off()
            if bounded:
                ax.set_ylim(-0.02, 1.02)
            if row == 1:
                ax.set_ylim(*zoom)
                ax.set_title(f"{panel}: zoomed (▲ above the range)", fontsize=9)
            else:
                ax.set_title(panel + (": full range" if zoom else ""), fontsize=9)
            if row == shape[0] - 1:
                ax.set_xlabel(
                    f"evaluation length ({_UNITS.get(task_name, 'characters' if text else 'symbols of x')})", fontsize=8
                )
            ax.grid(alpha=0.25)
        line_axes[0].set_ylabel(sample["metric"].replace("_", " ") + (" (lower is better)" if text else ""))
    # Each column's legend under its bottom axes, below the tick labels and the axis label.
    renderer = fig.canvas.get_renderer()
    bottom = min(ax.xaxis.get_tightbbox(renderer).y0 for ax in axes[-1])
    for ax in axes[-1]:
        shown = [(h, lab) for h, lab in zip(*ax.get_legend_handles_labels(), strict=True) if lab != "_above"]
        below = ax.transAxes.inverted().transform((0, bottom))[1]
        ax.legend(
            *zip(*shown, strict=True),
            fontsize=6.5,
            frameon=False,
            loc="upper center",
            bbox_to_anchor=(0.5, below - 0.02),
            ncol=2,
        )
    fig.suptitle(f"{TITLES.get(task_name, task_name)}: mean over all seeds, band = 95% interval", fontsize=10)
    return fig


def plot(results: Results | str | pathlib.Path, out: pathlib.Path | None = None) -> list[pathlib.Path]:
    """One PNG (150 dpi) and one SVG per task (see :func:`figure`); returns the PNGs' paths."""
    import matplotlib.pyplot as plt

    if not isinstance(results, Results):
        out = pathlib.Path(results) if out is None else out
        results = read(results)
    written = []
    for task_name in dict.fromkeys(r["task"] for r in results.rows):
        fig = figure(task_name, results)
        path = pathlib.Path(out) / f"{task_name}.png"
        fig.savefig(path, dpi=150, bbox_inches="tight")
        fig.savefig(path.with_suffix(".svg"), bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
