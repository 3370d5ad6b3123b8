"""The published claims we re-test, each as a declared family of paired tests, and their verdicts.

    python benchmarks/claims.py            # writes docs/site/claims.md from the committed rows
    python benchmarks/claims.py --out F    # writes it to F

Each claim of the reproductions page is a :class:`Claim`: the tests its verdict rests on,
declared here (not picked from the results), each one of

* ``above``: encoding a scores better than b beyond the training length (paired over seeds);
* ``no-worse``: a scores no worse than b by more than the task's equivalence margin (a
  non-inferiority test: "at least as well as", "stays flat" against its own score at the
  training length);
* ``tie``: a and b are equivalent within the margin (two one-sided tests).

A test compares two cells of one run only (the seeds see the same data there), and only cells
that learned their task (a RoPE scaling applied to the trained RoPE model counts as learned
when that model did). Every test is two one-sided t-tests over the paired differences: one for
the claim, one for its contrary (a reversed order, or a difference past the margin). All the
one-sided tests of a claim form one family, corrected by Holm's method at 0.05: a test *holds*
when its claim's corrected p-value is at most 0.05, is *contradicted* when its contrary's is,
and is *unresolved* otherwise (never read as agreement). The claim agrees when every test holds,
disagrees when every comparable test is contradicted, and is otherwise reported test by test.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pathlib

import numpy as np

from posenc_jax.bench import stats
from posenc_jax.bench.results import Results, cells, read

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"  # where the run folders are (tests point it elsewhere)
ALPHA = 0.05
KINDS = ("above", "no-worse", "tie")


@dataclasses.dataclass(frozen=True)
class Value:
    """One cell's per-seed score in one run: beyond the training length (the mean over the
    lengths past it), at the training length (``"train"``), or at one length. ``task`` may be a
    tuple of tasks: then each seed's mean over them (a ranking across tasks, as a paper that
    ranks encodings over several tasks makes it), every one of its cells learned."""

    folder: str
    task: str | tuple[str, ...]
    encoding: str
    at: str | int = "beyond"

    @property
    def tasks(self) -> tuple[str, ...]:
        return self.task if isinstance(self.task, tuple) else (self.task,)

    def words(self) -> str:
        if self.at == "beyond":
            return self.encoding
        if self.at == "train":
            return f"{self.encoding} at the training length"
        return f"{self.encoding} at {self.at:,}"


@dataclasses.dataclass(frozen=True)
class Test:
    kind: str
    a: Value
    b: Value

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a test's kind must be one of {KINDS}, got {self.kind!r}")
        if self.a.folder != self.b.folder or self.a.task != self.b.task:
            raise ValueError(
                f"{self.a} and {self.b} are not of one run and task: only cells of one run are paired over seeds"
            )

    def words(self) -> str:
        relation = {"above": ">", "no-worse": "no worse than", "tie": "≈"}[self.kind]
        return f"{self.a.words()} {relation} {self.b.words()}"


@dataclasses.dataclass(frozen=True)
class Claim:
    """A published claim and the tests its verdict rests on; ``not_comparable`` says why a claim
    has no test (a protocol this benchmark does not run)."""

    source: str
    claim: str
    tests: tuple[Test, ...] = ()
    not_comparable: str = ""
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Outcome:
    test: Test
    comparable: bool
    why: str = ""  # why not comparable
    difference: stats.Interval | None = None  # a − b in goodness (positive: a better)
    best: tuple[float, float] | None = None  # the best seed of a and of b
    p_claim: float = math.nan
    p_contrary: float = math.nan
    corrected_claim: float = math.nan
    corrected_contrary: float = math.nan
    margin: float = math.nan
    seeds: int = 0
    protocol: str = ""

    @property
    def result(self) -> str:
        if not self.comparable:
            return f"not comparable ({self.why})"
        if self.corrected_claim <= ALPHA:
            return "holds"
        if self.corrected_contrary <= ALPHA:
            return "contradicted"
        return "unresolved"


@functools.cache
def _read(folder: str) -> Results:
    return read(DOCS / folder)


@functools.cache
def _summaries(folder: str) -> dict:
    return {(c.task, c.encoding): c for c in cells(_read(folder))}


def _trained(encoding: str) -> str:
    """The trained cell behind a row label: ``rope+pi@eval`` and ``rope@ft`` are the RoPE model."""
    if "@" in encoding:
        return encoding.split("@")[0].split("+")[0]
    return encoding


def _task_words(task) -> str:
    if isinstance(task, tuple):
        return f"the mean over {len(task)} tasks ({', '.join(t.replace('_', ' ') for t in task)})"
    return task


def _one_task(value: Value, task: str) -> dict[int, float]:
    summary = _summaries(value.folder)[(task, value.encoding)]
    if value.at == "beyond":
        return dict(summary.beyond)
    if value.at == "train":
        return dict(summary.in_distribution)
    return {
        r["seed"]: r["value"]
        for r in _read(value.folder).rows
        if r["task"] == task and r["encoding"] == value.encoding and r["length"] == value.at
    }


def _per_seed(value: Value) -> dict[int, float]:
    """Each seed's score; over several tasks, its mean over them (the seeds every task has)."""
    per_task = [_one_task(value, task) for task in value.tasks]
    seeds = set.intersection(*(set(found) for found in per_task))
    return {seed: float(np.mean([found[seed] for found in per_task])) for seed in sorted(seeds)}


def _learned(value: Value) -> bool:
    found = _summaries(value.folder)
    cells = [found.get((task, _trained(value.encoding))) for task in value.tasks]
    return all(cell is not None and cell.learned for cell in cells)


def _measure(test: Test) -> Outcome:
    results = _read(test.a.folder)
    for value in (test.a, test.b):
        for task in value.tasks:
            if (task, value.encoding) not in _summaries(value.folder):
                raise ValueError(f"{DOCS / value.folder} has no cell {value.encoding} on {task}")
        if not _learned(value):
            return Outcome(test, False, f"{_trained(value.encoding)} not learned")
    summary = _summaries(test.a.folder)[(test.a.tasks[0], _trained(test.a.encoding))]
    sign = 1.0 if summary.higher_is_better else -1.0
    a, b = _per_seed(test.a), _per_seed(test.b)
    common = sorted(set(a) & set(b))
    d = [sign * (a[s] - b[s]) for s in common]
    margin, _ = results.margin(test.a.tasks[0])
    if test.kind == "above":
        p_claim, p_contrary = stats.one_sided(d, 0.0, +1), stats.one_sided(d, 0.0, -1)
    elif test.kind == "no-worse":
        p_claim, p_contrary = stats.one_sided(d, -margin, +1), stats.one_sided(d, -margin, -1)
    else:
        p_claim = stats.tost(d, margin)
        p_contrary = min(1.0, 2 * min(stats.one_sided(d, margin, +1), stats.one_sided(d, -margin, -1)))
    pick = max if summary.higher_is_better else min
    return Outcome(
        test,
        True,
        difference=stats.t_interval(d),
        best=(pick(a.values()), pick(b.values())),
        p_claim=p_claim,
        p_contrary=p_contrary,
        margin=margin,
        seeds=len(common),
        protocol=results.protocol,
    )


def evaluate(claim: Claim) -> list[Outcome]:
    """Every test of ``claim`` measured, its claim's and its contrary's p-values corrected together
    (Holm over the 2k one-sided tests of the k comparable tests)."""
    outcomes = [_measure(test) for test in claim.tests]
    comparable = [i for i, o in enumerate(outcomes) if o.comparable]
    if comparable:
        raw = [outcomes[i].p_claim for i in comparable] + [outcomes[i].p_contrary for i in comparable]
        adjusted = stats.holm(raw, ALPHA)
        k = len(comparable)
        for j, i in enumerate(comparable):
            outcomes[i] = dataclasses.replace(
                outcomes[i], corrected_claim=adjusted[j], corrected_contrary=adjusted[k + j]
            )
    return outcomes


def verdict(claim: Claim, outcomes: list[Outcome]) -> str:
    """The claim's verdict, from its corrected tests alone."""
    if claim.not_comparable:
        return f"not comparable: {claim.not_comparable}"
    comparable = [o for o in outcomes if o.comparable]
    if not comparable:
        return "not comparable: no test's cells learned their task"
    results = {o.result for o in comparable}
    if results == {"holds"}:
        word = "agrees"
    elif results == {"contradicted"}:
        word = "disagrees"
    elif results == {"unresolved"}:
        word = "unresolved"
    else:
        counts = {r: sum(o.result == r for o in comparable) for r in ("holds", "contradicted", "unresolved")}
        word = "partly: " + ", ".join(f"{n} {r}" for r, n in counts.items() if n)
        against = [o.test for o in comparable if o.result == "contradicted"]
        if against:
            word += "; contradicted: " + ", ".join(
                f"{t.words()} ({_task_words(t.a.task).replace('_', ' ')})" for t in against
            )
    left = len(outcomes) - len(comparable)
    return word + (f" ({left} of {len(outcomes)} tests not comparable)" if left else "")


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def render(claims: list[Claim]) -> str:
    """The claims page (markdown): per claim, its tests, their corrected results and the verdict."""
    lines = [
        "# Claims, tested",
        "",
        "<!-- Written by `python benchmarks/claims.py` from the committed rows; do not edit by hand. -->",
        "",
        "Each published claim below is a family of paired tests declared in `benchmarks/claims.py`: the "
        "comparisons the claim's own words name, on the reproduction runs of the claim's task, whatever their result. "
        "A test compares two cells of one run over their common seeds (all "
        "of them: none is dropped) and only cells that learned their task; `difference` is the first "
        "minus the second in the direction of better (bits per character: lower is better), with its 95% "
        "Student-t interval over seeds. `above` asks for a resolved difference; `no worse than` is a "
        "non-inferiority test within the task's equivalence margin (0.02 accuracy, 0.05 bits per "
        "character, declared after the runs here); `≈` is an equivalence test (two one-sided tests) within "
        "that margin. Each test's claim and its contrary are one-sided t-tests; all of a claim's are "
        "corrected together by Holm's method at 0.05: a test **holds** or is **contradicted** only on "
        "its corrected p-value, and is otherwise **unresolved** (not a tie). `best seed` is the best "
        "seed's score of each (the statistic Ruoss et al. are said to report). Every committed run trained to "
        "criterion (each encoding its own number of steps: the `steps` columns of the runs' reports), "
        "so each comparison below mixes the encoding with its budget, until fixed-budget reruns replace them.",
        "",
    ]
    for claim in claims:
        outcomes = evaluate(claim)
        lines += [f"## {claim.source}", "", f"*Claim:* {claim.claim}", ""]
        if claim.tests:
            lines += [
                "| test | run, task | seeds | difference [95%] | best seed | p (claim), corrected | p (contrary), "
                "corrected | result |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for o in outcomes:
                where = f"`{o.test.a.folder}`, {_task_words(o.test.a.task)}"
                if not o.comparable:
                    lines.append(f"| {o.test.words()} | {where} | - | - | - | - | - | {o.result} |")
                    continue
                best = f"{o.best[0]:.3f} / {o.best[1]:.3f}"
                lines.append(
                    f"| {o.test.words()} | {where} | {o.seeds} | {o.difference} | {best} | "
                    f"{_p(o.corrected_claim)} | {_p(o.corrected_contrary)} | {o.result} |"
                )
            lines.append("")
        if claim.note:
            lines += [claim.note, ""]
        lines += [f"**Verdict:** {verdict(claim, outcomes)}.", ""]
    return "\n".join(lines)


def _tests(kind: str, folder: str, tasks, pairs, at="beyond") -> tuple[Test, ...]:
    return tuple(Test(kind, Value(folder, task, a, at), Value(folder, task, b, at)) for task in tasks for a, b in pairs)


_DECODER = ("counting_copy", "counting_replace", "copy", "duplicate", "reverse")
_ENCODER = ("bucket_sort", "missing_duplicate", "reverse_string")
_RANDOMIZED = (("rope+randomized", "rope"), ("sinusoidal+randomized", "sinusoidal"))
KAZ, TEXT, MORE, LONG = (
    "extrapolation-kazemnejad",
    "extrapolation-gpu-text",
    "extrapolation-gpu-text-more",
    ("extrapolation-gpu-long-partial"),
)

CLAIMS = [
    Claim(
        "Kazemnejad et al. 2023 (decoder tasks)",
        "across the decoder tasks, NoPE ≥ T5 > ALiBi > RoPE ≈ APE (sinusoidal) beyond the training length.",
        (
            Test("no-worse", Value(KAZ, _DECODER, "nope"), Value(KAZ, _DECODER, "t5")),
            Test("above", Value(KAZ, _DECODER, "t5"), Value(KAZ, _DECODER, "alibi")),
            Test("above", Value(KAZ, _DECODER, "alibi"), Value(KAZ, _DECODER, "rope")),
            Test("tie", Value(KAZ, _DECODER, "rope"), Value(KAZ, _DECODER, "sinusoidal")),
        ),
        note="Their ranking is over the tasks together, and so are these tests: each seed's mean over the five "
        "tasks. Task by task their own rows break it (NoPE below T5 on copy and duplicate, T5 below ALiBi on "
        "duplicate), so a per-task reading would be stricter than the paper. Theirs: 12 x 768 trained 40,000 steps "
        "on lengths up to 20, tested on 21-40, 3 seeds; ours: 2-4 x 64 trained to criterion on lengths up to 10, "
        "tested on 12-20, 5 seeds.",
    ),
    Claim(
        "Press et al. 2022 (text, to 32x)",
        "past the training length sinusoidal explodes, rotary degrades, T5 holds a while, ALiBi stays flat: "
        "ALiBi > T5 > RoPE > sinusoidal, and ALiBi no worse beyond than at its training length.",
        (
            *_tests("above", TEXT, ("text",), (("alibi", "t5"), ("t5", "rope"), ("rope", "sinusoidal"))),
            Test("no-worse", Value(TEXT, "text", "alibi"), Value(TEXT, "text", "alibi", "train")),
        ),
        note="Theirs: WikiText-103, 16 x 1024 trained at 512; ours: Python source, 4 x 256 trained at 128 "
        "characters, tested to 4,096.",
    ),
    Claim(
        "Press et al. 2022 (text, to 128x)",
        "ALiBi stays flat far past the training length; sinusoidal explodes.",
        (
            Test("no-worse", Value(LONG, "text", "alibi", 32768), Value(LONG, "text", "alibi", "train")),
            Test("above", Value(LONG, "text", "sinusoidal", "train"), Value(LONG, "text", "sinusoidal", 512)),
        ),
        note="`gpu-long`: trained at 256 characters, 3 seeds; 5 of its 11 encodings finished.",
    ),
    Claim(
        "Chi et al. 2022 (Kerple), 2023 (Sandwich) (text, to 32x)",
        "Kerple and Sandwich extrapolate at least as well as ALiBi.",
        (
            Test("no-worse", Value(TEXT, "text", "kerple-log"), Value(TEXT, "text", "alibi")),
            Test("no-worse", Value(TEXT, "text", "sandwich"), Value(TEXT, "text", "alibi")),
            Test("no-worse", Value(MORE, "text", "kerple-power"), Value(MORE, "text", "alibi")),
        ),
    ),
    Claim(
        "Chi et al. 2022, 2023 (text, to 128x)",
        "Kerple and Sandwich extrapolate at least as well as ALiBi, at 32,768 characters (128x).",
        (
            Test("no-worse", Value(LONG, "text", "kerple-power", 32768), Value(LONG, "text", "alibi", 32768)),
            Test("no-worse", Value(LONG, "text", "sandwich", 32768), Value(LONG, "text", "alibi", 32768)),
        ),
    ),
    Claim(
        "Li et al. 2023 (FIRE) (text)",
        "FIRE extrapolates better than the other relative encodings it is compared with (T5, the learned clipped "
        "bias, Kerple, ALiBi) and than RoPE.",
        (
            *_tests(
                "above",
                TEXT,
                ("text",),
                (("fire", "t5"), ("fire", "kerple-log"), ("fire", "alibi"), ("fire", "rope")),
            ),
            *_tests("above", MORE, ("text",), (("fire", "clipped-bias"), ("fire", "kerple-power"))),
        ),
        note="Beyond is the mean over 256-4,096 characters. By length, FIRE trails Kerple by about 0.03 bits at "
        "2x-4x and by 0.1-0.5 from 8x on (its loss rises from 1,024 characters): the contradictions rest mostly on "
        "the longer lengths.",
    ),
    Claim(
        "Chen et al. 2023 (PI), Peng et al. 2023 (YaRN) (text, fine-tuned)",
        "after a short fine-tune at the longer length, PI is far better there than plain RoPE fine-tuned the "
        "same way, and YaRN better than PI.",
        (
            Test("above", Value(TEXT, "text", "rope+pi@ft", 512), Value(TEXT, "text", "rope@ft", 512)),
            Test("above", Value(TEXT, "text", "rope+yarn@ft", 512), Value(TEXT, "text", "rope+pi@ft", 512)),
            Test("above", Value(TEXT, "text", "rope+yarn@ft", 512), Value(TEXT, "text", "rope@ft", 512)),
        ),
        note="Fine-tuned 100 steps at 512 characters (4x the training context), compared at 512, where they were "
        "fine-tuned. A fine-tuned variant counts as learned when the RoPE model it was fine-tuned from did; PI's "
        "own score back at 128 characters (1.796) is above the gate there.",
    ),
    Claim(
        "Peng et al. 2023 (text, at evaluation only)",
        "applied at evaluation only, NTK-aware scaling beats PI and YaRN beats NTK.",
        (
            Test("above", Value(TEXT, "text", "rope+ntk@eval", 512), Value(TEXT, "text", "rope+pi@eval", 512)),
            Test("above", Value(TEXT, "text", "rope+yarn@eval", 512), Value(TEXT, "text", "rope+ntk@eval", 512)),
        ),
        note="The trained RoPE model with each scaling sized for 512 characters, compared at 512.",
    ),
    Claim(
        "Ruoss et al. 2023 (encoder tasks)",
        "randomized positions extrapolate better than the same encoding without them.",
        (
            *_tests("above", "extrapolation-cpu-full", _ENCODER, _RANDOMIZED),
            *_tests("above", "extrapolation-cpu-full-parity", ("parity",), _RANDOMIZED),
            *_tests("above", "extrapolation-ruoss", (*_ENCODER, "parity"), _RANDOMIZED),
        ),
        note="`cpu-full` tests to 2x, `ruoss` to 10x the training length. The `ruoss-long` run (randomized "
        "cells at 16,000 steps) has no partner without randomization in its run, so no test rests on it. "
        "Ruoss et al. are said to report the best score over seeds and learning rates (not yet confirmed against "
        "their protocol section): the `best seed` column.",
    ),
    Claim(
        "Golovneva et al. 2024 (CoPE), flip-flop",
        "CoPE solves flip-flop where RoPE and NoPE fail.",
        not_comparable="the paper varies the density of ignore instructions at a fixed length; this benchmark "
        "varies the length (`docs/extrapolation-cope-tasks/` has the runs)",
    ),
    Claim(
        "Golovneva et al. 2024 (CoPE), counting",
        "CoPE counts better than RoPE and NoPE beyond the training length (the paper: where they fail).",
        _tests("above", "extrapolation-cope-tasks", ("cope_count",), (("cope", "rope"), ("cope", "nope"))),
        note="Here RoPE and NoPE learned the task in distribution (0.970 and 0.975 at 16 statements), so the "
        "paper's \"where they fail\" is not what is tested: only CoPE's lead beyond the training length.",
    ),
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Writes the claims page (every claim's tests and verdict) from the rows."
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=ROOT / "docs" / "site" / "claims.md", help="the page to write"
    )
    args = parser.parse_args(argv)
    args.out.write_text(render(CLAIMS))
    print(args.out)


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
