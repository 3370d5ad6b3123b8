"""Character n-gram baselines: hand-counted probabilities, normalisation, orders and smoothings compared, bad input."""

from fractions import Fraction

import numpy as np
import pytest

from posenc_jax.bench.ngram import SMOOTHINGS, NGramModel, best_ngram, ngram_baselines


def codes(text: str) -> np.ndarray:
    """'a' -> 0, 'b' -> 1, ...: tiny corpora written as strings."""
    return np.array([ord(ch) - ord("a") for ch in text], np.int32)


def probs(model: NGramModel, text: str) -> np.ndarray:
    return 2.0 ** model.log2_probs(codes(text))


def as_floats(fractions) -> np.ndarray:
    return np.array([float(f) for f in fractions])


def test_add_one_bigram_by_hand():
    # Train "abab", V = 3 (c never seen). Bigrams: ab twice, ba once. As histories, a is followed by something
    # twice and b once (the last b ends the text), so P(. | a) has denominator 2 + 3 and P(. | b) 1 + 3.
    # Position 0 has no history: unigram counts a 2, b 2, c 0 over N = 4, denominator 4 + 3.
    model = NGramModel.fit(codes("abab"), order=2, smoothing="add_one", vocab_size=3)
    expected = [
        Fraction(2 + 1, 4 + 3),  # a (position 0, unigram)
        Fraction(0 + 1, 2 + 3),  # a | a
        Fraction(2 + 1, 2 + 3),  # b | a
        Fraction(0 + 1, 1 + 3),  # b | b
        Fraction(1 + 1, 1 + 3),  # a | b
        Fraction(0 + 1, 2 + 3),  # c | a
        Fraction(1, 3),  # c | c: c never seen as a history, uniform
        Fraction(1, 3),  # b | c
    ]
    np.testing.assert_allclose(probs(model, "aabbaccb"), as_floats(expected), rtol=1e-12)


def test_add_one_unigram_by_hand():
    model = NGramModel.fit(codes("aab"), order=1, smoothing="add_one", vocab_size=3)
    expected = [Fraction(2 + 1, 3 + 3), Fraction(1 + 1, 3 + 3), Fraction(0 + 1, 3 + 3)]
    np.testing.assert_allclose(probs(model, "abc"), as_floats(expected), rtol=1e-12)


# Kneser-Ney on train "aaabcab", V = 4 (d never seen), D = 3/4.
#   Raw unigram counts: a 4, b 2, c 1, d 0; N = 7; 3 characters seen.
#   Bigrams (6): aa 2, ab 2, bc 1, ca 1. As raw histories: a followed 4 times by 2 types, b once (the final b
#   has no successor) by 1 type, c once by 1 type.
#   Unigram continuation counts N1+(. w): a after {a, c} = 2, b after {a} = 1, c after {b} = 1, d 0; sum 4,
#   3 types.
D = Fraction(3, 4)
UNIFORM = Fraction(1, 4)


def kneser_ney_unigrams() -> tuple[dict, dict]:
    """The continuation unigram level and the raw unigram level of the corpus above, by hand."""
    # Continuation level: (N1+(. w) - D) / 4 + D * 3 / 4 * 1/4 (d: only the share of the uniform floor).
    p1 = {
        "a": (2 - D) / 4 + D * 3 / 4 * UNIFORM,
        "b": (1 - D) / 4 + D * 3 / 4 * UNIFORM,
        "c": (1 - D) / 4 + D * 3 / 4 * UNIFORM,
        "d": D * 3 / 4 * UNIFORM,
    }
    assert p1 == {"a": Fraction(29, 64), "b": Fraction(13, 64), "c": Fraction(13, 64), "d": Fraction(9, 64)}
    # Raw level (position 0, or an order-1 model): (count(w) - D) / 7 + D * 3 / 7 * 1/4.
    raw = {
        "a": (4 - D) / 7 + D * 3 / 7 * UNIFORM,
        "b": (2 - D) / 7 + D * 3 / 7 * UNIFORM,
        "c": (1 - D) / 7 + D * 3 / 7 * UNIFORM,
        "d": D * 3 / 7 * UNIFORM,
    }
    assert raw == {"a": Fraction(61, 112), "b": Fraction(29, 112), "c": Fraction(13, 112), "d": Fraction(9, 112)}
    return p1, raw


def test_kneser_ney_unigram_by_hand():
    _, raw_unigram = kneser_ney_unigrams()
    model = NGramModel.fit(codes("aaabcab"), order=1, vocab_size=4, discount=0.75)
    np.testing.assert_allclose(probs(model, "abcd"), as_floats(raw_unigram[ch] for ch in "abcd"), rtol=1e-12)


def test_kneser_ney_bigram_by_hand():
    p1, raw_unigram = kneser_ney_unigrams()
    model = NGramModel.fit(codes("aaabcab"), order=2, smoothing="kneser_ney", vocab_size=4, discount=0.75)
    expected = [
        raw_unigram["a"],  # position 0: the order-1 model
        (2 - D) / 4 + D * 2 / 4 * p1["a"],  # a | a = 247/512
        (2 - D) / 4 + D * 2 / 4 * p1["b"],  # b | a = 199/512
        (1 - D) / 1 + D * 1 / 1 * p1["c"],  # c | b = 103/256
        0 + D * 1 / 1 * p1["d"],  # d | c = 27/256 (cd never seen)
        p1["a"],  # a | d: history d never seen, back off entirely = 29/64
    ]
    assert expected[1:5] == [Fraction(247, 512), Fraction(199, 512), Fraction(103, 256), Fraction(27, 256)]
    np.testing.assert_allclose(probs(model, "aabcda"), as_floats(expected), rtol=1e-12)


def test_kneser_ney_trigram_by_hand():
    p1, raw_unigram = kneser_ney_unigrams()
    # Trigrams (5), each once: aaa, aab, abc, bca, cab.
    # Bigram continuation counts N1+(. x y) (distinct trigrams ending in xy): aa 1, ab 2 (aab, cab), bc 1, ca 1.
    # As continuation histories: a totals 1 + 2 = 3 over 2 types; b 1 over 1; c 1 over 1.
    p2 = {
        "b|a": (2 - D) / 3 + D * 2 / 3 * p1["b"],  # 199/384
        "d|a": D * 2 / 3 * p1["d"],  # 27/384
        "c|b": (1 - D) / 1 + D * 1 / 1 * p1["c"],  # 103/256
        "a|c": (1 - D) / 1 + D * 1 / 1 * p1["a"],  # 151/256
    }
    model = NGramModel.fit(codes("aaabcab"), order=3, vocab_size=4)
    expected = [
        raw_unigram["a"],  # position 0: order-1 model
        (2 - D) / 4 + D * 2 / 4 * p1["a"],  # position 1: order-2 model, raw bigrams, a | a
        (1 - D) / 2 + D * 2 / 2 * p2["b|a"],  # b | aa: raw trigrams aaa, aab = 263/512
        (1 - D) / 1 + D * 1 / 1 * p2["c|b"],  # c | ab: abc = 565/1024
        (1 - D) / 1 + D * 1 / 1 * p2["a|c"],  # a | bc: bca = 709/1024
        0 + D * 1 / 1 * p2["d|a"],  # d | ca: cab only = 27/512
    ]
    assert expected[2:] == [Fraction(263, 512), Fraction(565, 1024), Fraction(709, 1024), Fraction(27, 512)]
    np.testing.assert_allclose(probs(model, "aabcad"), as_floats(expected), rtol=1e-12)


@pytest.mark.parametrize("smoothing", ["add_one", "kneser_ney"])
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_probabilities_sum_to_one(order, smoothing):
    vocab_size = 7
    rng = np.random.default_rng(order)
    # Symbols 0..4 only, so 5 and 6 are never seen and some histories below are unseen.
    train = np.concatenate([np.tile([0, 1, 2, 3], 10), rng.integers(0, 5, 200)])
    model = NGramModel.fit(train, order, smoothing, vocab_size=vocab_size, discount=0.6)
    histories = [[], [0], [1, 2], [0, 1, 2], [2, 3, 0, 1, 2], [5], [6, 5, 6], [0, 6, 1], train[-3:].tolist()]
    for history in histories:
        texts = np.array([history + [c] for c in range(vocab_size)])
        distribution = np.array([2.0 ** model.log2_probs(text)[-1] for text in texts])
        assert np.all(distribution > 0), (history, distribution)
        np.testing.assert_allclose(distribution.sum(), 1.0, rtol=1e-12, err_msg=f"history {history}")


def test_higher_orders_and_kneser_ney_win_on_structured_text():
    rng = np.random.default_rng(0)
    # A random string of 50 characters over 4 symbols, repeated: each longer history pins down the next
    # character more often (4**4 = 256 histories of 4, against 50 positions, still collide now and then).
    text = np.tile(rng.integers(0, 4, 50), 200)
    train, test = text[:8000], text[8000:]
    baselines = ngram_baselines(train, test, orders=(1, 2, 3, 4, 5), vocab_size=4)
    bpc = {(entry["order"], entry["smoothing"]): entry["bits_per_char"] for entry in baselines}
    assert len(baselines) == 10 and all(set(entry) == {"order", "smoothing", "bits_per_char"} for entry in baselines)
    for smoothing in ("add_one", "kneser_ney"):
        by_order = [bpc[order, smoothing] for order in (1, 2, 3, 4, 5)]
        assert all(a > b for a, b in zip(by_order, by_order[1:], strict=False)), (smoothing, by_order)
    assert bpc[5, "kneser_ney"] < bpc[5, "add_one"]
    assert best_ngram(baselines) == {"order": 5, "smoothing": "kneser_ney", "bits_per_char": bpc[5, "kneser_ney"]}
    # The shared counts of ngram_baselines give what a model fitted on its own gives.
    alone = NGramModel.fit(train, 3, "kneser_ney", vocab_size=4).bits_per_char(test)
    assert alone == pytest.approx(bpc[3, "kneser_ney"], rel=1e-12)
    # With the text task's 128 codes add-one spreads far more mass over characters never seen.
    wide = {smoothing: NGramModel.fit(train, 5, smoothing).bits_per_char(test) for smoothing in SMOOTHINGS}
    assert wide["kneser_ney"] < wide["add_one"] / 2, wide


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"order": 0}, r"order must be an integer >= 1.*got 0"),
        ({"order": 2.5}, r"order must be an integer >= 1.*got 2.5"),
        ({"order": 10}, r"order 10 with vocab_size 128.*use order <= 9"),
        ({"smoothing": "witten_bell"}, r"unknown smoothing 'witten_bell'; use one of \('add_one', 'kneser_ney'\)"),
        ({"discount": 0.0}, r"discount must lie strictly between 0 and 1, got 0.0"),
        ({"discount": 1.0}, r"discount must lie strictly between 0 and 1, got 1.0"),
        ({"train": np.array([1, 2, 128])}, r"outside \[0, 128\): train\[2\] = 128.*larger vocab_size"),
        ({"train": np.array([3, -1])}, r"train holds values outside \[0, 128\): train\[1\] = -1"),
        ({"train": np.array([0, 1, 2]), "vocab_size": 2}, r"outside \[0, 2\)"),
        ({"train": np.zeros(0, np.int32)}, r"train is empty"),
        ({"train": np.array([0.0, 1.0])}, r"train must hold integer character codes"),
        ({"train": np.zeros((2, 3), np.int32)}, r"train must be a 1-D array.*shape \(2, 3\)"),
        ({"vocab_size": 0}, r"vocab_size must be a positive integer, got 0"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"train": np.array([0, 1, 2, 3]), "order": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        NGramModel.fit(**args)


def test_bad_test_text_and_baseline_lists():
    model = NGramModel.fit(np.array([0, 1, 2]), 2)
    with pytest.raises(ValueError, match=r"text holds values outside \[0, 128\): text\[0\] = 200"):
        model.log2_probs(np.array([200]))
    assert model.log2_probs(np.zeros(0, np.int32)).shape == (0,)
    with pytest.raises(ValueError, match="text is empty"):
        model.bits_per_char(np.zeros(0, np.int32))
    with pytest.raises(ValueError, match=r"test holds values outside"):
        ngram_baselines(np.array([0, 1]), np.array([0, 300]))
    with pytest.raises(ValueError, match="unknown smoothing 'good_turing'"):
        ngram_baselines(np.array([0, 1]), np.array([0, 1]), smoothings=("good_turing",))
    with pytest.raises(ValueError, match="baselines is empty"):
        best_ngram([])
