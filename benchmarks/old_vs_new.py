"""An older commit's posenc_jax against the current one, timed side by side in one process.

    python benchmarks/old_vs_new.py [--old 27d360e] [--rounds 7] [--quick]
                                    [--sections attention,blockwise,memory,train,decode]
                                    [--encodings rope,t5,...] [--model-encodings nope,rope,...] [--no-grad]

The old commit's ``posenc_jax/`` is extracted (``git archive``) into a temporary folder as
``posenc_jax_old`` (every ``posenc_jax`` in its sources renamed), so both copies are imported
in one process; the current one is whatever ``import posenc_jax`` finds (run it with
``PYTHONPATH=.`` from a checkout). Each row's case is built from both copies by the same code
(``speed.py``'s builders, given the package's modules) and timed in interleaved rounds by
``speed.paired_times`` (each round runs every case once, rotated, every other round in reverse,
so neither copy always runs first). A row gives the median time of each copy over the rounds
and the median (min-max) of the per-round ratio new/old; a median above ``--limit`` (1.10) is
flagged. For the attention rows, "compiled program" says whether the two copies compile to
the same instructions in the same order (up to names): where they do, a ratio away from 1 is
the machine's noise. Memory rows compare the compiled programs' temporary memory (exact, no
rounds).

Sections, with ``speed.py``'s shapes (``--quick``: smaller ones, for a smoke run):

* ``attention``: causal attention, B=1, N=8, T=1024, H=64, plain and every encoding that acts in
  attention; forward, and forward+backward (gradients of q, k, v) unless ``--no-grad``;
* ``blockwise``: the same with ``implementation="blockwise"`` at T=2048: plain, RoPE, ALiBi;
* ``memory``: compiled temporary memory of the causal attention at T=4096;
* ``train``: a training step (forward, backward, AdamW) and a forward pass of the 2-layer
  Transformer (D=256, 4 heads, T=512, batch 8), for ``--model-encodings``;
* ``decode``: four decoding steps (batch 8, after a prefill of 512), for the model encodings
  that decode with a KV cache.
"""

from __future__ import annotations

import argparse
import atexit
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import speed  # benchmarks/speed.py, beside this file

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = ("attention", "blockwise", "memory", "train", "decode")
MODEL_ENCODINGS = ("nope", "rope", "alibi", "t5", "shaw", "cope", "transformer-xl", "fire")
BLOCKWISE_ENCODINGS = ("rope", "alibi")
OLD_NAME = "posenc_jax_old"


# ---------------------------------------------------------------------------------------------
# The old package under another name


def materialise(commit: str, name: str = OLD_NAME, into: pathlib.Path | None = None) -> pathlib.Path:
    """Extracts ``posenc_jax/`` of ``commit`` into ``into/name`` with every ``posenc_jax`` in its
    Python sources replaced by ``name``; returns ``into`` (to put on ``sys.path``)."""
    into = pathlib.Path(tempfile.mkdtemp(prefix="posenc_old_")) if into is None else into
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "posenc_jax"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "posenc_jax").rename(into / name)
    for source in (into / name).rglob("*.py"):
        source.write_text(re.sub(r"\bposenc_jax\b", name, source.read_text()))
    return into


def load_old(commit: str, name: str = OLD_NAME) -> speed.Library:
    folder = materialise(commit, name)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    sys.path.insert(0, str(folder))
    return speed.Library.load(name)


def _describe(commit: str) -> str:
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return f"{git('rev-parse', '--short', commit)} ({git('log', '-1', '--format=%s', commit)[:60]})"


# ---------------------------------------------------------------------------------------------
# Rows


def _ms(seconds) -> str:
    return f"{np.median(seconds) * 1e3:.1f} ms"


def same_program(old, new) -> str:
    """Whether two compiled programs are the same instructions in the same order, up to the names
    of values and computations and their source locations: ``"same"`` or ``"differs"``."""

    def instructions(compiled):
        lines = re.findall(r"^\s*(?:ROOT )?%.*$|^ENTRY.*$", compiled.as_text(), flags=re.M)
        return [
            re.sub(r"%[\w.-]+", "%", re.sub(r", (metadata|backend_config|frontend_attributes)=.*", "", line))
            for line in lines
        ]

    return "same" if instructions(old) == instructions(new) else "differs"


def timed_rows(
    cases: dict[str, dict[str, Callable[[], object]]], rounds: int, limit: float, programs: dict | None = None
) -> list[tuple]:
    """``cases[row] = {"old": run, "new": run}``, timed in one set of interleaved rounds;
    ``programs[row]``: :func:`same_program` of the row's two compiled programs, where compared."""
    flat = {f"{row} [{which}]": run for row, pair in cases.items() for which, run in pair.items()}
    times = speed.paired_times(flat, rounds, alternate=True)
    rows = []
    for row in cases:
        old, new = f"{row} [old]", f"{row} [new]"
        ratio = float(np.median(times[new] / times[old]))
        flag = f"> {limit:.2f}" if ratio > limit else ""
        compared = (programs or {}).get(row, "–")
        rows.append((row, _ms(times[old]), _ms(times[new]), speed.ratio_cell(times, new, old), compared, flag))
    return rows


HEADER = ("case", "old", "new", "new/old, median (range)", "compiled program", "flag")


def _qkv(batch, length, heads, head_dim):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32) for _ in range(3))


def _attention_cases(libs, names, shape, grad: bool, **options) -> tuple[dict, dict]:
    """The rows' cases (compiled once, ahead of time) and whether each row's two programs are the same."""
    batch, length, heads, head_dim = shape
    q, k, v = _qkv(*shape)
    pos = jnp.arange(length)
    cases, programs = {}, {}
    for name in names:
        forward, backward, compiled = {}, {}, {"forward": {}, "forward+grad": {}}
        for which, lib in libs.items():
            hooks = (
                []
                if name == "plain"
                else [speed._hook(name, num_heads=heads, head_dim=head_dim, model_dim=512, length=length, lib=lib)]
            )
            attend = speed._attention_fn(hooks, lib, **options)
            fn = compiled["forward"][which] = jax.jit(attend).lower(q, k, v, pos).compile()
            forward[which] = lambda fn=fn: fn(q, k, v, pos)
            if grad:
                loss = jax.grad(lambda q, k, v, pos, attend=attend: attend(q, k, v, pos).sum(), argnums=(0, 1, 2))
                g = compiled["forward+grad"][which] = jax.jit(loss).lower(q, k, v, pos).compile()
                backward[which] = lambda g=g: g(q, k, v, pos)
        cases[f"{name}, forward"] = forward
        if grad:
            cases[f"{name}, forward+grad"] = backward
        for kind, pair in compiled.items():
            if pair:
                programs[f"{name}, {kind}"] = same_program(pair["old"], pair["new"])
    return cases, programs


def attention_section(libs, names, rounds, quick, grad, limit) -> None:
    shape = (1, 512, 8, 64) if quick else (1, 1024, 8, 64)
    cases, programs = _attention_cases(libs, ["plain", *names], shape, grad)
    rows = timed_rows(cases, rounds, limit, programs)
    speed.print_table(f"Causal attention, B=1, N=8, T={shape[1]}, H=64: old vs new", HEADER, rows)


def blockwise_section(libs, names, rounds, quick, grad, limit) -> None:
    shape = (1, 1024, 8, 64) if quick else (1, 2048, 8, 64)
    cases, programs = _attention_cases(libs, ["plain", *names], shape, grad, implementation="blockwise")
    rows = timed_rows(cases, rounds, limit, programs)
    speed.print_table(
        f'Causal attention, implementation="blockwise" (512 × 512 tiles), B=1, N=8, T={shape[1]}, H=64: old vs new',
        HEADER,
        rows,
    )


def memory_section(libs, names, quick, limit) -> None:
    batch, length, heads, head_dim = (1, 1024, 8, 64) if quick else (1, 4096, 8, 64)
    spec = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    pos = jax.ShapeDtypeStruct((length,), jnp.int32)
    rows = []
    for name in ["plain", *names]:
        used = {}
        for which, lib in libs.items():
            hooks = (
                []
                if name == "plain"
                else [speed._hook(name, num_heads=heads, head_dim=head_dim, model_dim=512, length=length, lib=lib)]
            )
            used[which] = speed.temp_bytes(speed._attention_fn(hooks, lib), spec, spec, spec, pos)
        ratio = used["new"] / used["old"]
        rows.append(
            (
                name,
                f"{used['old'] / 2**20:.0f} MiB",
                f"{used['new'] / 2**20:.0f} MiB",
                f"{ratio:.2f}×",
                f"> {limit:.2f}" if ratio > limit else "",
            )
        )
    speed.print_table(
        f"Compiled temporary memory, causal attention, B={batch}, N={heads}, T=S={length}, H={head_dim}: old vs new",
        ("encoding", "old", "new", "new/old", "flag"),
        rows,
    )


def train_section(libs, names, rounds, quick, limit) -> None:
    batch_size, length, model_dim, heads, layers = (4, 256, 128, 4, 2) if quick else (8, 512, 256, 4, 2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, speed.VOCAB, (batch_size, length + 1)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.arange(length)}
    steps, forwards = {}, {}
    for name in names:
        steps[f"{name}, train step"], forwards[f"{name}, forward"] = {}, {}
        for which, lib in libs.items():
            model = speed._model(name, model_dim=model_dim, heads=heads, layers=layers, length=length, lib=lib)
            steps[f"{name}, train step"][which], forwards[f"{name}, forward"][which] = speed._train_functions(
                model, batch
            )
    rows = timed_rows(steps, rounds, limit) + timed_rows(forwards, rounds, limit)
    speed.print_table(
        f"Transformer ({layers} layers, D={model_dim}, {heads} heads, T={length}, batch {batch_size}): old vs new",
        HEADER,
        rows,
    )


def decode_section(libs, names, rounds, quick, limit) -> None:
    batch, prefill, model_dim, heads, layers = (4, 128, 128, 4, 2) if quick else (8, 512, 256, 4, 2)
    steps_per_round = 4
    capacity = prefill + (rounds + 1) * steps_per_round + 8
    cases = {}
    for name in names:
        info = libs["new"].functional.encoding_info(name)
        if not info.kv_cache or info.length_dependent:
            continue
        cases[name] = {}
        for which, lib in libs.items():
            decoder = speed._Decoder(
                name,
                model_dim=model_dim,
                heads=heads,
                layers=layers,
                batch=batch,
                prefill=prefill,
                capacity=capacity,
                rng=np.random.default_rng(0),  # the same prompt for both
                lib=lib,
            )

            def several(decoder=decoder):
                for _ in range(steps_per_round):
                    out = decoder()
                return out

            cases[name][which] = several
    rows = timed_rows(cases, rounds, limit)
    speed.print_table(
        f"{steps_per_round} decoding steps (batch {batch}, after a prefill of {prefill}; {layers} layers, "
        f"D={model_dim}): old vs new",
        HEADER,
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="27d360e", help="the old commit (default: 27d360e, before issue 28's merges)")
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds per table")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, for a smoke run")
    parser.add_argument("--encodings", default="", help="attention and memory rows (default: all in both copies)")
    parser.add_argument(
        "--model-encodings", default=",".join(MODEL_ENCODINGS), help="train and decode rows (NoPE included)"
    )
    parser.add_argument(
        "--blockwise-encodings", default=",".join(BLOCKWISE_ENCODINGS), help="blockwise rows (plain included)"
    )
    parser.add_argument("--no-grad", action="store_true", help="attention forward only")
    parser.add_argument("--limit", type=float, default=1.10, help="flag rows whose median new/old exceeds this")
    args = parser.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; choose from {SECTIONS}")
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3 for a median and a range, got {args.rounds}")

    libs = {"old": load_old(args.old), "new": speed.LIBRARY}
    common = [n for n in libs["new"].functional.encoding_names() if n in set(libs["old"].functional.encoding_names())]

    def chosen(text, default):
        names = [n.strip() for n in text.split(",") if n.strip()] if text else default
        unknown = set(names) - set(common)
        if unknown:
            parser.error(
                f"encodings {sorted(unknown)} are not registered in both copies; both have {', '.join(common)}"
            )
        return names

    if args.encodings:
        speed.ONLY = set(chosen(args.encodings, []))
    attention = [n for n in speed.attention_encodings() if n in common]
    models = chosen(args.model_encodings, [])
    blockwise = chosen(args.blockwise_encodings, [])

    new_file = pathlib.Path(sys.modules["posenc_jax"].__file__).parent
    if new_file.parent != ROOT:
        print(f"warning: posenc_jax is imported from {new_file}, not this checkout (run with PYTHONPATH={ROOT})")
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"]).returncode != 0
    load = os.getloadavg()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({os.cpu_count()} cores); "
        f"{args.rounds} paired rounds per table; load average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}\n"
        f"old: {_describe(args.old)}, as {OLD_NAME}\n"
        f"new: {new_file} at {_describe('HEAD')}{' with uncommitted changes' if dirty else ''}"
    )
    for section in sections:
        if section == "attention":
            attention_section(libs, attention, args.rounds, args.quick, not args.no_grad, args.limit)
        elif section == "blockwise":
            blockwise_section(libs, blockwise, args.rounds, args.quick, not args.no_grad, args.limit)
        elif section == "memory":
            memory_section(libs, attention, args.quick, args.limit)
        elif section == "train":
            train_section(libs, models, args.rounds, args.quick, args.limit)
        elif section == "decode":
            decode_section(libs, models, args.rounds, args.quick, args.limit)
        load = os.getloadavg()
        print(f"\n(load average after this table: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f})", flush=True)


if __name__ == "__main__":
    main()
