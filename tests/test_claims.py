"""The claims page is its declared tests on the committed rows, and the tests mean what they say."""

import importlib.util
import pathlib
import sys

import pytest
from bench_folders import write_folder

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def claims(monkeypatch):
    spec = importlib.util.spec_from_file_location("claims", ROOT / "benchmarks" / "claims.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "claims", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_claims_page_is_its_tests_on_the_committed_rows(claims):
    committed = (ROOT / "docs" / "site" / "claims.md").read_text()
    assert committed == claims.render(claims.CLAIMS), "run `python benchmarks/claims.py` and commit the page"


def test_a_claim_holds_is_contradicted_or_stays_unresolved_on_its_corrected_tests(claims, tmp_path, monkeypatch):
    write_folder(
        tmp_path / "run",
        {
            "a": {s: (1.0, 0.80 + 0.01 * s) for s in range(5)},
            "b": {s: (1.0, 0.50 + 0.02 * s) for s in range(5)},
            "c": {s: (1.0, [0.30, 0.90, 0.50, 0.70, 0.10][s]) for s in range(5)},
            "d": {s: (0.2, 0.9) for s in range(5)},  # not learned
            "e": {s: (1.0, 0.80 + 0.01 * s + [0.001, -0.002, 0.0, 0.002, -0.001][s]) for s in range(5)},
        },
    )
    write_folder(tmp_path / "other", {"a": {s: (1.0, 0.5) for s in range(5)}})
    monkeypatch.setattr(claims, "DOCS", tmp_path)
    claims._read.cache_clear()
    claims._summaries.cache_clear()

    def test(kind, a, b):
        return claims.Test(kind, claims.Value("run", "copy", a), claims.Value("run", "copy", b))

    claim = claims.Claim(
        "x",
        "y",
        (
            test("above", "a", "b"),  # 0.3 on every seed, give or take: holds
            test("above", "b", "a"),  # the reverse: contradicted
            test("above", "a", "c"),  # wide spread: unresolved
            test("above", "a", "d"),  # d did not learn: left out of the family
            test("tie", "a", "e"),  # within 0.002 of each other on every seed: equivalent within 0.02
            test("no-worse", "c", "a"),  # c worse on average, too noisy to say by how much
        ),
    )
    outcomes = claims.evaluate(claim)
    assert [o.result for o in outcomes] == [
        "holds",
        "contradicted",
        "unresolved",
        "not comparable (d not learned)",
        "holds",
        "unresolved",
    ]
    # Holm over the 2 x 5 one-sided tests of the comparable ones: each corrected p at least its raw p.
    for o in outcomes:
        if o.comparable:
            assert o.corrected_claim >= o.p_claim and o.corrected_contrary >= o.p_contrary
    assert claims.verdict(claim, outcomes) == (
        "partly: 2 holds, 1 contradicted, 2 unresolved; contradicted: b > a (copy) (1 of 6 tests not comparable)"
    )
    assert claims.verdict(claim, outcomes[:1]) == "agrees"
    assert claims.verdict(claims.Claim("x", "y", not_comparable="another protocol"), []) == (
        "not comparable: another protocol"
    )
    with pytest.raises(ValueError, match="one run"):
        claims.Test("above", claims.Value("run", "copy", "a"), claims.Value("other", "copy", "a"))


@pytest.mark.parametrize("page", ["README.md", "docs/site/reproductions.md"])
def test_the_pages_verdicts_are_the_claims_corrected_tests(claims, page):
    text = (ROOT / page).read_text()
    shown = 0
    for claim in claims.CLAIMS:
        prefix = f"| {claim.source}: {claim.claim} | "
        rows = [line for line in text.splitlines() if line.startswith(prefix)]
        assert len(rows) == 1, (page, claim.source)
        assert rows[0] == prefix + claims.verdict(claim, claims.evaluate(claim)) + " |", (page, claim.source)
        shown += 1
    assert shown == len(claims.CLAIMS) == 11
