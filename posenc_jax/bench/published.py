"""Published numbers we print beside ours, each with its source, read from ``published.json``.

One data file in the package holds every published number the reports, pages and plots show:
the value, the statistic it is, the paper (with its arXiv id), where the number was read (a
repository's file at a commit, or a table or figure of the paper), the filter that picks the
rows, and whether the aggregation is the paper's or ours. A record without a source is refused:
a number without one is not printed.

    >>> from posenc_jax.bench import published
    >>> row = published.record("kazemnejad2023-test-21-40", "copy", "nope")
    >>> row.value, row.source.arxiv, row.aggregation
    (0.305, '2305.19466', 'ours')
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import re

__all__ = ["DATA", "Published", "Source", "by_task", "load", "record", "source_line"]

DATA = pathlib.Path(__file__).with_name("published.json")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_AGGREGATIONS = ("ours", "paper's")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where published numbers were read: a repository's file at a commit, or a table or figure.

    Attributes:
      paper: authors and year, as cited (``"Kazemnejad et al. 2023"``).
      title: the paper's title.
      arxiv: its arXiv id (``"2305.19466"``).
      repository, file, commit: the result file read, as ``owner/name``, a path and 40 hex digits
        (all three, or none).
      table: the paper's table or figure read, where the numbers come from the paper itself.
      protocol: the paper's setting in one line (model, steps, lengths, seeds, metric).
      verified: whether we recomputed or re-read the numbers from the source ourselves.
      note: what a reader must know before comparing.
    """

    paper: str
    title: str
    arxiv: str
    protocol: str
    verified: bool
    repository: str | None = None
    file: str | None = None
    commit: str | None = None
    table: str | None = None
    note: str = ""

    @property
    def where(self) -> str:
        """``owner/name path at commit`` (its first 7 digits), or the table or figure."""
        if self.repository:
            return f"{self.repository} {self.file} at {self.commit[:7]}"
        return f"{self.paper}, {self.table}"


@dataclasses.dataclass(frozen=True)
class Published:
    """One published number.

    Attributes:
      value: the number as printed.
      statistic: what it is, in words (``"per run, the mean of exact match over test lengths 21-40
        ...; then the mean over the 3 seeds"``).
      group: the set of numbers it belongs to (one table of ours, e.g. ``"kazemnejad2023-test-21-40"``).
      task, encoding: our names for the paper's task and encoding.
      lengths: the evaluation lengths it covers, first and last (the same for one length).
      filter: how the source's rows (or the table's entry) are picked.
      aggregation: ``"paper's"`` where the paper reports this number, ``"ours"`` where we
        aggregated the authors' rows.
      source: where it was read.
    """

    value: float
    statistic: str
    group: str
    task: str
    encoding: str
    lengths: tuple[int, int]
    filter: str
    aggregation: str
    source: Source


def _source(name: str, fields: dict) -> Source:
    try:
        source = Source(**fields)
    except TypeError as error:
        raise ValueError(f"published source {name!r}: {error}") from None
    located = (source.repository, source.file, source.commit)
    if not source.arxiv or not source.paper:
        raise ValueError(f"published source {name!r} needs its paper and arXiv id, got {fields}")
    if all(located):
        if not _COMMIT.fullmatch(source.commit):
            raise ValueError(f"published source {name!r}: commit must be 40 hex digits, got {source.commit!r}")
    elif any(located) or not source.table:
        raise ValueError(
            f"published source {name!r} says neither where in a repository (repository, file and commit) nor "
            f"which table or figure: got {fields}"
        )
    return source


def _record(index: int, fields: dict, sources: dict[str, Source]) -> Published:
    name = fields.get("source")
    if name not in sources:
        raise ValueError(
            f"published record {index} ({fields.get('task')}, {fields.get('encoding')}) has no source: "
            f"source={name!r}, known {sorted(sources)}; a number without a source is not printed"
        )
    fields = {**fields, "source": sources[name], "lengths": tuple(fields.get("lengths", ()))}
    try:
        found = Published(**fields)
    except TypeError as error:
        raise ValueError(f"published record {index}: {error}") from None
    if not isinstance(found.value, int | float) or not math.isfinite(found.value):
        raise ValueError(f"published record {index}: value must be a finite number, got {found.value!r}")
    if found.aggregation not in _AGGREGATIONS:
        raise ValueError(
            f"published record {index}: aggregation must be one of {_AGGREGATIONS}, got {found.aggregation!r}"
        )
    if not found.statistic or not found.filter or len(found.lengths) != 2:
        raise ValueError(
            f"published record {index} needs its statistic, filter and lengths (first, last), got {fields}"
        )
    return found


def load(path: str | pathlib.Path | None = None) -> tuple[Published, ...]:
    """Every record of the data file (the package's ``published.json`` by default), checked.

    Raises:
      ValueError: a record names no known source, or a source says neither where in a
        repository nor which table or figure.
    """
    if path is None:
        return _load_default()
    return _parse(json.loads(pathlib.Path(path).read_text()))


@functools.cache
def _load_default() -> tuple[Published, ...]:
    return _parse(json.loads(DATA.read_text()))


def _parse(data: dict) -> tuple[Published, ...]:
    sources = {name: _source(name, fields) for name, fields in data.get("sources", {}).items()}
    records = tuple(_record(i, fields, sources) for i, fields in enumerate(data.get("records", [])))
    shared: dict[str, tuple] = {}
    for r in records:
        kind = shared.setdefault(r.group, (r.source, r.statistic, r.aggregation))
        if kind != (r.source, r.statistic, r.aggregation):
            raise ValueError(
                f"published group {r.group!r} mixes sources, statistics or aggregations ({r.task}, {r.encoding}): "
                "one group is one table, with one source line"
            )
    return records


def _group(group: str) -> list[Published]:
    found = [r for r in load() if r.group == group]
    if not found:
        known = sorted({r.group for r in load()})
        raise ValueError(f"no published group {group!r}; known: {known}")
    return found


def by_task(group: str) -> dict[str, dict[str, float]]:
    """``{task: {encoding: value}}`` of one group of records.

    >>> by_task("kazemnejad2023-test-21-40")["counting_copy"]["nope"]
    0.986
    """
    out: dict[str, dict[str, float]] = {}
    for r in _group(group):
        out.setdefault(r.task, {})[r.encoding] = r.value
    return out


def record(group: str, task: str, encoding: str) -> Published:
    """The one record of ``group`` for ``task`` and ``encoding``."""
    for r in _group(group):
        if (r.task, r.encoding) == (task, encoding):
            return r
    raise ValueError(f"no published number for task {task!r}, encoding {encoding!r} in {group!r}")


def source_line(group: str) -> str:
    """One line naming a group's source, statistic and whose aggregation it is, for a report.

    >>> print(source_line("kazemnejad2023-test-21-40"))  # doctest: +ELLIPSIS
    Kazemnejad et al. 2023 (arXiv:2305.19466; decoder-only 12 layers x 768, ...): per run, the mean of exact match ...
    """
    rows = _group(group)
    first, source = rows[0], rows[0].source
    whose = "our aggregation of the authors' rows" if first.aggregation == "ours" else "as the paper reports it"
    # The clauses every record's filter shares (the per-task ones are in the data file).
    common = [c for c in first.filter.split(" and ") if all(c in r.filter.split(" and ") for r in rows)]
    picked = f" ({' and '.join(common)})" if common else ""
    unverified = "" if source.verified else ", not re-verified"
    return (
        f"{source.paper} (arXiv:{source.arxiv}; {source.protocol}): {first.statistic}, {whose}, from {source.where}"
        f"{picked}{unverified}"
    )
