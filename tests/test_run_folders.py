"""No silent wrong answer left (issue 56): a run folder's record, a corpus's bytes and the numbers of
the command line are checked, and what cannot be used stops the run in one line that names it.

* Run folders × edits: ``run.json`` deleted, a field edited, added or removed, a line of
  ``results.jsonl`` cut or garbled at random places. A resumed run stops, naming what differs and how
  to recover (``--repair``, a new ``--out``), except for the one damage a kill leaves: a last line cut
  short without its newline, dropped with a warning that shows it.
* Corpora × encodings: UTF-16 (with and without its byte-order mark), Latin-1 bytes, a NUL, an empty
  file, a binary file in a folder; each refused naming the file and the offset of the first bad byte.
* Every numeric flag of ``extrapolate`` and ``probe`` at 0 and -1: refused naming the flag.

The folders are written through the ledger itself (no training), so each case takes milliseconds.
"""

import dataclasses
import json
import random
import re
import shutil

import jax
import pytest

from posenc_jax.bench import extrapolate, presets
from posenc_jax.bench.cli import _NUMBERS, main
from posenc_jax.bench.ledger import Ledger, field_digests, fingerprint, read_rows
from posenc_jax.bench.tasks import make_task

PRESET = dataclasses.replace(presets.PRESETS["smoke"], encodings=("nope",), tasks=("counting_copy",), steps=2)
SETTINGS = fingerprint(PRESET)
SEEDS = 40  # random edits per generator


def _one_line(message: str) -> str:
    assert "\n" not in message and len(message) < 800, message
    return message


def _run(out, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
        return extrapolate.run(PRESET, out, progress=False, log=lambda line: None, **kwargs)


def _finished_folder(out, *, rows_only=False):
    """A results folder of PRESET as a finished run leaves it (every row measured; run.json with its
    digests), written through the ledger without training. ``rows_only``: stop before run.json, as a
    run killed in its first cell leaves it."""
    out.mkdir(parents=True, exist_ok=True)
    tasks = extrapolate._tasks(PRESET, None)
    book = Ledger(out, SETTINGS)
    record = book.start_record(PRESET, corpus=None, asked=extrapolate.asked(PRESET, tasks))
    for label in record["asked"]["counting_copy"]:
        for seed in PRESET.seeds:
            for n in tasks["counting_copy"].lengths.eval:
                book.write({"task": "counting_copy", "encoding": label, "seed": seed, "length": n, "value": 0.5})
    if not rows_only:
        record["cells"].append({"task": "counting_copy", "label": "nope", "seeds": list(PRESET.seeds)})
        book.save_record(record)
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    return _finished_folder(tmp_path_factory.mktemp("finished"))


@pytest.fixture
def folder(finished, tmp_path):
    return pathlib_copy(finished, tmp_path / "run")


def pathlib_copy(source, target):
    shutil.copytree(source, target)
    return target


def _resume(out, **kwargs):
    """What a resumed run does first: open the ledger and its record."""
    return Ledger(out, SETTINGS, **kwargs).start_record(PRESET)


# ---------------------------------------------------------------- the record: run.json


def test_a_finished_folder_resumes_without_a_word_and_trains_nothing(folder, recwarn):
    before = (folder / "results.jsonl").read_text()
    record = _run(folder)
    assert (folder / "results.jsonl").read_text() == before and record["cells"][0]["label"] == "nope"
    written = json.loads((folder / "run.json").read_text())
    assert written["digests"] == field_digests(written) and "repairs" not in written
    assert not [w for w in recwarn if re.search(r"run.json|results.jsonl|--repair", str(w.message))]


def test_run_json_deleted_beside_rows_stops_the_run_and_is_not_rebuilt(folder):
    (folder / "run.json").unlink()
    with pytest.raises(ValueError) as error:
        _run(folder)
    message = _one_line(str(error.value))
    assert re.search(r"run.json is missing beside 4 rows of results.jsonl: the record .* is gone; .*--repair", message)
    assert not (folder / "run.json").exists()  # nothing rebuilt
    # Through the command line: one line, before anything trains.
    args = ["extrapolate", "--preset", "smoke", "--encodings", "nope", "--tasks", "counting_copy", "--steps", "2"]
    with pytest.raises(SystemExit, match=r"posenc-bench extrapolate: .*run.json is missing beside 4 rows"):
        main([*args, "--out", str(folder), "--no-progress", "--no-plots"])
    assert not (folder / "run.json").exists() and not (folder / "checkpoints").exists()


def test_repair_starts_a_deleted_run_json_anew_and_says_so(folder):
    (folder / "run.json").unlink()
    with pytest.warns(UserWarning, match=r"--repair: .*run.json is missing beside 4 rows"):
        record = _run(folder, repair=True)
    assert len(record["repairs"]) == 1 and "run.json is missing beside 4 rows" in record["repairs"][0]
    written = json.loads((folder / "run.json").read_text())
    assert written["repairs"] == record["repairs"] and written["cells"] == []  # the lost cells stay lost
    _resume(folder)  # repaired: the next run opens it without a word


def test_a_hand_edited_run_json_stops_the_run_naming_the_field(folder):
    path = folder / "run.json"
    record = json.loads(path.read_text())
    record["preset"]["steps"] = 2000
    path.write_text(json.dumps(record, indent=1))
    with pytest.raises(ValueError, match=r"run.json differs from what the run wrote \(preset.steps changed\)") as error:
        _run(folder)
    assert "--repair" in _one_line(str(error.value))
    assert json.loads(path.read_text())["preset"]["steps"] == 2000  # not overwritten
    with pytest.warns(UserWarning, match=r"--repair: .*\(preset.steps changed\)"):
        kept = _run(folder, repair=True)
    assert kept["repairs"] and "preset.steps changed" in kept["repairs"][0]
    _resume(folder)  # written again with its digests: clean


def test_a_run_killed_in_its_first_cell_resumes_without_run_json(tmp_path):
    out = _finished_folder(tmp_path / "killed", rows_only=True)
    assert not (out / "run.json").exists() and (out / ".pending-record").exists()
    record = _run(out)  # every row is there: nothing trains, and the record is written
    assert (out / "run.json").exists() and not (out / ".pending-record").exists()
    assert record["cells"] == []


def test_a_run_json_from_before_digests_is_taken_as_written(folder):
    path = folder / "run.json"
    record = json.loads(path.read_text())
    del record["digests"]
    path.write_text(json.dumps(record))
    assert _resume(folder)["cells"] == record["cells"]


def _field_edits(rng: random.Random, record: dict):
    """Random edits of a run record: (what the error must name, the edited record)."""
    fields = [(key, None) for key in record if key != "digests" and not isinstance(record[key], dict)]
    fields += [
        (key, sub) for key, value in record.items() if key != "digests" and isinstance(value, dict) for sub in value
    ]
    for _ in range(SEEDS):
        key, sub = rng.choice(fields)
        edited = json.loads(json.dumps(record))
        holder, name = (edited, key) if sub is None else (edited[key], sub)
        how = rng.choice(["change", "remove", "add"])
        label = key if sub is None else f"{key}.{sub}"
        if how == "change":
            value = holder[name]
            holder[name] = {
                bool: lambda v: not v,
                int: lambda v: v + rng.randint(1, 9),
                float: lambda v: v * 2 + 1,
                str: lambda v: v + "x",
                list: lambda v: [*v, "x"],
                dict: lambda v: {**v, "x": 1},
                type(None): lambda v: 0,
            }[type(value)](value)
            yield rf"{re.escape(label)}\b.* changed", edited
        elif how == "remove":
            del holder[name]
            yield rf"{re.escape(label)}\b.* removed", edited
        else:
            extra = f"hand_{rng.randint(0, 999)}"
            holder[extra] = rng.random()
            yield rf"{re.escape(extra if sub is None else f'{key}.{extra}')} added", edited


def test_fuzz_run_json_edits_are_each_named(finished, tmp_path):
    rng = random.Random(56)
    original = json.loads((finished / "run.json").read_text())
    for number, (named, edited) in enumerate(_field_edits(rng, original)):
        out = pathlib_copy(finished, tmp_path / f"edit{number}")
        (out / "run.json").write_text(json.dumps(edited, indent=1))
        with pytest.raises(ValueError, match=r"run.json differs from what the run wrote") as error:
            _resume(out)
        message = _one_line(str(error.value))
        assert re.search(named, message), (named, message)
        assert "--repair" in message and "new --out" in message


# ---------------------------------------------------------------- the ledger: results.jsonl


def test_a_garbage_last_line_stops_the_run(folder):
    path = folder / "results.jsonl"
    path.write_text(path.read_text() + "garbage\n")
    with pytest.raises(ValueError, match=r"results.jsonl line 5 is not JSON \('garbage'\); delete that line"):
        _run(folder)
    assert path.read_text().endswith("garbage\n")  # not dropped


def test_a_last_line_cut_short_by_a_kill_is_dropped_with_a_warning_that_shows_it(folder):
    path = folder / "results.jsonl"
    whole = path.read_text()
    path.write_text(whole + '{"task": "counting_copy", "enc')  # no newline: a write cut short
    with pytest.warns(UserWarning, match=r"results.jsonl line 5 was cut short.*'\{\"task\": \"counting_copy\", \"enc'"):
        _resume(folder)
    assert path.read_text() == whole


def test_readers_refuse_a_cut_last_line_and_say_a_resumed_run_drops_it(folder):
    path = folder / "results.jsonl"
    path.write_text(path.read_text() + '{"task": "counting_copy", "enc')
    with pytest.raises(ValueError, match=r"line 5 is cut short .*; run the same command again, which drops it"):
        read_rows(path)  # as the report and merge read it: nothing dropped there
    path.write_text(path.read_text() + "\n")  # with its newline it is no kill's: refused by the run too
    with pytest.raises(ValueError, match=r"line 5 is not JSON"):
        _resume(folder)


def _damaged(rng: random.Random, lines: list[str]):
    """Random damage of a ledger: (the damaged text, the line damaged, whether it is a kill's cut)."""
    for _ in range(SEEDS):
        index = rng.randrange(len(lines))
        line = lines[index]
        kind = rng.choice(["truncate", "garble", "binary"])
        if kind == "truncate":
            broken = line[: rng.randrange(1, len(line))]
        elif kind == "garble":
            at = rng.randrange(len(line))
            broken = line[:at] + rng.choice(["\x00", "}{", "\\", '"', "[", "NaN,"]) + line[at:]
        else:
            broken = None
        last = index == len(lines) - 1
        newline = not last or rng.random() < 0.5
        before = "".join(f"{kept}\n" for kept in lines[:index])
        after = "".join(f"{kept}\n" for kept in lines[index + 1 :])
        if broken is None:
            data = before.encode() + bytes(rng.randrange(128, 256) for _ in range(5)) + b"\n" + after.encode()
            yield data, index + 1, False
            continue
        try:
            json.loads(broken)
            continue  # still JSON (a quote doubled inside a string, say): not damage this generator makes
        except json.JSONDecodeError:
            pass
        cut = last and not newline  # what a kill leaves, or what cannot be told from it
        yield (before + broken + ("\n" if newline else "") + after).encode(), index + 1, cut


def test_fuzz_damaged_ledger_lines_stop_the_run_naming_the_line(finished, tmp_path):
    lines = (finished / "results.jsonl").read_text().splitlines()
    rng = random.Random(56)
    seen = {"cut": 0, "refused": 0}
    for number, (data, line, cut) in enumerate(_damaged(rng, lines)):
        out = pathlib_copy(finished, tmp_path / f"damage{number}")
        (out / "results.jsonl").write_bytes(data)
        if cut:
            with pytest.warns(UserWarning, match=rf"line {line} was cut short"):
                book = Ledger(out, SETTINGS)
            assert [n for n, _ in read_rows(out / "results.jsonl")] == list(range(1, len(lines)))
            assert not book.done("counting_copy", *_key(lines[-1]))  # measured again
            seen["cut"] += 1
            continue
        with pytest.raises(ValueError) as error:
            Ledger(out, SETTINGS)
        message = _one_line(str(error.value))
        assert re.search(rf"results.jsonl line {line} ", message) and "delete that line" in message, message
        assert (out / "results.jsonl").read_bytes() == data  # nothing dropped
        seen["refused"] += 1
    assert seen["cut"] and seen["refused"] > SEEDS // 2, seen


def _key(line: str):
    row = json.loads(line)
    return row["encoding"], row["seed"], row["length"]


# ---------------------------------------------------------------- corpora × encodings


def _read(path):
    """The corpus at ``path`` as the text task reads it (on first use)."""
    return make_task("text", corpus=str(path)).train


TEXT = "def f(x):\n    return x + 1  # a line of Python, repeated\n" * 40


def _encodings(rng: random.Random):
    """(name, bytes, the offset of the first bad byte, a word the message must hold) of corpora that are
    not UTF-8 text, bad bytes at random places."""
    at = lambda: rng.randrange(1, len(TEXT) - 1)
    yield "UTF-16 with its byte-order mark", TEXT.encode("utf-16"), 0, "iconv -f UTF-16"
    yield "UTF-16 without one", TEXT.encode("utf-16-le"), 1, "iconv -f UTF-16"
    yield "UTF-16 big-endian", TEXT.encode("utf-16-be"), 0, "iconv -f UTF-16"
    for _ in range(SEEDS // 4):
        place = at()
        latin = (TEXT[:place] + "café" + TEXT[place:]).encode("latin-1")
        yield "Latin-1 bytes", latin, place + 3, "iconv -f LATIN1"
        place = at()
        yield "a NUL", (TEXT[:place] + "\0" + TEXT[place:]).encode(), place, "0x00 (a NUL byte"
        place = at()
        cut = "é".encode()[:1]  # half a UTF-8 character
        yield "half a character", TEXT[:place].encode() + cut + TEXT[place:].encode(), place, "0xc3 (another"


def test_fuzz_a_corpus_that_is_not_utf8_is_refused_naming_the_file_and_the_byte(tmp_path):
    rng = random.Random(56)
    for number, (what, data, offset, word) in enumerate(_encodings(rng)):
        path = tmp_path / f"corpus{number}.txt"
        path.write_bytes(data)
        with pytest.raises(ValueError) as error:
            _read(path)
        message = _one_line(str(error.value))
        assert message.startswith(f"--corpus {path} is not UTF-8 text: byte {offset} is 0x"), (what, message)
        assert word in message, (what, message)


def test_an_empty_corpus_or_folder_and_a_binary_file_in_a_folder_are_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"--corpus {re.escape(str(empty))} is empty; pass a file that holds text"):
        _read(empty)
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("")
    with pytest.raises(ValueError, match=r"--corpus .*texts holds no text \(none of its 1 files holds any\)"):
        _read(folder)
    (folder / "b.txt").write_text(TEXT)
    (folder / "c.bin").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(ValueError, match=r"--corpus .*texts: .*c.bin is not UTF-8 text: byte 0 is 0x89"):
        _read(folder)


def test_utf8_text_reads_as_before(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT + "naïve café\n", encoding="utf-8")
    task = make_task("text", corpus=str(path))
    assert len(task.train) + len(task.validation) + len(task.test) == len(TEXT + "naïve café\n")


def test_a_utf16_corpus_stops_the_command_before_anything_trains(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT.encode("utf-16"))
    out = tmp_path / "out"
    args = ["extrapolate", "--preset", "smoke", "--tasks", "text", "--encodings", "nope", "--corpus", str(path)]
    with pytest.raises(SystemExit) as error:
        main([*args, "--out", str(out), "--no-progress", "--no-plots"])
    message = _one_line(str(error.value))
    assert re.fullmatch(
        rf"posenc-bench extrapolate: --corpus {re.escape(str(path))} is not UTF-8 text: byte 0 .*", message
    )
    assert not (out / "results.jsonl").exists() and not (out / "checkpoints").exists()


# ---------------------------------------------------------------- the command line's numbers

EXTRAPOLATE = [*(flag for flag in _NUMBERS if flag != "--query-init-scale"), "--processes"]
PROBE = ["--seeds", "--steps", "--query-init-scale"]


def _flag_cases():
    for command, flags in (("extrapolate", EXTRAPOLATE), ("probe", PROBE)):
        for flag in flags:
            for value in ("0", "-1"):
                if flag not in _NUMBERS or not _NUMBERS[flag][2](float(value)):
                    yield command, flag, value


@pytest.mark.parametrize(("command", "flag", "value"), list(_flag_cases()))
def test_a_numeric_flag_out_of_range_is_refused_naming_the_flag(tmp_path, command, flag, value):
    out = tmp_path / "out"
    argv = [command, "--preset", "smoke", "--no-progress", "--out", str(out), flag, value]
    with pytest.raises(SystemExit) as error:
        main([*argv, "--no-plots"] if command == "extrapolate" else argv)
    message = _one_line(str(error.value))
    assert message.startswith(f"posenc-bench {command}: ") and flag in message, message
    assert f"got {value}" in message or f"got {float(value)}" in message, message
    assert not out.exists()  # stopped before anything was written


def test_text_context_zero_and_negative_seeds_name_their_flags(tmp_path):
    # Were ZeroDivisionError and "expected non-negative integer".
    for flags, named in ((["--text-context", "0"], "--text-context"), (["--seeds", "0,-1"], "--seeds 0,-1")):
        with pytest.raises(SystemExit, match=rf"\({re.escape(named)}\)"):
            main(["extrapolate", "--preset", "smoke", "--out", str(tmp_path / "x"), "--no-plots", *flags])
