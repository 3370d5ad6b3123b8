"""Character-level language modelling on real text, scored in bits per character (the task ``text``).

The length of an example is its context, in characters; the corpus is one of
:mod:`posenc_jax.bench.tasks.corpus`.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import warnings

import numpy as np

from posenc_jax.bench.tasks.base import register_task
from posenc_jax.bench.tasks.corpus import HUB_CORPORA, read_corpus, stdlib_corpus

__all__ = ["TextTask"]


class TextTask:
    """Character-level language modelling; bytes as tokens, scored in bits per character.

    Trains on windows of exactly the training context at random places of the train split, and
    evaluates each length on fixed windows of the test split (:meth:`window_starts`). The corpus
    is read when first used (so a task can be named, and its kind asked, where the corpus cannot
    be read); :attr:`sha256` identifies it, and a run refuses a corpus whose hash is not its
    preset's ``text_corpus_sha256``.

    Args:
      corpus: None for the pinned standard-library corpus (:func:`stdlib_corpus`); a text file
        (first 90% train, last 10% test) or folder (its files in path order, the last tenth of
        them test), read as UTF-8 strictly (another encoding, a NUL byte or an empty corpus is
        an error naming the file and the byte); or ``wikitext103`` / ``tinyshakespeare``
        (:func:`load_hub_corpus`).
    """

    kind = "decoder"
    metric = "bits_per_char"
    higher_is_better = False
    vocab_size = 128
    scored_on = "target_log_probs"
    length_family = "text"
    fixed_eval_shape = False

    def __init__(self, corpus: str | None = None):
        self.name = "text"
        self.corpus = corpus
        if corpus is None:
            self.corpus_description = "Python source: the 78 standard-library files pinned by SHA-256 (stdlib_corpus)"
        elif corpus in HUB_CORPORA:
            self.corpus_description = f"{corpus} (its train and test splits, from the Hugging Face hub)"
        elif pathlib.Path(corpus).exists():
            self.corpus_description = f"{corpus} (first 90% train, last 10% test)"
        else:
            raise ValueError(f"--corpus {corpus} is neither a file nor a folder")

    @functools.cached_property
    def _splits(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.corpus is None:
            train, test, _ = stdlib_corpus()
        else:
            train, test = read_corpus(self.corpus)
            self._warn_outside_ascii(train + test)
        train = self._encode(train)
        # The last twentieth of the train split is held out: training checks its progress there.
        cut = len(train) - len(train) // 20
        return train[:cut], train[cut:], self._encode(test)

    @property
    def train(self) -> np.ndarray:
        """The characters training windows are drawn from."""
        return self._splits[0]

    @property
    def validation(self) -> np.ndarray:
        """The last twentieth of the train split, held out for training's checks."""
        return self._splits[1]

    @property
    def test(self) -> np.ndarray:
        """The characters every evaluation length is scored on."""
        return self._splits[2]

    @functools.cached_property
    def sha256(self) -> str:
        """The SHA-256 of the corpus as the model sees it: each split's name, length and characters.

        The presets pin the standard-library corpus's (:data:`STDLIB_CORPUS_SHA256`).
        """
        sha = hashlib.sha256()
        for name, data in (("train", self.train), ("validation", self.validation), ("test", self.test)):
            sha.update(f"{name} {len(data)}\n".encode())
            sha.update(data.astype(np.uint8).tobytes())
        return sha.hexdigest()

    @property
    def digest(self) -> str:
        """The first 12 hexadecimal digits of :attr:`sha256` (results of different texts never mix)."""
        return self.sha256[:12]

    def _warn_outside_ascii(self, text: str) -> None:
        """Says how many characters the model will read as ``?``: its vocabulary is the 128 ASCII
        characters, so any other character is one token, ``?``, wherever it occurs."""
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        outside = int((codes > 127).sum())
        if outside:
            examples = "".join(sorted({chr(c) for c in codes[codes > 127][:1000]})[:10])
            warnings.warn(
                f"--corpus {self.corpus}: {outside:,} of its {len(codes):,} characters ({outside / len(codes):.2%}) "
                f"are not ASCII (for example {examples!r}) and are read as '?', the model's vocabulary being the "
                "128 ASCII characters; transliterate the text first if those characters matter",
                stacklevel=3,
            )

    @staticmethod
    def _encode(text: str) -> np.ndarray:
        data = np.frombuffer(text.encode("ascii", errors="replace"), np.uint8).astype(np.int32)
        return np.minimum(data, 127)

    def max_tokens(self, n: int) -> int:
        return n

    def train_lengths(
        self, rng: np.random.Generator, train_length: int, batch_size: int, minimum: int = 1
    ) -> np.ndarray:
        """Every window is the training context (``minimum`` does not apply)."""
        return np.full(batch_size, train_length)

    def chance(self, n: int) -> float | None:
        """None: uniform guessing (7 bits per character) is no useful line on a text plot."""
        return None

    def baselines(self, n: int) -> list[dict]:
        """Count-based n-gram models (orders 1 to 5, add-one and Kneser-Ney smoothing) fitted on the
        train split and scored in bits per character on the ``n`` test characters every length
        scores (:func:`posenc_jax.bench.baselines.text_baselines`): one dict per model, ``order``,
        ``smoothing`` and ``bits_per_char``."""
        from posenc_jax.bench.baselines import text_baselines

        return text_baselines(self, n)

    def check_lengths(self, train_length: int, eval_lengths) -> None:
        """The train split must hold a window of the training context and the test split one of
        the longest evaluation length (each plus the next character to predict)."""
        splits = (
            ("train", self.train, train_length),
            ("validation", self.validation, train_length),
            ("test", self.test, max(eval_lengths)),
        )
        for split, data, length in splits:
            if len(data) < length + 2:
                raise ValueError(
                    f"the {split} split of the text corpus ({self.corpus_description}) has {len(data)} characters, "
                    f"too few for windows of {length}; pass a larger --corpus, or shorter lengths "
                    f"(--text-context, --text-lengths)"
                )

    def window_starts(self, length: int, characters: int) -> np.ndarray:
        """Where the test windows of ``length`` begin: ``0, length, 2 * length, ...``, below ``characters``.

        The windows are a function of the test split and the length alone: the i-th window of
        ``length`` is always ``test[i * length : (i + 1) * length + 1]`` (its inputs, and the next
        character as the last target), whatever the encoding, seed, run or preset. ``characters`` (a
        preset's ``text_eval_characters``, a multiple of ``length``) says how many are scored, so a
        preset that scores fewer characters scores the first of the same windows. Non-overlapping
        windows from the start of the test split (Press et al. 2022's evaluation) score the same
        characters at every length.

        Example:
          >>> TextTask().window_starts(4096, 16_384).tolist()
          [0, 4096, 8192, 12288]
        """
        if length < 1 or characters % length or len(self.test) < characters + 1:
            raise ValueError(
                f"cannot score {characters} test characters in windows of {length}: need a multiple of the length "
                f"and a test split longer than that ({len(self.test)} characters)"
            )
        return np.arange(0, characters, length)

    def evaluation_windows(self, length: int, characters: int, batch: int):
        """The test batches of one evaluation length: the windows of :meth:`window_starts`,
        ``batch`` at a time."""
        starts = self.window_starts(length, characters)
        for first in range(0, len(starts), batch):
            yield self.windows_at("test", starts[first : first + batch], length)

    def batch(self, rng: np.random.Generator, lengths, *, split: str = "train", pad_to: int | None = None) -> dict:
        """Windows at random places of ``split`` (``"train"``, ``"validation"`` or ``"test"``)."""
        data = {"train": self.train, "validation": self.validation, "test": self.test}[split]
        length = int(max(lengths))
        if len(data) < length + 2:
            raise ValueError(f"the {split} text has {len(data)} characters, too few for windows of {length}")
        return self.windows_at(split, rng.integers(0, len(data) - length - 1, len(lengths)), length)

    def windows_at(self, split: str, starts, length: int) -> dict:
        """The windows of ``length`` characters (and the character after each) starting at ``starts`` of ``split``."""
        data = {"train": self.train, "validation": self.validation, "test": self.test}[split]
        windows = np.stack([data[s : s + length + 1] for s in starts])
        return {
            "inputs": windows[:, :-1],
            "targets": windows[:, 1:],
            "weights": np.ones((len(starts), length), np.float32),
            "positions": np.arange(length, dtype=np.int32),
        }

    def score(self, log_probs_of_targets: np.ndarray, batch: dict) -> np.ndarray:
        """Bits per character per window, from the targets' log-probabilities (nats)."""
        w = batch["weights"]
        return -(log_probs_of_targets * w).sum(-1) / np.maximum(w.sum(-1), 1) / np.log(2.0)


register_task(
    "text",
    lambda corpus=None, **settings: TextTask(corpus),
    "Character-level language modelling (decoder)",
    short="text, bits/char",
    unit="characters",
)
