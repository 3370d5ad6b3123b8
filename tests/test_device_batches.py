"""The training batches made on the device (posenc_jax/bench/device_batches.py) against the host's.

Every example a device generator makes must be one the host generator could make, laid out as
the host lays it out (same tokens, targets, weights, key mask, padding), and the two must draw
from the same distribution: the same lengths and the same symbols, as often.
"""

import functools

import jax
import numpy as np
import pytest

from posenc_jax.bench.device_batches import DEVICE_TASKS, DeviceBatches, seed_key, step_key
from posenc_jax.bench.presets import TaskLengths
from posenc_jax.bench.tasks import BLANK, EMPTY, MARKER, TASK_FORMATS, make_task

EXAMPLES = 1000
LENGTHS = TaskLengths(train=7, eval=(14,), examples=1, batch=1, train_min=2)
ALGORITHMIC = [name for name in DEVICE_TASKS if name != "text"]


@functools.cache
def _jitted(make):
    return jax.jit(make)


def _device(task, lengths=LENGTHS, examples=EXAMPLES, key=None):
    make = DeviceBatches(task, lengths, examples)
    batch = _jitted(make)(make.data, step_key(seed_key(0), 3) if key is None else key)
    return {name: np.asarray(x) for name, x in batch.items()}


def _host(task, lengths=LENGTHS, examples=EXAMPLES):
    rng = np.random.default_rng(0)
    return task.batch(
        rng,
        task.train_lengths(rng, lengths.train, examples, minimum=lengths.train_min),
        pad_to=task.max_tokens(lengths.train),
    )


def _prompts(task, batch) -> list[np.ndarray]:
    """What precedes the answer in each example: the prompt before SEP (decoder tasks), or
    ``x`` before the first blank (encoder tasks)."""
    if task.kind == "encoder":
        return [row[: np.flatnonzero(row == BLANK)[0]] for row in batch["inputs"]]
    tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    return [row[: np.flatnonzero(row == task.sep)[0]] for row in tokens]


def _host_layout(task, prompts, lengths=LENGTHS) -> dict:
    """The host's batch of exactly these prompts: its ``batch`` with its ``_example`` replaying them."""

    class Replay(type(task)):
        def _example(self, prompts, n):
            prompt = next(prompts)
            return prompt, self.answer(prompt)

    replay = Replay(task.name, task.format)
    return replay.batch(iter(prompts), [0] * len(prompts), pad_to=task.max_tokens(lengths.train))


def _length(task, prompt) -> int:
    """The example's length n (the length of x), from a decoder task's prompt."""
    words = {"ours": 0, "paper": 1}[task.format]
    return len(prompt) - (2 + 3 * words if task.name == "counting_replace" else words)


def _check_example(task, prompt) -> None:
    """Raises AssertionError unless the host generator could have made ``prompt``."""
    a = task.symbols
    if task.kind == "encoder":
        if task.name != "missing_duplicate":
            assert prompt.max() < a and LENGTHS.train_min <= len(prompt) <= LENGTHS.train
            return
        if task.format == "paper" and len(prompt) == 1:
            assert prompt.tolist() == [1]
            return
        core = prompt[:-1] if task.format == "paper" and len(prompt) % 2 else prompt
        assert len(core) % 2 == 0 and (len(core) == len(prompt) or prompt[-1] == EMPTY)
        assert (core == MARKER).sum() == 1 and set(core.tolist()) <= {0, 1, MARKER}
        half = len(core) // 2
        w, twin = core[:half], core[half:]
        assert all(x == y for x, y in zip(w, twin, strict=True) if MARKER not in (x, y))
        return
    n = _length(task, prompt)
    assert LENGTHS.train_min <= n <= LENGTHS.train, n
    if task.name == "counting_replace":
        if task.format == "paper":
            assert prompt[[0, 2, 4]].tolist() == [task._word(w) for w in ("replace", "with", "in")]
            prompt = np.delete(prompt, [0, 2, 4])
        s, t, rest = prompt[0], prompt[1], prompt[2:]
        assert s != t and (rest == s).all() and max(s, t) < a
        return
    if task.format == "paper":
        assert prompt[0] == task._word("reverse" if task.name == "reverse" else "copy")
        prompt = prompt[1:]
    assert prompt.max() < a
    if task.name == "counting_copy":
        assert (prompt == prompt[0]).all()


def _agree(device_counts, host_counts, what):
    """Each category as frequent in both samples, within 5 standard errors of the difference."""
    keys = sorted(set(device_counts) | set(host_counts))
    d = np.array([device_counts.get(k, 0) for k in keys], float)
    h = np.array([host_counts.get(k, 0) for k in keys], float)
    pooled = (d + h) / (d.sum() + h.sum())
    error = np.sqrt(pooled * (1 - pooled) * (1 / d.sum() + 1 / h.sum()))
    z = np.abs(d / d.sum() - h / h.sum()) / np.maximum(error, 1e-12)
    assert (z < 5).all(), f"{what}: {dict(zip(keys, np.round(z, 1), strict=True))} (z per category)"


def _counts(values) -> dict:
    keys, counts = np.unique(np.asarray(values), return_counts=True)
    return dict(zip(keys.tolist(), counts.tolist(), strict=True))


@pytest.mark.parametrize("format", TASK_FORMATS)
@pytest.mark.parametrize("name", ALGORITHMIC)
def test_device_examples_are_valid_laid_out_as_the_host_does_and_drawn_alike(name, format):
    task = make_task(name, format=format)
    device, host = _device(task), _host(task)
    assert {k: (v.shape, v.dtype) for k, v in device.items()} == {k: (v.shape, v.dtype) for k, v in host.items()}
    prompts = _prompts(task, device)
    for prompt in prompts:
        _check_example(task, prompt)
    # The layout, answers included (the host's answer to each prompt), token for token.
    replayed = _host_layout(task, prompts)
    for key in host:
        np.testing.assert_array_equal(device[key], replayed[key], err_msg=key)
    # The same distribution: lengths and symbols (the symbols of x; the answer is a function of it).
    # Counting tasks repeat one symbol: each example's distinct symbols are its draws.
    host_prompts = _prompts(task, host)
    _agree(_counts([len(p) for p in prompts]), _counts([len(p) for p in host_prompts]), "prompt lengths")
    draws = (lambda p: np.unique(p)) if name.startswith("counting") else (lambda p: p)
    symbols = lambda ps: np.concatenate([draws(p[p < task.symbols]) for p in ps])
    _agree(_counts(symbols(prompts)), _counts(symbols(host_prompts)), "symbols")
    if task.kind == "decoder":  # lengths drawn uniformly from train_min..train, every one of them
        lengths = _counts([_length(task, p) for p in prompts])
        assert sorted(lengths) == list(range(LENGTHS.train_min, LENGTHS.train + 1))


def test_the_agreement_check_fails_on_another_distribution():
    """Not vacuous: lengths one short of the range, or a symbol missing, are caught."""
    task = make_task("copy")
    host = _prompts(task, _host(task))
    short = _prompts(task, _device(task, TaskLengths(train=6, eval=(14,), examples=1, batch=1, train_min=2)))
    with pytest.raises(AssertionError, match="prompt lengths"):
        _agree(_counts([len(p) for p in short]), _counts([len(p) for p in host]), "prompt lengths")
    device = np.concatenate(_prompts(task, _device(task)))
    with pytest.raises(AssertionError, match="symbols"):
        _agree(_counts(np.minimum(device, 8)), _counts(np.concatenate(host)), "symbols")


def test_device_text_windows_are_the_host_windows_at_uniform_starts():
    task = make_task("text")
    lengths = task_lengths = TaskLengths(train=16, eval=(32,), examples=1, batch=1, text=True)
    make = DeviceBatches(task, task_lengths, EXAMPLES)
    key = step_key(seed_key(1), 7)
    # The starts, read from a train split of the same length holding each character's index.
    index = jax.numpy.arange(len(task.train), dtype=jax.numpy.int32)
    starts = np.asarray(make(index, key)["inputs"])[:, 0]
    batch = {k: np.asarray(v) for k, v in jax.jit(make)(make.data, key).items()}
    want = task.windows_at("train", starts, lengths.train)
    for name in want:
        np.testing.assert_array_equal(batch[name], want[name], err_msg=name)
    # Uniform over the host's range, 0 .. len - length - 2.
    last = len(task.train) - lengths.train - 2
    assert starts.min() >= 0 and starts.max() <= last
    tenths = np.bincount(starts * 10 // (last + 1), minlength=10)
    assert len(tenths) == 10 and (np.abs(tenths - EXAMPLES / 10) < 5 * np.sqrt(EXAMPLES / 10)).all(), tenths


def test_a_batch_depends_on_its_seed_and_step_alone():
    task = make_task("duplicate", format="paper")
    at = lambda seed, step: _device(task, examples=8, key=step_key(seed_key(seed), step))["inputs"]
    np.testing.assert_array_equal(at(0, 5), at(0, 5))
    assert not np.array_equal(at(0, 5), at(0, 6)) and not np.array_equal(at(0, 5), at(1, 5))


def test_a_task_without_a_device_generator_is_refused_by_name():
    with pytest.raises(ValueError, match="task 'flip_flop' has no device generator.*batches='host'"):
        DeviceBatches(make_task("flip_flop"), LENGTHS, 4)
