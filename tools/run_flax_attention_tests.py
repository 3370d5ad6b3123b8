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
  rope  the tests that compare a module or function with itself (its own decoding, its NNX and
        Linen forms, a mask against is_causal, dropout drawn twice, ...) with RoPE as the default,
        where a non-trivial encoding must agree with itself; the tests that compare with a fixed
        NoPE answer (jax.nn.dot_product_attention) or a Flax error's wording are left out (the
        list below);
  flax  stock Flax, for the count to compare with.

Usage:
  python tools/run_flax_attention_tests.py [--runs nope,rope] [--source DIR_OR_SDIST] [--keep DIR]

Exit status 0 when every selected test of every run passed; prints each run's counts.
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

HERE = pathlib.Path(__file__).resolve().parent
SUITE = HERE / "flax_suite"
FILES = ("tests/nnx/nn/attention_test.py", "tests/linen/linen_attention_test.py")
# With RoPE the attention differs from Flax's by design: tests comparing with a fixed NoPE answer
# are not run with it.
NOT_WITH_ROPE = {
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


def run(kind: str, root: pathlib.Path, work: pathlib.Path) -> tuple[int, int, int]:
    leave_out = dict(excluded()) if kind != "flax" else {}
    if kind == "rope":
        leave_out.update(NOT_WITH_ROPE)
    ini = work / "pytest.ini"
    ini.write_text("[pytest]\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", str(root)]
    command += ["-p", "posenc_swap", "-o", "addopts=", "-W", "ignore::DeprecationWarning"]
    for test in leave_out:
        command += ["--deselect", f"tests/{test}"]
    command += list(FILES)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUITE), os.environ.get("PYTHONPATH", "")]))
    env["POSENC_FLAX_SUITE_ENCODING"] = {"nope": "nope", "rope": "rope", "flax": "flax"}[kind]
    print(f"== Flax's attention tests, {kind}: {len(leave_out)} left out", flush=True)
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    print(result.stdout[-6000:], result.stderr[-3000:], sep="\n", flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|deselected)", result.stdout)}
    return (
        counts.get("passed", 0),
        counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
        (counts.get("deselected", 0)),
    )


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
            passed, failed, left_out = run(kind, root, work)
            summary.append(f"{kind}: {passed} passed, {failed} failed, {left_out} left out")
            ok = ok and failed == 0 and passed > 0
    print("== Flax's attention tests: " + "; ".join(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
