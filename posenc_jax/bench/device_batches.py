"""Training batches made on the device, inside the jitted training step (``Preset.batches="device"``).

The host generators (:meth:`DecoderTask.batch <posenc_jax.bench.tasks.DecoderTask.batch>` and the
others) build each example in a Python loop over numpy arrays, which on an accelerator costs more
than the step it feeds. Here every task's batch is a pure function of a JAX random key: fixed
shapes (every example padded to the longest training length, as the host pads them), the
lengths of the examples drawn uniformly from ``train_min``..``train`` like the host's, the same
dict (``inputs``, ``targets``, ``weights``, ``positions``, and ``key_mask`` for the encoder tasks)
laid out token for token as the host lays out the same example. Only the random stream differs:
a device batch is not the host batch of the same step, it is drawn from the same distribution
(``tests/test_device_batches.py`` checks both).

Each seed's data comes from its own key (:func:`seed_key`); the batch of step k is made from that
key folded with k (:func:`step_key`), so it depends on (seed, k) alone and a resumed run sees the
data an uninterrupted one would, however many steps each dispatch runs.

One function per task builds its examples as ``(prompt, prompt_length, answer, answer_length)``
arrays; :func:`_decoder_batch` and :func:`_encoder_batch` lay them out as the host does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.bench.tasks import BLANK, EMPTY, MARKER, PAD, DecoderTask, EncoderTask, TextTask
from posenc_jax.bench.tasks.encoder import half_length

__all__ = ["DEVICE_TASKS", "DeviceBatches", "seed_key", "step_key", "supports"]

# The tasks with a device generator (in both formats where they have two).
DEVICE_TASKS = (
    *("counting_copy", "counting_replace", "copy", "duplicate", "reverse"),
    *("reverse_string", "missing_duplicate", "parity", "bucket_sort"),
    "text",
)

# Folded into a seed's key before the steps, so the data's stream is apart from the model's
# initialisation and dropout streams (nnx.Rngs(seed), which starts from the same seed).
_DATA_STREAM = 0xDA7A


def seed_key(seed: int) -> jax.Array:
    """The key every training batch of ``seed`` is made from (with :func:`step_key`)."""
    return jax.random.fold_in(jax.random.key(seed), _DATA_STREAM)


def step_key(key: jax.Array, step) -> jax.Array:
    """The key of the batch of training step ``step`` (traced or not) from a :func:`seed_key`."""
    return jax.random.fold_in(key, step)


def supports(task) -> bool:
    """Whether ``task`` has a device generator."""
    return task.name in DEVICE_TASKS


def _take(values: jax.Array, index: jax.Array) -> jax.Array:
    """``values[b, index[b, k]]``, the index clipped into range (the caller masks what is out of it)."""
    index = jnp.broadcast_to(index, (values.shape[0], index.shape[1]))
    return jnp.take_along_axis(values, jnp.clip(index, 0, values.shape[1] - 1), axis=1)


def _columns(width: int) -> jax.Array:
    """``[[0, 1, ..., width - 1]]``: the position of each column, against per-example ``[B, 1]`` lengths."""
    return jnp.arange(width, dtype=jnp.int32)[None, :]


# Decoder tasks: ``prompt SEP answer EOS``, padded. Each returns (prompt [B, P], its lengths [B],
# answer [B, A], its lengths [B]) for the input strings' lengths ``n`` ([B]), at most ``width``.


def _with_word(task: DecoderTask, word: str, x: jax.Array, n: jax.Array):
    """The prompt of ``x``: ``x`` itself ("ours"), or the instruction word then ``x`` ("paper")."""
    if task.format == "ours":
        return x, n
    first = jnp.full((x.shape[0], 1), task._word(word), jnp.int32)
    return jnp.concatenate([first, x], axis=1), n + 1


def counting_copy(task: DecoderTask, key, n, width: int):
    """One symbol repeated n times; the answer is the same string."""
    s = jax.random.randint(key, (n.shape[0], 1), 0, task.symbols)
    x = jnp.broadcast_to(s, (n.shape[0], width))
    return (*_with_word(task, "copy", x, n), x, n)


def copy(task: DecoderTask, key, n, width: int):
    """n random symbols; the answer is the same string."""
    x = jax.random.randint(key, (n.shape[0], width), 0, task.symbols)
    return (*_with_word(task, "copy", x, n), x, n)


def reverse(task: DecoderTask, key, n, width: int):
    """n random symbols; the answer is the string reversed."""
    x = jax.random.randint(key, (n.shape[0], width), 0, task.symbols)
    y = _take(x, n[:, None] - 1 - _columns(width))
    return (*_with_word(task, "reverse", x, n), y, n)


def duplicate(task: DecoderTask, key, n, width: int):
    """n random symbols; the answer is ``x x`` ("ours") or ``x [NEXT] x`` ("paper")."""
    x = jax.random.randint(key, (n.shape[0], width), 0, task.symbols)
    k, m = _columns(2 * width + 1), n[:, None]
    if task.format == "ours":
        y, answer_length = _take(x, k % m), 2 * n
    else:
        y = jnp.where(k < m, _take(x, k), jnp.where(k == m, task._word("next"), _take(x, k - m - 1)))
        answer_length = 2 * n + 1
    return (*_with_word(task, "copy", x, n), y, answer_length)


def counting_replace(task: DecoderTask, key, n, width: int):
    """``s t s^n`` ("ours") or ``Replace s with t in s^n`` ("paper"), t any symbol but s; the answer is ``t^n``."""
    s_key, t_key = jax.random.split(key)
    rows = n.shape[0]
    s = jax.random.randint(s_key, (rows, 1), 0, task.symbols)
    t = (s + 1 + jax.random.randint(t_key, (rows, 1), 0, task.symbols - 1)) % task.symbols
    if task.format == "ours":
        head, head_length = jnp.concatenate([s, t], axis=1), 2
    else:
        words = [jnp.full((rows, 1), task._word(w), jnp.int32) for w in ("replace", "with", "in")]
        head, head_length = jnp.concatenate([words[0], s, words[1], t, words[2]], axis=1), 5
    prompt = jnp.concatenate([head, jnp.broadcast_to(s, (rows, width))], axis=1)
    return prompt, n + head_length, jnp.broadcast_to(t, (rows, width)), n


_DECODER_EXAMPLES = {
    "counting_copy": counting_copy,
    "counting_replace": counting_replace,
    "copy": copy,
    "duplicate": duplicate,
    "reverse": reverse,
}


def _decoder_batch(task: DecoderTask, key, lengths, batch_size: int) -> dict:
    """A training batch of a decoder task, as :meth:`DecoderTask.batch` lays it out with
    ``pad_to=task.max_tokens(lengths.train)``: ``prompt SEP y EOS`` then padding, the weights on
    predicting ``y`` and the end token."""
    length_key, example_key = jax.random.split(key)
    n = jax.random.randint(length_key, (batch_size,), lengths.train_min, lengths.train + 1)
    prompt, p, answer, a = _DECODER_EXAMPLES[task.name](task, example_key, n, lengths.train)
    total = task.max_tokens(lengths.train) + 1  # the tokens: inputs and the last target
    j, p, a = _columns(total), p[:, None], a[:, None]
    tokens = jnp.where(
        j < p,
        _take(prompt, j),
        jnp.where(
            j == p,
            task.sep,
            jnp.where(j <= p + a, _take(answer, j - p - 1), jnp.where(j == p + a + 1, task.eos, task.pad)),
        ),
    )
    i = _columns(total - 1)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": ((i >= p) & (i <= p + a)).astype(jnp.float32),  # input p is SEP: it predicts y[0]
        "positions": jnp.arange(total - 1, dtype=jnp.int32),
    }


# Encoder tasks: ``x`` then a blank per answer token, padded. Each returns (x [B, X], its
# lengths [B], answer [B, A], its lengths [B]) for the examples' lengths ``n``.


def reverse_string(task: EncoderTask, key, n, width: int):
    """n random symbols; the answer, on n blanks, is the string reversed."""
    x = jax.random.randint(key, (n.shape[0], width), 0, task.symbols)
    return x, n, _take(x, n[:, None] - 1 - _columns(width)), n


def bucket_sort(task: EncoderTask, key, n, width: int):
    """n random symbols; the answer, on n blanks, is the string sorted."""
    x = jax.random.randint(key, (n.shape[0], width), 0, task.symbols)
    return x, n, jnp.sort(jnp.where(_columns(width) < n[:, None], x, task.symbols), axis=1), n


def parity(task: EncoderTask, key, n, width: int):
    """n random bits; the answer, on one blank, is their sum modulo 2."""
    x = jax.random.randint(key, (n.shape[0], width), 0, 2)
    ones = jnp.where(_columns(width) < n[:, None], x, 0).sum(axis=1, keepdims=True)
    return x, n, ones % 2, jnp.ones_like(n)


def missing_duplicate(task: EncoderTask, key, n, width: int):
    """``w w`` of random bits with one token hidden (MARKER); the answer, on one blank, is the
    hidden token. "ours": ``|w| = ceil(n / 2)``; "paper": ``|w| = n // 2`` and an empty token
    after an odd n, and length 1 is the input ``1`` with the answer 1."""
    w_key, hide_key = jax.random.split(key)
    rows, k = n.shape[0], _columns(2 * half_length(width) + 1)
    half = jnp.maximum(1, (n + 1) // 2) if task.format == "ours" else n // 2
    w = jax.random.randint(w_key, (rows, half_length(width)), 0, 2)
    safe = jnp.maximum(half, 1)[:, None]  # (paper length 1 has no w)
    hidden = jax.random.randint(hide_key, (rows,), 0, jnp.maximum(2 * half, 1))[:, None]
    x = jnp.where(k < 2 * half[:, None], _take(w, k % safe), EMPTY)  # paper: EMPTY after an odd n
    x = jnp.where(k == hidden, MARKER, x)
    answer = _take(w, hidden % safe)
    if task.format == "ours":
        return x, 2 * half, answer, jnp.ones_like(n)
    single = (n == 1)[:, None]
    return jnp.where(single, 1, x), n, jnp.where(single, 1, answer), jnp.ones_like(n)


_ENCODER_EXAMPLES = {
    "reverse_string": reverse_string,
    "bucket_sort": bucket_sort,
    "parity": parity,
    "missing_duplicate": missing_duplicate,
}


def _encoder_batch(task: EncoderTask, key, lengths, batch_size: int) -> dict:
    """A training batch of an encoder task, as :meth:`EncoderTask.batch` lays it out with
    ``pad_to=task.max_tokens(lengths.train)``: ``x`` then blanks then padding, the targets the
    answer on the blanks (PAD elsewhere), the weights and the key mask on what is not padding."""
    length_key, example_key = jax.random.split(key)
    n = jax.random.randint(length_key, (batch_size,), lengths.train_min, lengths.train + 1)
    x, xn, y, yn = _ENCODER_EXAMPLES[task.name](task, example_key, n, lengths.train)
    total = task.max_tokens(lengths.train)
    j, xn, yn = _columns(total), xn[:, None], yn[:, None]
    on_blank = (j >= xn) & (j < xn + yn)
    return {
        "inputs": jnp.where(j < xn, _take(x, j), jnp.where(on_blank, BLANK, PAD)),
        "targets": jnp.where(on_blank, _take(y, j - xn), PAD),
        "weights": on_blank.astype(jnp.float32),
        "positions": jnp.arange(total, dtype=jnp.int32),
        "key_mask": j < xn + yn,
    }


def text_batch(train: jax.Array, key, batch_size: int, length: int) -> dict:
    """Windows of ``length`` characters (and the next one) at uniformly random places of ``train``,
    as :meth:`TextTask.batch` draws them."""
    starts = jax.random.randint(key, (batch_size, 1), 0, train.shape[0] - length - 1)
    windows = train[starts + _columns(length + 1)].astype(jnp.int32)
    return {
        "inputs": windows[:, :-1],
        "targets": windows[:, 1:],
        "weights": jnp.ones((batch_size, length), jnp.float32),
        "positions": jnp.arange(length, dtype=jnp.int32),
    }


@dataclasses.dataclass(frozen=True)
class DeviceBatches:
    """The training batches of one task on the device: ``make(data, key)`` is the batch of
    ``batch_size`` examples for ``key`` (jittable; ``data`` is :attr:`data`, the arrays it draws
    from, passed in rather than baked into the program). Hashable, so it can be a static argument
    of a jitted step.

    Example:
      >>> from posenc_jax.bench.presets import TaskLengths
      >>> from posenc_jax.bench.tasks import make_task
      >>> make = DeviceBatches(make_task("copy"), TaskLengths(train=4, eval=(8,), examples=1, batch=1), 3)
      >>> batch = make(make.data, step_key(seed_key(0), 0))
      >>> batch["inputs"].shape, batch["weights"].shape  # 4 + 1 + 4 tokens less the last
      ((3, 9), (3, 9))
    """

    task: object
    lengths: object  # TaskLengths: train, train_min
    batch_size: int

    def __post_init__(self):
        if not supports(self.task):
            raise ValueError(
                f"task {self.task.name!r} has no device generator (those of {', '.join(DEVICE_TASKS)} do); "
                "run it with batches='host'"
            )

    @property
    def data(self):
        """What ``make`` draws from: the text's train split (as bytes), or None."""
        if isinstance(self.task, TextTask):
            return jnp.asarray(np.asarray(self.task.train, np.uint8))
        return None

    def __call__(self, data, key) -> dict:
        if isinstance(self.task, TextTask):
            return text_batch(data, key, self.batch_size, self.lengths.train)
        if isinstance(self.task, EncoderTask):
            return _encoder_batch(self.task, key, self.lengths, self.batch_size)
        return _decoder_batch(self.task, key, self.lengths, self.batch_size)
