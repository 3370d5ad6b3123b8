"""The paper formats of the decoder and encoder tasks, each against examples written out by hand
from the authors' code (Kazemnejad et al.: McGill-NLP/length-generalization's dataset builders and
instance processors; Ruoss et al.: google-deepmind/randomized_positional_encodings' tasks)."""

import dataclasses
import re

import numpy as np
import pytest

from posenc_jax.bench import baselines
from posenc_jax.bench.ledger import fingerprint
from posenc_jax.bench.presets import PRESETS, Preset, TaskLengths
from posenc_jax.bench.tasks import EMPTY, MARKER, PAPER_DECODER_SYMBOLS, make_task


def _text(task, row, weights=None) -> str:
    """A decoder example as the authors' text writes it, up to its end token."""
    words = [task.token_name(t) for t in row]
    return " ".join(words[: words.index("[EOS]") + 1])


def _decoder_row(task, n, seed=0):
    batch = task.batch(np.random.default_rng(seed), [n])
    return np.concatenate([batch["inputs"][0], batch["targets"][0, -1:]])


# Written out by hand from the authors' code: the prompt their instance processor builds
# ("Copy: {src} ", "Reverse: {src} ", "Replace {s} with {t} in {src} "), then "[SEP] ", then the
# target their builder writes (duplicate: "x [NEXT] x"), then the end of sequence.
HAND_WRITTEN = {
    "copy": ("Copy: 7 42 3", "7 42 3"),
    "counting_copy": ("Copy: 5 5 5 5", "5 5 5 5"),
    "counting_replace": ("Replace 6 with 9 in 6 6 6", "9 9 9"),
    "duplicate": ("Copy: 7 42 3", "7 42 3 [NEXT] 7 42 3"),
    "reverse": ("Reverse: 7 42 3", "3 42 7"),
}


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_kazemnejad_format_matches_the_hand_written_example(name):
    task = make_task(name, format="paper")
    prompt_text, answer_text = HAND_WRITTEN[name]
    names = {task.token_name(t): t for t in range(task.vocab_size)}
    prompt = np.array([names[w] for w in prompt_text.split()])
    assert " ".join(task.token_name(t) for t in task.answer(prompt)) == answer_text
    # A drawn example has the same shape: its text matches the template with its own symbols.
    for n in (1, 4, 9):
        text = _text(task, _decoder_row(task, n, seed=n))
        symbols = r"\d+(?: \d+)*"
        template = {
            "copy": rf"Copy: ({symbols}) \[SEP\] \1 \[EOS\]",
            "counting_copy": r"Copy: (\d+)(?: \1)* \[SEP\] \1(?: \1)* \[EOS\]",
            "counting_replace": r"Replace (\d+) with (\d+) in \1(?: \1)* \[SEP\] \2(?: \2)* \[EOS\]",
            "duplicate": rf"Copy: ({symbols}) \[SEP\] \1 \[NEXT\] \1 \[EOS\]",
            "reverse": rf"Reverse: ({symbols}) \[SEP\] ({symbols}) \[EOS\]",
        }[name]
        match = re.fullmatch(template, text)
        assert match, text
        x = text.split(" [SEP] ")[0].split()[-n:]
        assert len(x) == n and all(int(s) < PAPER_DECODER_SYMBOLS for s in x)
        if name == "reverse":
            assert match.group(2).split() == x[::-1]
        if name == "counting_replace":
            assert match.group(1) != match.group(2)  # t differs from s


def test_kazemnejad_format_lengths_and_vocabulary():
    for name in HAND_WRITTEN:
        task = make_task(name, format="paper")
        for n in (1, 5, 10):
            row = _decoder_row(task, n)
            assert len(_text(task, row).split()) == task.max_tokens(n) + 1  # inputs plus the last target
        assert task.vocab_size == PAPER_DECODER_SYMBOLS + 10
    # Our own format is unchanged: 10 symbols, no words, no separator inside duplicate's answer.
    ours = make_task("duplicate")
    assert ours.symbols == 10 and ours.max_tokens(3) == 3 + 1 + 6
    assert ours.answer(np.array([1, 2])).tolist() == [1, 2, 1, 2]


def test_ruoss_format_matches_their_docstring_examples():
    # tasks/cs/missing_duplicate_string.py: "01100210 -> 1", "1011213 -> 0" (2 hides a token, 3 pads).
    md = make_task("missing_duplicate", format="paper")
    assert (MARKER, EMPTY) == (2, 3)
    assert md.answer(np.array([0, 1, 1, 0, 0, 2, 1, 0])).tolist() == [1]
    assert md.answer(np.array([1, 0, 1, 1, 2, 1, 3])).tolist() == [0]
    # tasks/cs/bucket_sort.py: "10204112 -> 00111224" over 5 symbols.
    bs = make_task("bucket_sort", format="paper")
    assert bs.answer(np.array([1, 0, 2, 0, 4, 1, 1, 2])).tolist() == [0, 0, 1, 1, 1, 2, 2, 4]
    # tasks/dcf/reverse_string.py: "011010 -> 010110" (binary in the paper).
    rs = make_task("reverse_string", format="paper")
    assert rs.answer(np.array([0, 1, 1, 0, 1, 0])).tolist() == [0, 1, 0, 1, 1, 0]
    # tasks/regular/parity_check.py: "1010100 -> 1", "01111 -> 0".
    parity = make_task("parity", format="paper")
    assert parity.answer(np.array([1, 0, 1, 0, 1, 0, 0])).tolist() == [1]
    assert parity.answer(np.array([0, 1, 1, 1, 1])).tolist() == [0]


def test_ruoss_format_draws_their_alphabets_and_lengths():
    rng = np.random.default_rng(0)
    alphabets = {"reverse_string": {0, 1}, "bucket_sort": set(range(5)), "parity": {0, 1}}
    for name, alphabet in alphabets.items():
        task = make_task(name, format="paper")
        batch = task.batch(rng, [12] * 64)
        x = batch["inputs"][:, :12]
        assert set(np.unique(x)) == alphabet, name
        assert task.chance(12) == (0.5 if name == "parity" else 1 / len(alphabet))
    md = make_task("missing_duplicate", format="paper")
    for n in (1, 2, 7, 8):
        for _ in range(20):
            x, y = md._example(rng, n)
            assert len(x) == n  # odd lengths kept (an empty token last), never rounded up
            if n == 1:
                assert x.tolist() == [1] and y.tolist() == [1]
                continue
            assert (x == MARKER).sum() == 1 and (x[-1] == EMPTY) == (n % 2 == 1)
            core = x[: 2 * (n // 2)]
            visible = core[core != MARKER]
            assert y[0] == visible.sum() % 2  # w w has an even number of ones
    assert md.max_tokens(7) == 8 and make_task("missing_duplicate").max_tokens(7) == 9


@pytest.mark.parametrize(
    "name, n",
    [
        ("reverse_string", 6),
        ("bucket_sort", 4),
        ("parity", 5),
        ("missing_duplicate", 1),
        ("missing_duplicate", 5),
        ("missing_duplicate", 6),
        ("counting_copy", 3),
        ("counting_replace", 3),
        ("copy", 2),
    ],
)
def test_paper_format_baselines_match_enumeration(name, n):
    task = make_task(name, format="paper")
    closed = baselines.algorithmic_baselines(task, n)
    walked = baselines.enumerated_baselines(task, n)
    for key in ("position-only", "content-only"):
        assert closed[key] == pytest.approx(walked[key], abs=1e-12), (key, closed, walked)


def test_paper_format_is_part_of_the_fingerprint_and_ours_leaves_it_as_it_was():
    cpu = PRESETS["cpu"]
    assert fingerprint(dataclasses.replace(cpu, task_format="paper", tasks=("copy",))) != fingerprint(
        dataclasses.replace(cpu, tasks=("copy",))
    )
    assert fingerprint(dataclasses.replace(cpu, train_min_length=2)) != fingerprint(cpu)
    # A preset at the defaults hashes exactly as a preset without the two fields (nor the later
    # batches and steps_per_dispatch) did.
    import hashlib
    import json

    from posenc_jax.bench import ledger

    settings = dataclasses.asdict(cpu)
    for key in (*ledger._NOT_HASHED, "task_format", "train_min_length", "batches", "steps_per_dispatch"):
        settings.pop(key)
    settings["method"] = ledger.METHOD
    assert fingerprint(cpu) == hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def test_preset_refuses_a_format_a_task_lacks_and_a_bad_minimum():
    with pytest.raises(ValueError, match="only the benchmark's own format"):
        dataclasses.replace(PRESETS["cpu"], tasks=("counting_copy", "text"), task_format="paper").validate()
    with pytest.raises(ValueError, match="task_format must be one of"):
        dataclasses.replace(PRESETS["kazemnejad"], task_format="theirs").validate()
    with pytest.raises(ValueError, match="train_min_length"):
        dataclasses.replace(PRESETS["kazemnejad"], train_min_length=11).validate()
    with pytest.raises(ValueError, match="has no 'paper' format"):
        make_task("text", format="paper")


def test_training_lengths_start_at_the_preset_minimum():
    preset = PRESETS["kazemnejad"]
    task = make_task("copy", format="paper")
    lengths = preset.lengths(task)
    assert lengths == TaskLengths(train=10, eval=tuple(range(2, 21)), examples=128, batch=64, train_min=2)
    drawn = task.train_lengths(np.random.default_rng(0), lengths.train, 2000, minimum=lengths.train_min)
    assert drawn.min() == 2 and drawn.max() == 10
    assert isinstance(preset, Preset) and preset.task_format == "paper"


@pytest.mark.parametrize("encoding", ["nope", "t5", "alibi", "rope", "sinusoidal"])
def test_teacher_forced_exact_match_is_greedy_exact_match(encoding):
    """The decoder tasks' exact match is read from one teacher-forced pass (every answer token the
    argmax given the true prefix); that is greedy decoding's exact match: if each step is right
    given the true prefix, greedy never leaves it, and where greedy first leaves it the
    teacher-forced argmax is wrong too. Checked with real greedy decoding over the KV cache, on
    answers the model gets right (its own greedy continuations) and answers one token off."""
    from posenc_jax.bench.cell import build_model, encodings_for, predict
    from posenc_jax.generation import generate

    task = make_task("copy", format="paper")
    preset = dataclasses.replace(PRESETS["kazemnejad"], model_dim=32, num_layers=2, num_heads=2, mlp_dim=64)
    configs = encodings_for(encoding, 16, task.max_tokens(10), task.max_tokens(20))
    model = build_model(task, preset, configs, seed=0)
    n, rows = 13, 16
    rng = np.random.default_rng(3)
    batch = task.batch(rng, [n] * rows, split="test")
    prompt = n + 2  # "Copy:", x, [SEP]
    answer = n + 1  # y, [EOS]
    greedy = np.asarray(generate(model, batch["inputs"][:, :prompt], max_new_tokens=answer))[:, prompt:]
    truth = greedy.copy()
    off = rows // 2 + np.arange(rows // 2)  # the second half: one answer token changed
    slots = rng.integers(0, answer, len(off))
    truth[off, slots] = (truth[off, slots] + 1 + rng.integers(0, task.vocab_size - 1, len(off))) % task.vocab_size
    tokens = np.concatenate([batch["inputs"][:, :prompt], truth], axis=1)
    forced = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.concatenate([np.zeros((rows, prompt - 1)), np.ones((rows, answer))], 1).astype(np.float32),
        "positions": np.arange(tokens.shape[1] - 1, dtype=np.int32),
    }
    teacher_forced = task.score(np.asarray(predict(model, forced)["predictions"]), forced)
    greedy_match = (greedy == truth).all(axis=1).astype(float)
    np.testing.assert_array_equal(teacher_forced, greedy_match)
    assert teacher_forced[: rows // 2].all() and not teacher_forced[rows // 2 :].any()
