"""The CoPE paper's tasks (Golovneva et al. 2024): flip-flop (Liu et al. 2023) and counting."""

import collections

import numpy as np
import pytest

from posenc_jax.bench import baselines
from posenc_jax.bench.tasks import (
    COUNT_EQUALS,
    COUNT_FIRST_VARIABLE,
    COUNT_INCREMENT,
    COUNT_PASS,
    COUNT_PRINT,
    COUNT_SEMICOLON,
    FF_IGNORE,
    FF_READ,
    FF_WRITE,
    make_task,
)


def _pairs(batch, i):
    """The (instruction, bit) pairs of example i, read back from its inputs and targets."""
    tokens = np.concatenate([batch["inputs"][i, :1], batch["targets"][i]])
    n = int(batch["weights"][i].sum() + 1) // 2
    return tokens[: 2 * n].reshape(n, 2)


def test_flip_flop_sequences_obey_the_grammar_and_lengths():
    task = make_task("flip_flop")
    lengths = [2, 3, 7, 20, 50]
    batch = task.batch(np.random.default_rng(0), lengths, pad_to=task.max_tokens(60))
    assert batch["inputs"].shape == (5, task.max_tokens(60))
    for i, n in enumerate(lengths):
        pairs = _pairs(batch, i)
        assert len(pairs) == n
        assert pairs[0, 0] == FF_WRITE and pairs[-1, 0] == FF_READ
        memory = None
        for instruction, bit in pairs:
            assert instruction in (FF_WRITE, FF_READ, FF_IGNORE) and bit in (0, 1)
            if instruction == FF_WRITE:
                memory = bit
            elif instruction == FF_READ:
                assert bit == memory


def test_flip_flop_instruction_and_bit_frequencies():
    for p_i in (0.8, 0.98, 0.1):
        task = make_task("flip_flop", ignore_probability=p_i)
        batch = task.batch(np.random.default_rng(1), [200] * 50)
        counts = collections.Counter()
        bits = collections.Counter()
        for i in range(50):
            pairs = _pairs(batch, i)[1:-1]  # the first and last instructions are fixed
            counts.update(pairs[:, 0].tolist())
            bits.update(pairs[pairs[:, 0] != FF_READ, 1].tolist())
        total = sum(counts.values())
        assert counts[FF_IGNORE] / total == pytest.approx(p_i, abs=0.02)
        assert counts[FF_WRITE] / total == pytest.approx((1 - p_i) / 2, abs=0.02)
        assert counts[FF_READ] / total == pytest.approx((1 - p_i) / 2, abs=0.02)
        assert bits[1] / (bits[0] + bits[1]) == pytest.approx(0.5, abs=0.03)


def test_flip_flop_trains_on_the_sequence_and_scores_exactly_the_read_bits():
    task = make_task("flip_flop")
    batch = task.batch(np.random.default_rng(2), [2, 9, 16], pad_to=task.max_tokens(16))
    for i, n in enumerate([2, 9, 16]):
        np.testing.assert_array_equal(batch["weights"][i], np.arange(batch["inputs"].shape[1]) < 2 * n - 1)
        np.testing.assert_array_equal(batch["read_weights"][i] > 0, batch["inputs"][i] == FF_READ)
        assert np.all(np.isin(batch["targets"][i][batch["read_weights"][i] > 0], (0, 1)))
    perfect = batch["targets"]
    np.testing.assert_allclose(task.score(perfect, batch), 1.0)
    wrong = np.where(batch["read_weights"] > 0, 1 - batch["targets"], batch["targets"])
    np.testing.assert_allclose(task.score(wrong, batch), 0.0)  # only the reads count
    big = task.batch(np.random.default_rng(3), [64] * 200)
    constant = np.zeros_like(big["targets"])
    assert task.score(constant, big).mean() == pytest.approx(task.chance(64), abs=0.05)


def test_flip_flop_lengths_and_settings_are_checked():
    task = make_task("flip_flop")
    lengths = task.train_lengths(np.random.default_rng(0), 6, 1000)
    assert set(lengths.tolist()) == {2, 3, 4, 5, 6}
    with pytest.raises(ValueError, match="must be >= 2"):
        task.check_lengths(4, [1, 8])
    with pytest.raises(ValueError, match=r"ignore_probability must be in \[0, 1\)"):
        make_task("flip_flop", ignore_probability=1.0)


@pytest.mark.parametrize("name", ["flip_flop", "cope_count"])
def test_the_same_seed_gives_the_same_batch(name):
    task = make_task(name)
    first = task.batch(np.random.default_rng(7), [3, 5, 4], pad_to=task.max_tokens(6))
    again = task.batch(np.random.default_rng(7), [3, 5, 4], pad_to=task.max_tokens(6))
    other = task.batch(np.random.default_rng(8), [3, 5, 4], pad_to=task.max_tokens(6))
    assert first.keys() == again.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    assert not np.array_equal(first["inputs"], other["inputs"])


def _words(*statements):
    """Token ids of counting statements written as the paper's text (variables a, b, c)."""
    ids = {"=": COUNT_EQUALS, ";": COUNT_SEMICOLON, "pass;": COUNT_PASS, "++;": COUNT_INCREMENT, "print": COUNT_PRINT}
    ids |= {v: COUNT_FIRST_VARIABLE + i for i, v in enumerate("abc")}
    ids |= {str(k): k for k in range(11)}
    return np.array([ids[w] for s in statements for w in s.split()])


def test_counting_answers_against_a_hand_count():
    task = make_task("cope_count")
    cases = [
        (("a = 0 ;", "a ++;", "pass;", "a ++;", "print a"), 2),
        (("a = 0 ;", "b = 0 ;", "a ++;", "b ++;", "a ++;", "print b"), 1),
        (("a = 0 ;", "a ++;", "a ++;", "a = 0 ;", "a ++;", "print a"), 1),  # a set again: counting restarts
        (("c = 0 ;", "pass;", "pass;", "print c"), 0),
    ]
    for statements, count in cases:
        np.testing.assert_array_equal(task.answer(_words(*statements)), [count])
    with pytest.raises(ValueError, match="does not end in 'print v'"):
        task.answer(_words("a = 0 ;", "print b"))


def test_counting_examples_follow_the_generator():
    task = make_task("cope_count")
    rng = np.random.default_rng(4)
    for n in (1, 2, 5, 30):
        for _ in range(20):
            x, y = task._example(rng, n)
            words = x[:-2].tolist()
            statements = 0
            while words:  # the context parses into exactly n statements
                size = 1 if words[0] == COUNT_PASS else 4 if words[1] == COUNT_EQUALS else 2
                statements += 1
                words = words[size:]
            assert statements == n and x[-2] == COUNT_PRINT
            assert 0 <= y[0] <= 10 and len(x) + 1 <= task.max_tokens(n) + 1


def test_counting_batches_weigh_the_answer_alone():
    task = make_task("cope_count")
    batch = task.batch(np.random.default_rng(5), [1, 4, 12], pad_to=task.max_tokens(12))
    assert batch["inputs"].shape == (3, task.max_tokens(12))
    assert np.all(batch["weights"].sum(-1) == 1)
    for i in range(3):
        at = int(np.flatnonzero(batch["weights"][i])[0])
        assert batch["inputs"][i, at - 1] == COUNT_PRINT
        x = batch["inputs"][i, : at + 1]
        assert batch["targets"][i, at] == task.answer(x)[0]
    np.testing.assert_allclose(task.score(batch["targets"], batch), 1.0)
    big = task.batch(np.random.default_rng(6), [8] * 400)
    zero = np.zeros_like(big["targets"])
    # A constant guess scores the probability of its value: the exact distribution says which.
    assert task.score(zero, big).mean() == pytest.approx(task.answer_distribution(8)[0], abs=0.05)


def test_counting_answer_distribution_matches_sampling():
    task = make_task("cope_count")
    rng = np.random.default_rng(9)
    for n in (1, 3, 10):
        exact = task.answer_distribution(n)
        assert exact.sum() == pytest.approx(1.0)
        drawn = np.bincount([task._example(rng, n)[1][0] for _ in range(2000)], minlength=11) / 2000
        np.testing.assert_allclose(drawn, exact, atol=0.035)
    np.testing.assert_allclose(task.answer_distribution(1), np.eye(11)[0])  # one statement: a set


def test_baselines_of_the_cope_tasks():
    flip = baselines.algorithmic_baselines(make_task("flip_flop"), 16)
    assert flip == {"chance": 0.5, "position-only": 0.5, "content-only": None}
    count = make_task("cope_count")
    found = baselines.algorithmic_baselines(count, 5)
    assert found["chance"] == pytest.approx(1 / 11) and found["content-only"] is None
    assert found["position-only"] == pytest.approx(max(count.answer_distribution(5)))


def test_cope_tasks_are_listed_and_validated():
    from posenc_jax.bench.tasks import task_names

    assert {"flip_flop", "cope_count"} <= set(task_names())
    assert make_task("flip_flop").kind == make_task("cope_count").kind == "decoder"
    with pytest.raises(ValueError, match="num_variables must be in 1..26"):
        make_task("cope_count", num_variables=0)
    assert make_task("cope_count", num_variables=5).vocab_size == make_task("cope_count").vocab_size + 2
