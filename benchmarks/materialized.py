"""Materialised attention: every encoding against plain attention, plain attention against ``jax.nn``'s, and
the first call's compile time.

    python benchmarks/materialized.py        # T = 1,024, 8 heads, 5 rounds: docs/blockwise/materialized-1024.md
    python benchmarks/materialized.py --length 256 --heads 2 --rounds 1 --encodings rope t5 cope --out /tmp/m.md

Three tables, measured in one process, causal self-attention, B=1, N=8 (``--heads``), H=64, T=1,024
(``--length``), float32, written as markdown to ``--out``:

1. Every encoding that fills an attention hook (``--versus-plain``'s list in ``benchmarks/blockwise.py``;
   ``--encodings`` to choose) through ``dot_product_attention(..., implementation="materialize")`` against
   plain attention (NoPE, materialised): the compiled temporaries
   (``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``), the time of the forward and of
   the forward and backward (the gradient with respect to q, k, v and the encoding's parameters) and XLA's
   flop count of the same programs, each as a ratio to NoPE's. A time ratio is the median over ``--rounds``
   rounds of the encoding's run over the NoPE run just before it (blockwise.py's pairing). Beside it, the
   encoding's floor: ``blockwise.py``'s :data:`FLOORS` with the tile the whole T x T score matrix. They carry
   over unchanged: without a checkpointed tile's recomputation, plain attention's forward and backward does
   6 score-sized products (not 8) and an extra product term 3 (not 4), the same share; an extra term per
   (query, key) pair costs its forward and backward about 3x its forward (not 4x) against plain's 12 (not
   16) flops per pair and head feature, again the same share. The budget is ``max(1.5, 1.25 × floor)`` for
   time and 1.5× for memory.
2. Plain attention (NoPE, materialised) against ``jax.nn.dot_product_attention(..., is_causal=True,
   implementation="xla")`` on the same q, k, v: temporaries, forward and forward and backward (gradients of
   q, k, v) time and flops as ratios (the pairing as above, ``jax.nn``'s run first); budget 1.1×.
3. The first call's compile time: the wall time of ``jax.jit(f).lower(...).compile()`` of the forward and
   backward, a fresh function object each time and ``jax.clear_caches()`` before it, for the composition
   RoPE + ALiBi + T5 (``--composition``; materialised, and ``"auto"``, whose path the table names) and for
   each encoding alone (materialised), each as the median over rounds of its compile over
   ``jax.nn.dot_product_attention``'s forward and backward compiled the same way just before it; budget 3×
   for the composition.

Timings are ratios within one process; a loaded machine widens them (run it on a quiet one).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import blockwise  # the helpers beside this script: floors, budgets, the paired timing

from posenc_jax.functional import encoding_names
from posenc_jax.functional.core.dispatch import goes_blockwise

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, H = blockwise.B, blockwise.H
COMPOSITION = ("rope", "alibi", "t5")
PLAIN_BUDGET, COMPILE_BUDGET, MEMORY_BUDGET = 1.1, 3.0, 1.5


def _hooks(names, length: int, heads: int) -> list:
    """The built hooks of ``names`` (NoPE: none), configured as blockwise.py configures them."""
    hooks = []
    for name in names:
        if name != "nope":
            config = blockwise._config(name, length)
            hooks.append(config.build(config.init(jax.random.key(0), num_heads=heads, head_dim=H, model_dim=heads * H)))
    return hooks


def _ours(length: int, implementation: str = "materialize"):
    """Our causal attention's forward ``f(q, k, v, hooks)`` and its forward and backward (a fresh pair per call)."""
    return blockwise.attention_functions(length, implementation)


def _jax_nn():
    """``jax.nn.dot_product_attention``'s causal forward ``f(q, k, v)`` and its forward and backward (fresh)."""

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v))

    return forward, jax.grad(loss, argnums=(0, 1, 2))


def _compiled(functions, *args) -> list:
    return [jax.jit(f).lower(*args).compile() for f in functions]


def _temp(compiled) -> int:
    return compiled.memory_analysis().temp_size_in_bytes


def _x(value: float) -> str:
    return f"{value:.2f}×"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _median_cells(ratios) -> list[str]:
    return [_x(statistics.median(r)) for r in ratios]


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def versus_plain(args, q, k, v) -> tuple[str, dict]:
    """Table 1: every encoding materialised against NoPE materialised."""
    shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    plain = _compiled(_ours(args.length), shape, shape, shape, [])
    plain_inputs = (q, k, v, [])
    for c in plain:
        blockwise._run(c, plain_inputs)
    plain_temp, plain_flops = [_temp(c) for c in plain], [blockwise._count(c) for c in plain]
    sizes = blockwise.Sizes(args.length, args.length, args.heads, H, args.length)
    rows, results = [], {}
    for name in args.encodings:
        if name == "nope" or blockwise._no_hook(name) is not None:
            continue
        hooks = _hooks([name], args.length, args.heads)
        programs = _compiled(_ours(args.length), shape, shape, shape, hooks)
        temp = [_temp(c) / p for c, p in zip(programs, plain_temp, strict=True)]
        flops = [blockwise._count(c) / p for c, p in zip(programs, plain_flops, strict=True)]
        rule = blockwise.FLOORS.get(name)
        floors = rule(blockwise._config(name, args.length), sizes) if rule else (None, None)
        budgets = [blockwise.budget(f) for f in floors]
        ratios, seconds = blockwise.paired_ratios(plain, plain_inputs, programs, (q, k, v, hooks), args.rounds)
        times = [statistics.median(r) for r in ratios]
        within = all(t <= MEMORY_BUDGET for t in temp) and all(t <= b for t, b in zip(times, budgets, strict=True))
        results[name] = {"temp": temp, "time": times, "within": within}
        rows.append(
            [name, *map(_x, temp), *map(_x, times), f"{_x(flops[0])}, {_x(flops[1])}", blockwise._floors_text(floors)]
            + [f"{_x(budgets[0])}, {_x(budgets[1])}", "yes" if within else "no", f"{seconds[0]:.3g}, {seconds[1]:.3g}"]
        )
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
        del programs
    header = ["encoding", "temp fwd", "temp fwd+bwd", "time fwd", "time fwd+bwd", "XLA flops fwd, fwd+bwd"]
    header += ["floor fwd, fwd+bwd", "budget fwd, fwd+bwd", "within", "NoPE s fwd, fwd+bwd"]
    text = (
        f"Each encoding's materialised attention as a ratio to NoPE's (materialised), forward (fwd) and forward "
        f"and backward (fwd+bwd: gradients of q, k, v and the encoding's parameters); NoPE's temporaries "
        f"{_mib(plain_temp[0])} fwd, {_mib(plain_temp[1])} fwd+bwd. Budget: time max(1.5×, 1.25 × floor), "
        f"temporaries {MEMORY_BUDGET}×.\n\n" + _table(header, ["---"] + ["---:"] * 7 + ["---", "---:"], rows)
    )
    return text, results


def versus_jax_nn(args, q, k, v) -> tuple[str, dict]:
    """Table 2: plain attention (NoPE, materialised) against ``jax.nn.dot_product_attention``'s XLA form."""
    shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    theirs = _compiled(_jax_nn(), shape, shape, shape)
    ours = _compiled(_ours(args.length), shape, shape, shape, [])
    for c in theirs:
        blockwise._run(c, (q, k, v))
    difference = float(jnp.max(jnp.abs(ours[0](q, k, v, []) - theirs[0](q, k, v))))
    temp = [_temp(o) / _temp(t) for o, t in zip(ours, theirs, strict=True)]
    flops = [blockwise._count(o) / blockwise._count(t) for o, t in zip(ours, theirs, strict=True)]
    ratios, seconds = blockwise.paired_ratios(theirs, (q, k, v), ours, (q, k, v, []), args.rounds)
    times = [statistics.median(r) for r in ratios]
    within = all(x <= PLAIN_BUDGET for x in temp + times)
    row = ["nope (materialize)", *map(_x, temp), *map(_x, times), f"{_x(flops[0])}, {_x(flops[1])}"]
    row += [_x(PLAIN_BUDGET), "yes" if within else "no", f"{seconds[0]:.3g}, {seconds[1]:.3g}"]
    print("| " + " | ".join(row) + " |", flush=True)
    header = ["attention", "temp fwd", "temp fwd+bwd", "time fwd", "time fwd+bwd", "XLA flops fwd, fwd+bwd"]
    header += ["budget", "within", "jax.nn s fwd, fwd+bwd"]
    text = (
        f"Plain attention (NoPE, materialised) as a ratio to `jax.nn.dot_product_attention(q, k, v, "
        f'is_causal=True, implementation="xla")` on the same q, k, v (outputs differ by at most {difference:.1e}; '
        f"its temporaries {_mib(_temp(theirs[0]))} fwd, {_mib(_temp(theirs[1]))} fwd+bwd; fwd+bwd: gradients of "
        f"q, k, v). Budget {PLAIN_BUDGET}× in time and temporaries.\n\n"
        + _table(header, ["---"] + ["---:"] * 5 + ["---:", "---", "---:"], [row])
    )
    return text, {"temp": temp, "time": times, "within": within, "difference": difference}


def _compile_seconds(make, *args) -> float:
    """Wall seconds of the first compile of ``make()``'s function (fresh), after clearing jax's caches."""
    jax.clear_caches()
    function = make()
    start = time.perf_counter()
    jax.jit(function).lower(*args).compile()
    return time.perf_counter() - start


def compile_times(args) -> tuple[str, dict]:
    """Table 3: the first call's compile of the forward and backward against ``jax.nn``'s."""
    shape = jax.ShapeDtypeStruct((B, args.length, args.heads, H), jnp.float32)
    auto = "blockwise" if goes_blockwise("auto", batch=B, num_heads=args.heads, query_length=args.length,
                                         key_length=args.length) else "materialize"  # fmt: skip
    together = " + ".join(args.composition)
    cases = [(f"{together}, materialize", args.composition, "materialize", COMPILE_BUDGET)]
    cases.append((f"{together}, auto (goes {auto})", args.composition, "auto", COMPILE_BUDGET))
    singles = ["nope"] + [n for n in args.encodings if n != "nope" and blockwise._no_hook(n) is None]
    cases += [(f"{name}, materialize", [name], "materialize", None) for name in singles]
    built = [(label, _hooks(names, args.length, args.heads), way, limit) for label, names, way, limit in cases]
    times = {label: ([], []) for label, *_ in built}
    for _ in range(args.compile_rounds):
        for label, hooks, way, _ in built:
            base, own = times[label]
            base.append(_compile_seconds(lambda: _jax_nn()[1], shape, shape, shape))
            own.append(_compile_seconds(lambda way=way: _ours(args.length, way)[1], shape, shape, shape, hooks))
    rows, results = [], {}
    for label, _, _, limit in built:
        base, own = times[label]
        ratio = statistics.median(o / b for o, b in zip(own, base, strict=True))
        within = "–" if limit is None else ("yes" if ratio <= limit else "no")
        results[label] = {"ratio": ratio, "within": within}
        rows.append([label, f"{statistics.median(own):.3g}", _x(ratio), "–" if limit is None else _x(limit), within])
        rows[-1].append(f"{statistics.median(base):.3g}")
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    header = ["forward and backward", "compile s", "ratio to jax.nn", "budget", "within", "jax.nn compile s"]
    text = (
        f"The first call's compile (`jax.jit(f).lower(...).compile()` wall time, a fresh function and "
        f"`jax.clear_caches()` before each) of the forward and backward (gradients of q, k, v and the "
        f"parameters), as the median over {args.compile_rounds} round{'s' * (args.compile_rounds > 1)} of its ratio to "
        f"`jax.nn.dot_product_attention`'s forward and backward compiled the same way just before it. "
        f"Budget {COMPILE_BUDGET:g}× for the "
        f"composition; the single encodings show which term costs compile time.\n\n"
        + _table(header, ["---", "---:", "---:", "---:", "---", "---:"], rows)
    )
    return text, results


def _device() -> str:
    device = jax.devices()[0]
    kind = device.device_kind
    return device.platform if kind.lower() == device.platform else f"{device.platform} ({kind})"


def run(args) -> dict:
    """Measure the three tables, write them to ``args.out`` and return their figures."""
    shape = (B, args.length, args.heads, H)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    command = "python benchmarks/materialized.py" + "".join(f" {shlex.quote(a)}" for a in args.argv)
    machine = (
        f"jax {jax.__version__}, {_device()}, {os.cpu_count()} cores; "
        f"causal self-attention, B={B}, N={args.heads}, H={H}, T={args.length:,}, float32; time: the median over "
        f"{args.rounds} round{'s' * (args.rounds > 1)} of each run over its baseline's run just before it"
    )
    print(machine, flush=True)
    sections = [versus_plain(args, q, k, v), versus_jax_nn(args, q, k, v), compile_times(args)]
    titles = ["Every encoding against plain attention", "Plain attention against jax.nn", "First call: compile time"]
    page = [f"# Materialised attention: T = {args.length:,}, {args.heads} heads", "", f"`{command}`", "", machine]
    for title, (text, _) in zip(titles, sections, strict=True):
        page += ["", f"## {title}", "", text]
    why = {}  # each reason once, with the encodings it covers (RoPE's scalings share RoPE's)
    for name in args.encodings:
        if name in blockwise.FLOOR_WHY and name != "nope":
            why.setdefault(blockwise.FLOOR_WHY[name], []).append(name)
    floors = [f"- {', '.join(names)}: {reason}" for reason, names in why.items()]
    page += ["", "Floors (blockwise.py's, the tile being the whole score matrix):", "", *floors]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(page) + "\n")
    print(f"wrote {out}", flush=True)
    return dict(zip(("encodings", "plain", "compile"), (s[1] for s in sections), strict=True))


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024, help="T = S (default 1,024)")
    parser.add_argument("--heads", type=int, default=8, help="heads of 64 (default 8)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per table (default 5)")
    parser.add_argument("--compile-rounds", type=int, default=3, help="compile rounds per case (default 3)")
    parser.add_argument("--encodings", nargs="+", help="default every registered encoding that fills a hook")
    parser.add_argument(
        "--composition",
        nargs="+",
        default=list(COMPOSITION),
        help=f"compiled together (default {' '.join(COMPOSITION)})",
    )
    parser.add_argument("--out", help="markdown path (default docs/blockwise/materialized-<T>[-heads<N>].md)")
    args = parser.parse_args(argv)
    for flag in ("length", "heads", "rounds", "compile_rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    unknown = sorted(set(args.encodings or ()).union(args.composition) - set(encoding_names()))
    if unknown:
        raise SystemExit(f"unknown encodings {unknown}: choose from {', '.join(encoding_names())}")
    args.encodings = args.encodings or encoding_names()
    suffix = "" if args.heads == 8 else f"-heads{args.heads}"
    args.out = args.out or str(ROOT / "docs" / "blockwise" / f"materialized-{args.length}{suffix}.md")
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
