"""Runs Flax's own attention tests with posenc_jax's attention function as Flax's default.

Flax's source distribution on the package index ships its tests; this downloads the one of the
installed Flax version (``pip download --no-binary :all: --no-deps flax==<version>``), takes
``tests/nnx/nn/attention_test.py`` and ``tests/linen/linen_attention_test.py`` from it, and runs
them with pytest and the plugin ``tools/flax_suite/posenc_swap.py``, which makes
``posenc_jax.nn.make_attention_fn(encoding)`` the default attention function everywhere Flax
keeps one (Flax's own then raises if called). Nothing of Flax's is copied into this repository.

Runs:
  nope  every test, posenc_jax's attention with no encoding (NoPE), which must give Flax's
        answers; the tests in tools/flax_suite/excluded.txt (Flax's exact error wording) left out;
  rope  with RoPE as the default, the tests RoPE can run, where a module must agree with
        its own decoding (Linen's test_decoding, the x64 decodes), a mask with is_causal
        (test_causal_mask_equivalence), dropout with itself, ...; left out (NOT_WITH_ROPE
        below, each with its reason): odd head sizes, cross-attention whose positions
        nothing implies, and the comparison with jax.nn's NoPE answer;
  flax  stock Flax, for the count to compare with.

A test in tools/flax_suite/refused.txt runs and must fail with the error it names: an input
posenc_jax's attention refuses by design (complex numbers), refused in one line, not answered.

Usage:
  python tools/run_flax_attention_tests.py [--runs nope,rope] [--source DIR_OR_SDIST] [--keep DIR]

Exit status 0 when every selected test of every run passed (the refused ones failing with their
error); prints each run's counts.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
from xml.etree import ElementTree

HERE = pathlib.Path(__file__).resolve().parent
SUITE = HERE / "flax_suite"
FILES = ("tests/nnx/nn/attention_test.py", "tests/linen/linen_attention_test.py")
# The tests not run with RoPE, by node id prefix, and why: RoPE rotates pairs of features (an odd
# head size has none to pair), needs positions (which cross-attention of different lengths with
# no mask does not imply), and differs from a fixed NoPE answer by design.
ODD_HEAD = "head size {} (RoPE rotates pairs of features)"
NOT_WITH_ROPE = {
    "nnx/nn/attention_test.py::TestMultiHeadAttention::test_basic": ODD_HEAD.format(3),
    "nnx/nn/attention_test.py::TestMultiHeadAttention::test_multihead_sow_attention_weights": ODD_HEAD.format(1),
    "nnx/nn/attention_test.py::TestLinenConsistency::test_nnx_attention_equivalence": ODD_HEAD.format(3),
    "nnx/nn/attention_test.py::TestKVFeatures::test_varying_num_features": ODD_HEAD.format(3),
    "linen/linen_attention_test.py::AttentionTest::test_autoregressive_receptive_field_1d": ODD_HEAD.format(1),
    "linen/linen_attention_test.py::AttentionTest::test_multihead_mask_warning": ODD_HEAD.format(1),
    "nnx/nn/attention_test.py::TestGQADotProductAttention::test_gqa_shapes": (
        "4 queries against 5 keys with no mask: no positions implied, which RoPE needs"
    ),
    "linen/linen_attention_test.py::AttentionTest::test_multihead_kv_args": (
        "3 queries against 9 keys with no mask: no positions implied, which RoPE needs"
    ),
    "linen/linen_attention_test.py::AttentionTest::test_attention_alias_equivalence": (
        "3 queries against 9 keys with no mask: no positions implied, which RoPE needs"
    ),
    "linen/linen_attention_test.py::AttentionTest::test_attention_alias_submodule": (
        "3 queries against 9 keys with no mask: no positions implied, which RoPE needs"
    ),
    "nnx/nn/attention_test.py::TestGQADotProductAttention::test_gqa_parity_with_jax": (
        "compares with jax.nn.dot_product_attention, which has no position encoding"
    ),
}


def excluded() -> dict[str, str]:
    out = {}
    for line in (SUITE / "excluded.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            test, reason = (part.strip() for part in line.split("|", 1))
            out[test] = reason
    return out


def refused() -> dict[str, str]:
    """Test id -> the text its failure must hold."""
    out = {}
    for line in (SUITE / "refused.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            test, error = (part.strip() for part in line.split("|", 1))
            out[test] = error
    return out


def _test_id(case) -> str:
    """A junit testcase's id as pytest writes it under flax's tests/ (``linen/x_test.py::Class::test``)."""
    *module, cls = case.get("classname", "").split(".")
    return "/".join(module).removeprefix("tests/") + f".py::{cls}::{case.get('name', '')}"


def flax_tests(source: str | None, into: pathlib.Path) -> pathlib.Path:
    """The folder holding Flax's ``tests/`` for the installed Flax version."""
    import flax

    if source and pathlib.Path(source, "tests").is_dir():
        return pathlib.Path(source)
    if source:
        sdist = pathlib.Path(source)
    else:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps"]
            + [f"flax=={flax.__version__}", "-d", str(into)],
            check=True,
        )
        sdist = next(into.glob("flax-*.tar.gz"))
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if any(m.name.endswith(f) for f in FILES)]
        if len(members) != len(FILES):
            raise SystemExit(f"{sdist} does not hold {FILES}")
        archive.extractall(into, members=members, filter="data")
    return next(p for p in into.iterdir() if p.is_dir() and (p / "tests").is_dir())


def run(kind: str, root: pathlib.Path, work: pathlib.Path) -> tuple[int, int, int, list[str]]:
    """Runs one kind: (passed, failed unexpectedly, left out, the refused tests that failed as they must)."""
    leave_out = dict(excluded()) if kind != "flax" else {}
    if kind == "rope":
        leave_out.update(NOT_WITH_ROPE)
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", str(root)]
    junit = work / f"junit-{kind}.xml"
    command += ["-p", "posenc_swap", "-o", "addopts=", "-W", "ignore::DeprecationWarning", "--junitxml", str(junit)]
    for test in leave_out:
        command += ["--deselect", f"tests/{test}"]
    command += list(FILES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUITE), os.environ.get("PYTHONPATH", "")]))
    env["POSENC_FLAX_SUITE_ENCODING"] = {"nope": "nope", "rope": "rope", "flax": "flax"}[kind]
    print(f"== Flax's attention tests, {kind}: {len(leave_out)} left out", flush=True)
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    print(result.stdout[-6000:], result.stderr[-3000:], sep="\n", flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|deselected)", result.stdout)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    expected = refused() if kind != "flax" else {}
    as_refused = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        problems = case.findall("failure") + case.findall("error")
        test = _test_id(case)
        if problems and test in expected and any(expected[test] in (p.text or "") for p in problems):
            as_refused.append(test)
    return counts.get("passed", 0), failed - len(as_refused), counts.get("deselected", 0), as_refused


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="nope,rope", help="comma-separated: nope, rope, flax (default nope,rope)")
    parser.add_argument("--source", help="a flax sdist (.tar.gz) or an unpacked one; default: pip download")
    parser.add_argument("--keep", help="unpack into this folder and keep it")
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - {"nope", "rope", "flax"})
    if unknown:
        parser.error(f"unknown runs {unknown}; runs are nope, rope, flax")
    with tempfile.TemporaryDirectory() as temporary:
        work = pathlib.Path(args.keep or temporary)
        work.mkdir(parents=True, exist_ok=True)
        root = flax_tests(args.source, work)
        summary = []
        ok = True
        for kind in runs:
            passed, failed, left_out, as_refused = run(kind, root, work)
            summary.append(
                f"{kind}: {passed} passed, {failed} failed, {len(as_refused)} refused as they must be "
                f"({', '.join(t.split('::')[-1] for t in as_refused) or 'none'}), {left_out} left out"
            )
            ok = ok and failed == 0 and passed > 0
    print("== Flax's attention tests: " + "; ".join(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
