"""Count-based character n-gram language models: the text task's baseline in bits per character.

A text is a 1-D array of integer codes in ``[0, V)`` (bytes below 128 for the text task, so
``V = 128``). An order-``n`` model predicts each character ``c`` from its history ``h``, the
``n - 1`` characters before it. Two smoothings are offered.

**Add-one (Laplace).** Every continuation gets one imaginary extra sighting::

    P(c | h) = (count(h c) + 1) / (count(h .) + V)

where ``count(h c)`` is how often the n-gram ``h c`` occurs in the training text and
``count(h .) = sum over c of count(h c)`` is how often ``h`` occurs *followed by a character*
(one less than its plain count when the training text ends with ``h``; that is what makes
the distribution sum to one). Order 1 has the empty history: ``(count(c) + 1) / (N + V)``
with ``N`` the training length. A history never seen gives the uniform ``1 / V``.

**Interpolated Kneser-Ney** (Chen & Goodman 1998, one absolute discount ``0 < D < 1``).
Each level takes ``D`` off every count it has seen and hands the mass so freed to the level
below, which conditions on one character less (``h'`` is ``h`` without its first
character)::

    P_k(c | h) = max(a(h c) - D, 0) / a(h .)  +  D * T(h) / a(h .) * P_{k-1}(c | h')

Here ``a(h .)`` is the sum of ``a(h c)`` over ``c`` and ``T(h)`` is the number of distinct
``c`` with ``a(h c) > 0``. The bottom of the recursion, below the unigram level, is the
uniform ``P_0(c) = 1 / V``, so a character never seen in training still has some
probability. The counts ``a`` differ by level:

* at the model's own (highest) order they are the raw counts ``count(h c)``;
* at every lower order they are continuation counts, ``N1+(. h c)``: the number of
  distinct characters seen immediately before ``h c``. A character that is frequent only
  because it always follows one particular context (``"t"`` after ``"ne"`` in ``"net"``,
  say) then gets little weight as a fallback, where raw frequency would overrate it.

Where ``a(h .) = 0`` (a history never seen, or seen only at the end of the training text)
the level passes ``P_{k-1}(c | h')`` through unchanged: it backs off entirely. Order 1 is
the discounted unigram over raw counts interpolated with the uniform floor. Each level sums
to one over the ``V`` characters because the ``D`` taken from each of the ``T(h)`` seen
characters is exactly the weight given to the lower level.

**Scoring.** :meth:`NGramModel.log2_probs` scores every position ``t`` of a text, the first
included: position ``t`` sees the ``min(t, n - 1)`` characters before it, and is scored by
the model of order ``min(t + 1, n)`` fitted on the same counts (for Kneser-Ney that model's
highest level uses raw counts, as above). Bits per character is the mean of
``-log2 P`` over those positions.

**Counting.** An m-gram is stored as one int64, its characters as base-``V`` digits (the
first most significant), so counting is ``np.unique`` over an array of codes and every
look-up is ``np.searchsorted``; nothing loops over characters. Dropping the last digit
(``code // V``) gives the history, dropping the first (``code % V**(m-1)``) the suffix.
``V**order`` must fit in an int64 (order up to 9 for ``V = 128``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["NGramModel", "best_ngram", "ngram_baselines"]

SMOOTHINGS = ("add_one", "kneser_ney")


def _max_order(vocab_size: int) -> int:
    """The longest n-gram whose base-V code fits in an int64 (every order fits when V is 1)."""
    if vocab_size == 1:
        return np.iinfo(np.int64).max
    order = 0
    while vocab_size ** (order + 1) <= 2**63:
        order += 1
    return order


def _check_settings(order, smoothing: str, vocab_size, discount) -> None:
    if not isinstance(vocab_size, int | np.integer) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}; pass e.g. vocab_size=128")
    if not isinstance(order, int | np.integer) or order < 1:
        raise ValueError(f"order must be an integer >= 1 (1 is the unigram model), got {order!r}")
    if order > _max_order(vocab_size):
        raise ValueError(
            f"order {order} with vocab_size {vocab_size} makes n-gram codes too large for int64; "
            f"use order <= {_max_order(vocab_size)}"
        )
    if smoothing not in SMOOTHINGS:
        raise ValueError(f"unknown smoothing {smoothing!r}; use one of {SMOOTHINGS}")
    if not 0 < discount < 1:
        raise ValueError(f"discount must lie strictly between 0 and 1, got {discount!r}; the usual choice is 0.75")


def _as_text(text, vocab_size: int, name: str) -> np.ndarray:
    """The text as int64 codes, or a ValueError saying what is wrong with it and how to fix it."""
    array = np.asarray(text)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of character codes, got shape {array.shape}; flatten it first")
    if array.size == 0:
        # An empty array of any dtype is an empty text.
        return np.zeros(0, np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{name} must hold integer character codes, got dtype {array.dtype}; "
            f"encode it first (e.g. np.frombuffer(s.encode('ascii'), np.uint8))"
        )
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        raise ValueError(
            f"{name} holds values outside [0, {vocab_size}): {name}[{bad[0]}] = {array[bad[0]]} "
            f"({bad.size} such values, range {array.min()}..{array.max()}); "
            f"map characters to codes below vocab_size or pass a larger vocab_size"
        )
    return array.astype(np.int64)


def _gram_codes(text: np.ndarray, length: int, vocab_size: int) -> np.ndarray:
    """Codes of the ``length``-grams of ``text``; entry i is the gram that ends at position ``i + length - 1``."""
    count = len(text) - length + 1
    codes = np.zeros(max(count, 0), np.int64)
    if count <= 0:
        return codes
    for j in range(length):
        codes = codes * vocab_size + text[j : j + count]
    return codes


def _lookup(keys: np.ndarray, values: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """``values`` at the positions of ``queries`` in the sorted ``keys``, 0 for queries absent from them."""
    if len(keys) == 0:
        return np.zeros(len(queries), values.dtype)
    at = np.minimum(np.searchsorted(keys, queries), len(keys) - 1)
    return np.where(keys[at] == queries, values[at], 0)


class _Table:
    """Counts ``a(h c)`` of the distinct m-grams (raw or continuation), with each history's total and type count.

    ``codes`` is sorted (it comes from ``np.unique``), so the grams sharing a history are
    contiguous and their totals are one ``np.add.reduceat``.
    """

    def __init__(self, codes: np.ndarray, counts: np.ndarray, vocab_size: int):
        self.codes = codes
        self.counts = counts
        self.vocab_size = vocab_size
        self.histories, starts = np.unique(codes // vocab_size, return_index=True)
        self.history_totals = np.add.reduceat(counts, starts) if len(codes) else np.zeros(0, np.int64)
        self.history_types = np.diff(np.append(starts, len(codes)))

    def count(self, grams: np.ndarray) -> np.ndarray:
        return _lookup(self.codes, self.counts, grams)

    def history_total_and_types(self, grams: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        histories = grams // self.vocab_size
        return _lookup(self.histories, self.history_totals, histories), _lookup(
            self.histories, self.history_types, histories
        )


class _Counts:
    """Raw and continuation count tables of one training text for every gram length up to ``max_order``.

    Shared by models of different orders and smoothings (:func:`ngram_baselines` counts once).
    Continuation tables are made on first use, since add-one never needs them.
    """

    def __init__(self, train: np.ndarray, max_order: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.max_order = max_order
        self.raw = {}
        for length in range(1, max_order + 1):
            codes, counts = np.unique(_gram_codes(train, length, vocab_size), return_counts=True)
            self.raw[length] = _Table(codes, counts.astype(np.int64), vocab_size)
        self._continuation = {}

    def continuation(self, length: int) -> _Table:
        """``N1+(. g)`` for every ``length``-gram g: how many distinct (length+1)-grams end in g."""
        if length not in self._continuation:
            # Each distinct longer gram contributes one distinct left neighbour to its suffix.
            suffixes = self.raw[length + 1].codes % self.vocab_size**length
            codes, counts = np.unique(suffixes, return_counts=True)
            self._continuation[length] = _Table(codes, counts.astype(np.int64), self.vocab_size)
        return self._continuation[length]


class NGramModel:
    """A character n-gram model with add-one or interpolated Kneser-Ney smoothing (see the module docstring).

    Make one with :meth:`fit`. Attributes: ``order``, ``smoothing``, ``vocab_size``, ``discount``.
    """

    def __init__(self, counts: _Counts, order: int, smoothing: str, discount: float):
        # Private: fit() validates and counts; ngram_baselines shares one _Counts across models.
        self._counts = counts
        self.order = int(order)
        self.smoothing = smoothing
        self.vocab_size = counts.vocab_size
        self.discount = float(discount)

    @classmethod
    def fit(
        cls,
        train: np.ndarray,
        order: int,
        smoothing: str = "kneser_ney",
        vocab_size: int = 128,
        discount: float = 0.75,
    ) -> NGramModel:
        """Counts the n-grams of ``train`` (1-D integer codes in ``[0, vocab_size)``).

        Args:
          train: the training text.
          order: n, the gram length; the history is the ``order - 1`` characters before.
          smoothing: ``"add_one"`` or ``"kneser_ney"``.
          vocab_size: V, the number of possible characters.
          discount: D of Kneser-Ney, in (0, 1); checked for either smoothing, used only by Kneser-Ney.
        """
        _check_settings(order, smoothing, vocab_size, discount)
        train = _as_text(train, vocab_size, "train")
        if len(train) == 0:
            raise ValueError("train is empty; fit on a text of at least one character")
        return cls(_Counts(train, order, vocab_size), order, smoothing, discount)

    def __repr__(self) -> str:
        return (
            f"NGramModel(order={self.order}, smoothing={self.smoothing!r}, "
            f"vocab_size={self.vocab_size}, discount={self.discount})"
        )

    def log2_probs(self, text: np.ndarray) -> np.ndarray:
        """``log2 P(text[t] | text[max(0, t - order + 1):t])`` for every position t, shape ``[len(text)]``."""
        text = _as_text(text, self.vocab_size, "text")
        probs = self._add_one(text) if self.smoothing == "add_one" else self._kneser_ney(text)
        return np.log2(probs)

    def bits_per_char(self, text: np.ndarray) -> float:
        """Mean of ``-log2 P`` over every position of ``text``."""
        log2_probs = self.log2_probs(text)
        if log2_probs.size == 0:
            raise ValueError("text is empty; bits per character needs at least one character to score")
        return float(-log2_probs.mean())

    def _add_one(self, text: np.ndarray) -> np.ndarray:
        probs = np.empty(len(text))
        for length in range(1, self.order + 1):
            grams = _gram_codes(text, length, self.vocab_size)
            # Position length-1 is the one whose whole history is length-1 characters long (the start of
            # the text); at the model's own order every later position is too.
            if length < self.order:
                grams = grams[:1]
            table = self._counts.raw[length]
            total, _ = table.history_total_and_types(grams)
            probs[length - 1 : length - 1 + len(grams)] = (table.count(grams) + 1) / (total + self.vocab_size)
        return probs

    def _kneser_ney(self, text: np.ndarray) -> np.ndarray:
        # Levels are built bottom up; after level m, probs[t] for t >= m - 1 holds P_m. Position m - 1 has only
        # m - 1 characters before it, so level m is its highest (raw counts) and it is final; later positions
        # use continuation counts at this level and go on to the next.
        probs = np.full(len(text), 1.0 / self.vocab_size)
        for length in range(1, self.order + 1):
            grams = _gram_codes(text, length, self.vocab_size)
            lower = probs[length - 1 :]
            if length == self.order:
                lower[:] = self._interpolate(self._counts.raw[length], grams, lower)
            elif len(grams):
                lower[:1] = self._interpolate(self._counts.raw[length], grams[:1], lower[:1])
                lower[1:] = self._interpolate(self._counts.continuation(length), grams[1:], lower[1:])
        return probs

    def _interpolate(self, table: _Table, grams: np.ndarray, lower: np.ndarray) -> np.ndarray:
        """One Kneser-Ney level: discounted counts plus the freed mass spread by ``lower``, or ``lower`` if unseen."""
        count = table.count(grams)
        total, types = table.history_total_and_types(grams)
        seen = total > 0
        # np.maximum(total, 1) only keeps the division quiet where np.where discards it.
        interpolated = (np.maximum(count - self.discount, 0.0) + self.discount * types * lower) / np.maximum(total, 1)
        return np.where(seen, interpolated, lower)


def ngram_baselines(
    train: np.ndarray,
    test: np.ndarray,
    orders=(1, 2, 3, 4, 5),
    smoothings=("add_one", "kneser_ney"),
    vocab_size: int = 128,
) -> list[dict]:
    """Bits per character on ``test`` of an n-gram model fitted on ``train``, for each order and smoothing.

    Counts ``train`` once for the longest order and fits every model from those counts.

    Returns:
      One dict ``{"order", "smoothing", "bits_per_char"}`` per (order, smoothing), orders outermost.
    """
    orders, smoothings = tuple(orders), tuple(smoothings)
    if not orders or not smoothings:
        raise ValueError(f"orders and smoothings must be non-empty, got orders={orders}, smoothings={smoothings}")
    for order in orders:
        for smoothing in smoothings:
            _check_settings(order, smoothing, vocab_size, 0.75)
    train = _as_text(train, vocab_size, "train")
    if len(train) == 0:
        raise ValueError("train is empty; fit on a text of at least one character")
    test = _as_text(test, vocab_size, "test")
    counts = _Counts(train, max(orders), vocab_size)
    return [
        {
            "order": int(order),
            "smoothing": smoothing,
            "bits_per_char": NGramModel(counts, order, smoothing, 0.75).bits_per_char(test),
        }
        for order in orders
        for smoothing in smoothings
    ]


def best_ngram(baselines: list[dict]) -> dict:
    """The entry of :func:`ngram_baselines`'s list with the lowest bits per character."""
    if not baselines:
        raise ValueError("baselines is empty; pass the list ngram_baselines returns")
    return min(baselines, key=lambda entry: entry["bits_per_char"])
