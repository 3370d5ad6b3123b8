"""The text task's corpus is pinned by its SHA-256, and its test windows are fixed.

The default corpus is 78 standard-library files pinned by hash (the same text on every interpreter
that has them, refused where one differs); a run refuses a corpus whose hash is not its preset's.
The windows scored at a length depend on the corpus and the length alone: every preset, encoding,
seed and run scores the same ones.
"""

import dataclasses
import hashlib
import shutil
import sysconfig
import warnings

import numpy as np
import pytest

from posenc_jax.bench import cell, extrapolate, presets
from posenc_jax.bench.ledger import Ledger
from posenc_jax.bench.tasks import STDLIB_CORPUS_SHA256, TextTask, corpus, make_task, stdlib_corpus


def _copy_pinned_files(root):
    """The pinned files of this interpreter's standard library, copied under ``root``."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for _, _, path in corpus._pinned_files():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f"{stdlib}/{path}", root / path)


def test_the_default_corpus_is_the_pinned_one_in_every_preset():
    task = make_task("text")
    assert task.sha256 == STDLIB_CORPUS_SHA256
    assert {p.text_corpus_sha256 for p in presets.PRESETS.values()} == {STDLIB_CORPUS_SHA256}
    # Every pinned file is read, each into the split the list gives it.
    files = corpus._pinned_files()
    train, test, test_paths = stdlib_corpus()
    assert test_paths == [path for _, split, path in files if split == "test"]
    assert len(test_paths) == 18 and len(files) == 78
    assert len(test) > 65_536  # the most test characters a preset scores


def test_the_hash_covers_every_split_and_where_it_is_cut(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abcdefghij" * 100)
    first = TextTask(str(corpus))
    before = first.sha256  # the corpus is read on first use
    corpus.write_text("abcdefghij" * 99 + "abcdefghiJ")  # one character of the test split
    assert TextTask(str(corpus)).sha256 != before == first.sha256
    # The same characters split elsewhere hash apart.
    moved = TextTask(str(corpus))
    moved._splits = (first.train[:-1], first.validation, np.concatenate([first.train[-1:], first.test]))
    assert moved.sha256 != first.sha256 and first.digest == first.sha256[:12]


def test_a_changed_or_missing_standard_library_file_is_refused_by_name(tmp_path):
    _copy_pinned_files(tmp_path)
    assert stdlib_corpus(tmp_path) == stdlib_corpus()
    with (tmp_path / "heapq.py").open("a") as changed:
        changed.write("# one more line\n")
    (tmp_path / "string.py").unlink()
    with pytest.raises(ValueError, match=r"1 are missing and 1 differ \(string\.py, heapq\.py\).*--corpus PATH"):
        stdlib_corpus(tmp_path)


def test_the_pinned_hashes_are_those_of_the_files_read_here():
    stdlib = sysconfig.get_paths()["stdlib"]
    for sha256, _, path in corpus._pinned_files():
        with open(f"{stdlib}/{path}", "rb") as file:
            assert hashlib.sha256(file.read()).hexdigest() == sha256, path


def test_a_run_refuses_a_corpus_whose_hash_is_not_its_presets(tmp_path):
    other = "0" * 64
    preset = dataclasses.replace(presets.PRESETS["smoke"], tasks=("text",), text_corpus_sha256=other)
    with pytest.raises(ValueError, match=f"has SHA-256 {STDLIB_CORPUS_SHA256}, but preset smoke pins {other}"):
        extrapolate.run(preset, tmp_path / "out", progress=False, log=lambda line: None)
    assert not (tmp_path / "out" / "results.jsonl").exists()
    with pytest.raises(ValueError, match="text_corpus_sha256 must be a SHA-256 in 64 lowercase hexadecimal"):
        dataclasses.replace(preset, text_corpus_sha256="ABC").validate()


def test_a_corpus_of_ones_own_sets_the_presets_hash(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    preset = presets.PRESETS["smoke"]
    own = {"text": make_task("text", corpus=str(corpus))}
    pinned = extrapolate.pin_corpus(preset, own, str(corpus))
    assert pinned.text_corpus_sha256 == own["text"].sha256 != STDLIB_CORPUS_SHA256
    assert extrapolate.pin_corpus(preset, {"text": make_task("text")}, None) is preset
    assert extrapolate.pin_corpus(preset, {"copy": make_task("copy")}, None) is preset


def _windows(preset, encoding, seed, length, folder):
    """The test windows a run of ``preset`` scores at ``length`` for ``encoding`` and ``seed``: its
    tasks and cells planned as :func:`extrapolate.run` plans them, then the cell's test batches."""
    preset = dataclasses.replace(preset, tasks=("text",), encodings=(encoding,), seeds=(seed,))
    planned = extrapolate.plan(preset, extrapolate._tasks(preset, None), Ledger(folder, "x"), log=lambda line: None)
    (here, _), *_ = planned
    batches = list(cell.eval_batches(here, seed, length))
    return np.concatenate([b["inputs"] for b in batches]), np.concatenate([b["targets"] for b in batches])


def test_two_runs_score_the_same_windows_at_a_length(tmp_path):
    # Different models, contexts, multiples, encodings and seeds; the same characters scored.
    a = dataclasses.replace(presets.PRESETS["smoke"], text_context=16, text_multiples=(1, 2, 4))
    b = dataclasses.replace(presets.PRESETS["cpu"], text_context=32, text_multiples=(1, 2), text_eval_characters=1024)
    assert a.text_eval_characters == b.text_eval_characters == 1024
    inputs_a, targets_a = _windows(a, "rope", 0, 64, tmp_path / "a")
    inputs_b, targets_b = _windows(b, "alibi", 3, 64, tmp_path / "b")
    assert np.array_equal(inputs_a, inputs_b) and np.array_equal(targets_a, targets_b)
    # The layout: windows of 64 from the start of the test split, each followed by its next character.
    test = make_task("text").test
    starts = make_task("text").window_starts(64, 1024)
    assert starts.tolist() == list(range(0, 1024, 64))
    assert all(np.array_equal(inputs_a[i], test[s : s + 64]) for i, s in enumerate(starts))
    assert np.array_equal(targets_a.ravel(), test[1:1025])


def test_a_preset_scoring_fewer_characters_scores_the_first_of_the_same_windows(tmp_path):
    more = dataclasses.replace(presets.PRESETS["smoke"], text_eval_characters=2048)
    fewer, _ = _windows(presets.PRESETS["smoke"], "nope", 0, 32, tmp_path / "fewer")
    longer, _ = _windows(more, "t5", 1, 32, tmp_path / "more")
    assert len(fewer) == 1024 // 32 and len(longer) == 2048 // 32
    assert np.array_equal(longer[: len(fewer)], fewer)
    with pytest.raises(ValueError, match="cannot score 1000 test characters in windows of 64"):
        make_task("text").window_starts(64, 1000)


def test_characters_outside_ascii_are_counted_in_a_warning(tmp_path):
    """The model's vocabulary is ASCII: a corpus of one's own with other characters is read with
    each of them as '?', and the run says how many, never silently."""
    path = tmp_path / "corpus.txt"
    path.write_text("naïve café " * 200 + "plain ascii text " * 200, encoding="utf-8")
    task = TextTask(str(path))
    with pytest.warns(UserWarning, match=r"400 of its 5,600 characters \(7.14%\) are not ASCII .*'éï'.* read as '\?'"):
        task.train  # noqa: B018 (reading the corpus)
    assert chr(int(task.train[2])) == "?"  # "na?ve"
    plain = tmp_path / "plain.txt"
    plain.write_text("plain ascii text " * 400, encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TextTask(str(plain)).train  # noqa: B018
