"""Blockwise against materialising attention: memory and time against length.

    python benchmarks/blockwise.py                       # 1k to 128k tokens (long: see below)
    python benchmarks/blockwise.py --lengths 1024 4096   # a quick look
    python benchmarks/blockwise.py --longest             # every encoding: longest length in 24 GiB

One causal self-attention layer's forward, B=1, N=4, H=64, float32, for NoPE, RoPE, ALiBi,
T5, Shaw and DeBERTa. Memory is the compiled program's own account
(``jax.jit(f).lower(...).compile().memory_analysis()``: temporaries plus arguments and
output), so it needs no run; a materialising program that would not fit in this machine's
memory is compiled but not run. Time is the median of steady-state runs (after one
compiling run), both implementations timed side by side in the same process, and the
ratio is blockwise / materialising at the same length. A length whose estimated run time
exceeds ``--max-seconds`` is not timed (the table says so).

``--longest`` prints another table, blockwise only, for every registered encoding (default
tiles): the longest length (a multiple of the tile size) whose causal forward fits in
``--budget-gib`` by the compiled program's own account; the exponents of memory and time
against length (log-log least squares: memory over the compiles at ``--memory-lengths``,
time over steady-state runs at ``--time-lengths``, the lengths taking turns); and the time
at the longest length, measured when the fit puts it under ``--max-seconds`` and otherwise
the fit's extrapolation, labelled so. The longest length comes from the line of memory
against length through the two longest ``--memory-lengths``, checked by compiling at the
predicted length (must fit) and one tile more (must not); where the check fails the search
doubles and bisects instead. Encodings that fill no attention hook (absolute embeddings,
randomized positions) get a line saying so: their attention is NoPE's.

``--versus-plain`` prints, for every encoding that fills an attention hook, its blockwise
attention against plain blockwise attention (NoPE, the same tiles) at each of ``--lengths``
(default 4,096 and 16,384; ``--quick``: 1,024 and 2,048), causal, B=1, N=4, H=64, float32:
the compiled temporaries (``memory_analysis().temp_size_in_bytes``) and the time of the
forward and of the forward and backward (the gradient with respect to q, k, v and the
encoding's parameters), each as a ratio to NoPE's. Each encoding is timed in rounds that
take turns with NoPE's; a time ratio is the median over ``--rounds`` rounds of the
encoding's run over the NoPE run just before it, so a change in the machine's load falls on
both sides of each ratio; lengths above ``--time-up-to`` are compiled (memory) but not timed.
``--bidirectional`` measures the same without the causal mask (encodings that are causal only
get a line saying so); so does ``--arithmetic --bidirectional``.

``--arithmetic`` prints, for every encoding that fills an attention hook, the arithmetic of
one tile of its blockwise causal attention (forward, and forward and backward) as a ratio to
plain blockwise attention's, read from the compiled programs (``cost_analysis()["flops"]``).
XLA counts a loop's body once and a conditional's costliest branch, so a program's count is
one tile of the costliest kind plus the work done once per call; compiling at T and 2T
separates the two (the tile's share is the same at both, the per-call share doubles), and
the table gives both (a per-call share that grows as T plus a constant, Transformer-XL's table of
``T + bk - 1`` projected distances, leaves its constant in the tile's share). Being a count, not a
timing, it does not depend on the machine's load. Where a tile chooses between forms at run time
the count is the costliest one's: Transformer-XL's tiles count the sinusoid identity, which only
tiles whose positions are not runs take (the others read the per-call table, about 1.7× plain
attention's tile forward and 2.0× forward and backward at 8 heads).

``--heads N`` sets the number of heads of 64 (default 4) for every mode but ``--auto-threshold``.

Both the ``--versus-plain`` and the ``--arithmetic`` table print, beside each ratio, the
encoding's floor: the ratio of its arithmetic to plain attention's that its formula implies
for one tile (:data:`FLOORS`, derived on paper, one line each), the budget
``max(1.5, 1.25 × floor)`` and whether the encoding is within it (``--arithmetic``: XLA's count
of one tile, forward and forward and backward; ``--versus-plain``: the time ratios, and the
temporary memory within 1.5×). ``--versus-plain`` also prints XLA's count of the same compiled
programs as a ratio (one tile of the costliest kind plus the work once per call, as
``--arithmetic`` explains).

``--auto-threshold`` times plain attention's forward and backward materialised and blockwise,
side by side, at B=1, H=64, N in 4 and 8, T = S in 512 to 4,096 (``--lengths`` to change them),
and prints the size of the float32 scores ``4·B·N·T·S`` at which blockwise becomes the faster:
the number ``implementation="auto"`` reads for this backend
(:data:`posenc_jax.functional.core.attention.MATERIALIZE_LIMIT_BYTES_BY_BACKEND`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional import dot_product_attention, encoding_config, encoding_info, encoding_names
from posenc_jax.functional.core.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

ENCODINGS = ("rope", "alibi", "t5", "shaw", "deberta", "nope")
LENGTHS = (1024, 4096, 16384, 65536, 131072)
MEMORY_LENGTHS = (16384, 65536, 262144, 1048576)
TIME_LENGTHS = (2048, 4096, 8192)
VERSUS_LENGTHS = (4096, 16384)
B, N, H = 1, 4, 64  # N: --heads


class Sizes(NamedTuple):
    """What a floor depends on: the tile, the heads and the call's length."""

    block_q: int
    block_k: int
    heads: int
    head_dim: int
    length: int


def _pairs_floor(extra_per_pair_fwd: float, extra_per_pair_both: float, sizes: Sizes) -> tuple[float, float]:
    """Floors from the extra flops per (query, key) pair: plain attention does ``4·N·H`` per pair forward
    (``q·k`` and ``p·v``) and ``16·N·H`` forward and backward (the forward, its recomputation by the
    checkpointed tile, and the four products of the backward)."""
    nh = sizes.heads * sizes.head_dim
    return 1 + extra_per_pair_fwd / (4 * nh), 1 + extra_per_pair_both / (16 * nh)


def _products_floor(products: float, sizes: Sizes) -> tuple[float, float]:
    """Floors of an encoding whose extra work is ``products`` score-sized products per tile (a product over
    ``L`` distances per query row is ``L / bk`` of them): each costs one score product forward (of plain's two)
    and four forward and backward (forward, recomputation, two gradients; of plain's eight)."""
    return 1 + products / 2, 1 + 4 * products / 8


def _cope_floor(config, sizes: Sizes) -> tuple[float, float]:
    # z = q·eᵀ over min(P, T) positions once per query block, shared by the m key tiles it visits (causal:
    # (n + 1) / 2 on average); the gates are σ of the content score itself, the counts a running sum.
    tiles = -(-sizes.length // sizes.block_k)
    visits = (tiles + 1) / 2
    return _products_floor(min(config.num_positions, sizes.length) / sizes.block_k / visits, sizes)


def _fire_floor(config, sizes: Sizes) -> tuple[float, float]:
    # The MLP per pair: its first layer and ReLU (3W), its output layer (2WN); forward and backward: the
    # forward twice (the checkpointed tile recomputes it) and its backward, about twice its forward.
    w, n = config.hidden, sizes.heads
    forward = w * (2 * n + 3)
    return _pairs_floor(forward, 4 * forward, sizes)


# The arithmetic of one tile of each encoding's attention as a ratio to plain attention's, forward and
# forward and backward, from its formula (FLOOR_WHY says why, one line each): the least any implementation
# of the formula computes. 1.0 where the encoding adds only O(bq·bk) elementwise work (or O(bq + bk)).
# A term that dots each query with a vector per distance needs, per query row of a tile, one dot per
# distinct distance its bk keys are at: min(distances, bk) / bk score products (a matrix product over the
# tile's bq + bk - 1 distances does (bq + bk - 1) / bk of them, about twice).
FLOORS = {
    "nope": lambda config, sizes: (1.0, 1.0),
    "rope": lambda config, sizes: (1.0, 1.0),
    "xpos": lambda config, sizes: (1.0, 1.0),
    "alibi": lambda config, sizes: (1.0, 1.0),
    "t5": lambda config, sizes: (1.0, 1.0),
    "clipped-bias": lambda config, sizes: (1.0, 1.0),
    "kerple-log": lambda config, sizes: (1.0, 1.0),
    "kerple-power": lambda config, sizes: (1.0, 1.0),
    "sandwich": lambda config, sizes: (1.0, 1.0),
    "functional-relative": lambda config, sizes: _products_floor(1.0, sizes),
    "shaw": lambda config, sizes: _products_floor(
        2 * min(2 * config.max_distance + 1, sizes.block_k) / sizes.block_k, sizes
    ),
    "deberta": lambda config, sizes: _products_floor(
        len(config.terms) * min(2 * config.span, sizes.block_k) / sizes.block_k, sizes
    ),
    "transformer-xl": lambda config, sizes: _products_floor(1.0, sizes),
    "cope": _cope_floor,
    "fire": _fire_floor,
}
FLOOR_WHY = {
    "nope": "q·k and p·v: the unit",
    "rope": "rotates a tile's q and k: O((bq + bk)·N·H); likewise its scalings and rope-2d",
    "xpos": "RoPE's rotation with a decay per frequency: O((bq + bk)·N·H)",
    "alibi": "a slope times the distance per pair: O(bq·bk)",
    "t5": "a table read per bucket of the distance: O(bq·bk)",
    "clipped-bias": "a table read per clipped distance: O(bq·bk)",
    "kerple-log": "a log of the distance per pair: O(bq·bk)",
    "kerple-power": "a power of the distance per pair: O(bq·bk)",
    "sandwich": "a sum of cosines of the distance, per distance of the tile: O(bq + bk)·D, then O(bq·bk)",
    "functional-relative": "q·R_{j-i} with R of width H: one more score product (H features joined to q, k)",
    "shaw": "q·a_K and p·a_V, per row min(2k+1, bk) clipped distances: 2·min(2k+1, bk)/bk score products",
    "deberta": "c2p (q against relative keys) and p2c (k against relative queries), min(2·span, bk)/bk each",
    "transformer-xl": "(q+v)·W_R R_{i-j}: one dot per pair, one score product (W_R R_d projected once per call)",
    "cope": "gates σ(q·k) reuse the score, counts a running sum; q·e over P positions once per query block",
    "fire": "an MLP of one input, W hidden units and N outputs per pair: W·(2N+3) flops",
}
for _name in ("rope-2d", "rope-dynamic-ntk", "rope-llama3", "rope-longrope", "rope-ntk", "rope-pi", "rope-yarn"):
    FLOORS[_name], FLOOR_WHY[_name] = FLOORS["rope"], FLOOR_WHY["rope"]


def _config(name: str, length: int):
    """``name``'s config as the benchmark builds it at ``length``."""
    info = encoding_info(name)
    config = encoding_config(name, **{key: info.small_settings[key] for key in info.required})
    return config.for_lengths(train_length=512, max_length=length, head_dim=H)


def floor(name: str, length: int) -> tuple[float, float] | None:
    """``name``'s floor (forward, forward and backward) at ``length`` with the default tiles, or None."""
    rule = FLOORS.get(name)
    if rule is None:
        return None
    block_q, block_k = min(DEFAULT_BLOCK_Q, length), min(DEFAULT_BLOCK_K, length)
    return rule(_config(name, length), Sizes(block_q, block_k, N, H, length))


def budget(floor_value: float | None) -> float:
    """The budget of an encoding's ratio to plain attention: 1.5×, or 1.25× its floor where that is higher."""
    return 1.5 if floor_value is None else max(1.5, 1.25 * floor_value)


def _no_hook(name: str) -> str | None:
    """Why ``name`` has no attention to measure (it fills no attention hook), or None."""
    acts_on = encoding_info(name).acts_on
    if acts_on == "embeddings":
        return "added to the token embeddings: fills no attention hook, so its attention is nope's"
    if acts_on == "positions":
        return "replaces the positions the other encodings see: fills no attention hook, so its attention is nope's"
    return None


def _hooks(name: str, length: int):
    if name == "nope":
        return []
    # Settings an encoding cannot do without (a scaling's factor, the axial grid width) start
    # from its small settings; ``for_lengths`` then sizes them for a model trained on 512 tokens.
    config = _config(name, length)
    return [config.build(config.init(jax.random.key(0), num_heads=N, head_dim=H, model_dim=N * H))]


def _program(name: str, length: int, implementation: str, block: int | None):
    """``name``'s causal forward at ``length`` compiled (tiles ``block`` x ``block``; the defaults when None)."""
    hooks = _hooks(name, length)
    positions = jnp.arange(length)

    def attend(q, k, v, hooks):
        extra = dict(block_q=block, block_k=block) if implementation == "blockwise" and block else {}
        return dot_product_attention(
            q,
            k,
            v,
            query_positions=positions,
            key_positions=positions,
            encodings=hooks,
            causal=True,
            implementation=implementation,
            **extra,
        )

    shape = jax.ShapeDtypeStruct((B, length, N, H), jnp.float32)
    compiled = jax.jit(attend).lower(shape, shape, shape, hooks).compile()
    return compiled, hooks


def _bytes(compiled) -> int:
    memory = compiled.memory_analysis()
    return memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes


def _time(compiled, hooks, length: int, rounds: int, warm_up: bool = True) -> float:
    q, k, v = (jax.random.normal(jax.random.key(i), (B, length, N, H)) for i in range(3))
    if warm_up:  # a first run (allocation, caches) is not counted; skipped when one run takes minutes
        compiled(q, k, v, hooks).block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        compiled(q, k, v, hooks).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved(name: str, lengths, rounds: int) -> list[float]:
    """The median of ``rounds`` steady-state runs of ``name``'s blockwise forward at each length (after
    one compiling run each), the lengths taking turns so that a change in the machine's load falls on all."""
    runs = []
    for length in lengths:
        compiled, hooks = _program(name, length, "blockwise", None)
        q, k, v = (jax.random.normal(jax.random.key(i), (B, length, N, H)) for i in range(3))
        compiled(q, k, v, hooks).block_until_ready()
        runs.append((compiled, (q, k, v, hooks), []))
    for _ in range(rounds):
        for compiled, inputs, times in runs:
            start = time.perf_counter()
            compiled(*inputs).block_until_ready()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for _, _, times in runs]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}" if n >= 2**27 else f"{n / 2**20:.0f} MiB"


def _slope(xs, ys) -> float:
    """The least-squares slope of log y against log x."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def _blockwise_bytes(name: str, length: int) -> int:
    compiled, _ = _program(name, length, "blockwise", None)
    return _bytes(compiled)


def _longest(name: str, budget: float, memory: dict[int, int], tile: int) -> tuple[int, int, int]:
    """The longest multiple of ``tile`` whose program needs at most ``budget`` bytes, its bytes, and
    the compiles it took. ``memory`` (length: bytes, every length compiled so far) gains each compile."""
    compiles = 0

    def need(length: int) -> int:
        nonlocal compiles
        if length not in memory:
            memory[length] = _blockwise_bytes(name, length)
            compiles += 1
        return memory[length]

    # The line through the two longest lengths compiled: short programs carry fixed workspaces
    # that a fit over all the lengths would spread into the slope.
    short, long = sorted(memory)[-2:]
    slope = (memory[long] - memory[short]) / (long - short)
    guess = max(tile, int((budget - memory[long]) / slope + long) // tile * tile)
    if need(guess) <= budget and need(guess + tile) > budget:  # the affine prediction, checked both sides
        return guess, memory[guess], compiles
    # The prediction missed (memory not affine in T): double from the longest length known to fit, then bisect.
    low = max([n for n in memory if memory[n] <= budget], default=tile)
    high = min([n for n in memory if memory[n] > budget], default=None)
    while high is None:
        if need(2 * low) <= budget:
            low = 2 * low
        else:
            high = 2 * low
    while high - low > tile:
        middle = (low + high) // 2 // tile * tile
        if need(middle) <= budget:
            low = middle
        else:
            high = middle
    return low, need(low), compiles


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def longest(args) -> None:
    """The ``--longest`` table (see the module's docstring)."""
    budget = args.budget_gib * 2**30
    tile = max(DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K)
    time_lengths, memory_lengths = sorted(args.time_lengths), sorted(args.memory_lengths)
    fit_lengths = ", ".join(f"{n:,}" for n in time_lengths)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; blockwise causal forward, "
        f"B={B}, N={N}, H={H}, float32, default tiles {DEFAULT_BLOCK_Q}x{DEFAULT_BLOCK_K}; budget "
        f"{args.budget_gib:g} GiB (compiled temporaries + arguments + output); memory exponent over compiles at "
        f"{', '.join(f'{n:,}' for n in memory_lengths)}; time exponent over the median of {args.rounds} "
        f"steady-state runs at {fit_lengths} (taking turns)"
    )
    print(
        "| encoding | longest T in budget | GiB at it | memory exponent | time exponent | "
        f"s at {time_lengths[-1]:,} | time at longest T |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in args.encodings:
        why = _no_hook(name)
        if why is not None:
            print(f"| {name} | – | – | – | – | – | {why} |", flush=True)
            continue
        started = time.perf_counter()
        memory = {n: _blockwise_bytes(name, n) for n in memory_lengths}
        memory_exponent = _slope(memory_lengths, [memory[n] for n in memory_lengths])
        length, need, compiles = _longest(name, budget, memory, tile)
        seconds = _interleaved(name, time_lengths, args.rounds)
        time_exponent = _slope(time_lengths, seconds)
        estimate = seconds[-1] * (length / time_lengths[-1]) ** time_exponent
        if estimate <= args.max_seconds:
            compiled, hooks = _program(name, length, "blockwise", None)
            rounds = args.rounds if estimate < 5 else 1  # as the per-length table: one cold run when runs are long
            seconds_there = _time(compiled, hooks, length, rounds, warm_up=estimate <= 30)
            at_longest = f"{_duration(seconds_there)}, measured"
            del compiled
        else:
            at_longest = f"≈ {_duration(estimate)}, estimated from the fit at {fit_lengths}"
        print(
            f"| {name} | {length:,} | {need / 2**30:.2f} | {memory_exponent:.2f} | {time_exponent:.2f} | "
            f"{seconds[-1]:.3g} | {at_longest} |",
            flush=True,
        )
        print(
            f"{name}: {len(memory) - compiles} + {compiles} compiles to find the longest length, "
            f"seconds {[round(x, 4) for x in seconds]}, {time.perf_counter() - started:.0f} s in all",
            file=sys.stderr,
            flush=True,
        )


def attention_functions(length: int, implementation: str, causal: bool = True):
    """Our attention's forward ``f(q, k, v, hooks)`` and its forward and backward (the gradients of q, k, v and
    the hooks' parameters), self-attention over ``arange(length)``; a fresh pair per call."""
    positions = jnp.arange(length)

    def forward(q, k, v, hooks):
        return dot_product_attention(
            q,
            k,
            v,
            query_positions=positions,
            key_positions=positions,
            encodings=hooks,
            causal=causal,
            implementation=implementation,
        )

    def loss(q, k, v, hooks):
        return jnp.sum(forward(q, k, v, hooks))

    return forward, jax.grad(loss, argnums=(0, 1, 2, 3))


def _versus_programs(name: str, length: int, causal: bool = True):
    """``name``'s blockwise forward and its forward and backward, compiled, with their inputs."""
    hooks = _hooks(name, length)
    forward, backward = attention_functions(length, "blockwise", causal)
    shape = jax.ShapeDtypeStruct((B, length, N, H), jnp.float32)
    compiled = [jax.jit(f).lower(shape, shape, shape, hooks).compile() for f in (forward, backward)]
    return compiled, hooks


def _run(compiled, inputs) -> float:
    """Seconds of one run of ``compiled`` on ``inputs``."""
    start = time.perf_counter()
    jax.block_until_ready(compiled(*inputs))
    return time.perf_counter() - start


def paired_ratios(baselines, baseline_inputs, programs, inputs, rounds: int):
    """Each program's run over its baseline's run just before it, ``rounds`` times (after one warm-up run of
    each), and the baselines' median seconds. A round runs baseline 0, program 0, baseline 1, program 1, ...,
    so a change in the machine's load between rounds falls on both sides of each ratio; the table gives the
    median of each program's ratios."""
    for c in programs:
        _run(c, inputs)
    times = [([], []) for _ in programs]
    for _ in range(rounds):
        for (base, own), baseline, program in zip(times, baselines, programs, strict=True):
            base.append(_run(baseline, baseline_inputs))
            own.append(_run(program, inputs))
    ratios = [[e / p for e, p in zip(own, base, strict=True)] for base, own in times]
    return ratios, [statistics.median(base) for base, _ in times]


def versus_plain(args) -> None:
    """The ``--versus-plain`` table (see the module's docstring)."""
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; blockwise "
        f"{'bidirectional' if args.bidirectional else 'causal'} attention, "
        f"B={B}, N={N}, H={H}, float32, default tiles {DEFAULT_BLOCK_Q}x{DEFAULT_BLOCK_K}; each a ratio to NoPE "
        f"(blockwise, same tiles); time: the median over {args.rounds} rounds of the run over NoPE's run just before it"
    )
    print(
        "| encoding | T | temp fwd | temp fwd+bwd | time fwd | time fwd+bwd | XLA flops fwd, fwd+bwd | "
        "floor fwd, fwd+bwd | budget fwd, fwd+bwd | within | NoPE s fwd, fwd+bwd |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for length in args.lengths:
        timed = length <= args.time_up_to
        plain, plain_hooks = _versus_programs("nope", length, not args.bidirectional)
        q, k, v = (jax.random.normal(jax.random.key(i), (B, length, N, H)) for i in range(3))

        plain_temp = [c.memory_analysis().temp_size_in_bytes for c in plain]
        plain_flops = [_count(c) for c in plain]
        if timed:
            for c in plain:
                _run(c, (q, k, v, plain_hooks))
        for name in args.encodings:
            if name == "nope" or _no_hook(name) is not None:
                continue
            if args.bidirectional and "bidirectional" not in encoding_info(name).forms:
                print(f"| {name} | {length:,} | causal only | | | | | | | | |", flush=True)
                continue
            programs, hooks = _versus_programs(name, length, not args.bidirectional)
            temp = [c.memory_analysis().temp_size_in_bytes / p for c, p in zip(programs, plain_temp, strict=True)]
            flops = [_count(c) / p for c, p in zip(programs, plain_flops, strict=True)]
            floors = floor(name, length) or (None, None)
            budgets = [budget(f) for f in floors]
            cells = ["–", "–"]
            ratios = None
            base = ""
            if timed:
                ratios, seconds = paired_ratios(plain, (q, k, v, plain_hooks), programs, (q, k, v, hooks), args.rounds)
                cells = [f"{statistics.median(r):.2f}×" for r in ratios]
                base = f"{seconds[0]:.3g}, {seconds[1]:.3g}"
            within = all(t <= 1.5 for t in temp)
            if ratios is not None:
                within = within and all(statistics.median(r) <= b for r, b in zip(ratios, budgets, strict=True))
            verdict = ("yes" if within else "no") + ("" if ratios is not None else " (memory; time not measured)")
            print(
                f"| {name} | {length:,} | {temp[0]:.2f}× | {temp[1]:.2f}× | {cells[0]} | {cells[1]} | "
                f"{flops[0]:.2f}×, {flops[1]:.2f}× | {_floors_text(floors)} | {budgets[0]:.2f}×, {budgets[1]:.2f}× | "
                f"{verdict} | {base} |",
                flush=True,
            )
            del programs


def _count(compiled) -> float:
    """XLA's count of a compiled program's flops (a loop's body counted once)."""
    return float(compiled.cost_analysis().get("flops", 0.0))


def _floors_text(floors) -> str:
    return "–" if floors[0] is None else f"{floors[0]:.2f}×, {floors[1]:.2f}×"


def _flops(name: str, length: int, causal: bool = True) -> list[float]:
    """The XLA cost analysis' flops of ``name``'s blockwise forward and forward and backward at ``length``."""
    programs, _ = _versus_programs(name, length, causal)
    return [_count(c) for c in programs]


def arithmetic(args) -> None:
    """The ``--arithmetic`` table (see the module's docstring)."""
    length = args.lengths[0]
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}; blockwise "
        f"{'bidirectional' if args.bidirectional else 'causal'} attention, B={B}, N={N}, H={H}, "
        f"float32, tiles {DEFAULT_BLOCK_Q}x{DEFAULT_BLOCK_K}; flops from the compiled programs at T={length:,} and "
        f"{2 * length:,}: one tile (the costliest kind) and the work once per call, as ratios to one plain tile"
    )
    print(
        "| encoding | tile fwd | tile fwd+bwd | per call fwd (tiles) | per call fwd+bwd (tiles) | "
        "floor fwd, fwd+bwd | budget fwd, fwd+bwd | within |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")

    def split(name):
        once, twice = _flops(name, length, not args.bidirectional), _flops(name, 2 * length, not args.bidirectional)
        return [(2 * a - b, b - a) for a, b in zip(once, twice, strict=True)]  # (tile, per call at T)

    plain = split("nope")
    print(
        f"| nope | {plain[0][0] / 1e6:,.0f} MFLOP | {plain[1][0] / 1e6:,.0f} MFLOP | – | – | 1.00×, 1.00× | – | – |",
        flush=True,
    )
    for name in args.encodings:
        if name == "nope" or _no_hook(name) is not None:
            continue
        if args.bidirectional and "bidirectional" not in encoding_info(name).forms:
            print(f"| {name} | causal only | | | | | | |", flush=True)
            continue
        (tile_f, call_f), (tile_b, call_b) = split(name)
        ratios = (tile_f / plain[0][0], tile_b / plain[1][0])
        floors = floor(name, length) or (None, None)
        budgets = [budget(f) for f in floors]
        within = all(r <= b for r, b in zip(ratios, budgets, strict=True))
        print(
            f"| {name} | {ratios[0]:.2f}× | {ratios[1]:.2f}× | {call_f / plain[0][0]:.2f} | "
            f"{call_b / plain[1][0]:.2f} | {_floors_text(floors)} | {budgets[0]:.2f}×, {budgets[1]:.2f}× | "
            f"{'yes' if within else 'no'} |",
            flush=True,
        )
    print("\nfloors (the arithmetic each formula needs per tile, as a ratio to plain attention's):")
    for name in args.encodings:
        if name in FLOOR_WHY and name != "nope":
            print(f"- {name}: {_floors_text(floor(name, length))}: {FLOOR_WHY[name]}")


AUTO_HEADS = (4, 8)
AUTO_LENGTHS = (512, 1024, 2048, 4096)


def _plain_backward(length: int, heads: int, implementation: str):
    """Plain causal attention's forward and backward (gradients of q, k, v), compiled, and its inputs."""

    positions = jnp.arange(length)

    def loss(q, k, v):
        out = dot_product_attention(
            q,
            k,
            v,
            query_positions=positions,
            key_positions=positions,
            causal=True,
            implementation=implementation,
        )
        return jnp.sum(out)

    shape = (B, length, heads, H)
    inputs = tuple(jax.random.normal(jax.random.key(i), shape) for i in range(3))
    struct = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(struct, struct, struct).compile(), inputs


def auto_threshold(args) -> None:
    """The ``--auto-threshold`` table (see the module's docstring)."""
    from posenc_jax.functional.core.attention import MATERIALIZE_LIMIT_BYTES_BY_BACKEND

    backend = jax.default_backend()
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; plain causal attention, "
        f"forward and backward (gradients of q, k, v), B={B}, H={H}, float32, default tiles "
        f"{DEFAULT_BLOCK_Q}x{DEFAULT_BLOCK_K}; time: the median of {args.rounds} steady-state runs, the two "
        f"implementations taking turns"
    )
    print("| N | T | scores MiB | materialise s | blockwise s | blockwise / materialise |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for heads in AUTO_HEADS:
        for length in args.lengths:
            programs = [_plain_backward(length, heads, way) for way in ("materialize", "blockwise")]
            for compiled, inputs in programs:
                _run(compiled, inputs)
            times = [[], []]
            for _ in range(args.rounds):
                for i, (compiled, inputs) in enumerate(programs):
                    times[i].append(_run(compiled, inputs))
            materialise, blockwise = (statistics.median(t) for t in times)
            scores = 4 * B * heads * length * length
            rows.append((scores, materialise, blockwise))
            print(
                f"| {heads} | {length:,} | {scores / 2**20:,.0f} | {materialise:.3g} | {blockwise:.3g} | "
                f"{blockwise / materialise:.2f}× |",
                flush=True,
            )
            del programs
    # The threshold: the largest scores size at which materialising is still the faster, when blockwise is
    # the faster at every larger size measured ("auto" goes blockwise above it).
    rows.sort()
    slower = [i for i, (_, m, b) in enumerate(rows) if m < b]
    if not slower:
        limit, where = rows[0][0] - 1, "blockwise is the faster at every size measured"
    elif slower[-1] == len(rows) - 1:
        limit, where = None, "materialising is still the faster at the largest size measured"
    else:
        limit = rows[slower[-1]][0]
        where = f"blockwise is the faster from {rows[slower[-1] + 1][0] / 2**20:,.0f} MiB of scores on"
    today = MATERIALIZE_LIMIT_BYTES_BY_BACKEND.get(backend)
    print(f"crossover on {backend}: {where}")
    if limit is not None:
        print(
            f"threshold: MATERIALIZE_LIMIT_BYTES_BY_BACKEND[{backend!r}] = {limit}  ({limit / 2**20:,.0f} MiB; "
            f"the code has {today})"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", help=f"default {' '.join(map(str, LENGTHS))}")
    parser.add_argument("--encodings", nargs="+", help=f"default {' '.join(ENCODINGS)}; every one with --longest")
    parser.add_argument("--block", type=int, default=512, help="block_q = block_k")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per cell (fewer when one run is long)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="skip timing a cell estimated above this")
    parser.add_argument("--memory-limit-gib", type=float, default=20.0, help="do not run programs needing more")
    parser.add_argument(
        "--time-materialize-up-to", type=int, default=4096, help="time the materialising path up to this length"
    )
    parser.add_argument("--longest", action="store_true", help="the longest-length table (blockwise, every encoding)")
    parser.add_argument("--budget-gib", type=float, default=24.0, help="--longest: the memory budget")
    parser.add_argument("--memory-lengths", type=int, nargs="+", default=list(MEMORY_LENGTHS), help="--longest")
    parser.add_argument("--time-lengths", type=int, nargs="+", default=list(TIME_LENGTHS), help="--longest")
    parser.add_argument("--versus-plain", action="store_true", help="every encoding against NoPE, blockwise")
    parser.add_argument("--quick", action="store_true", help="--versus-plain at 1,024 and 2,048 tokens")
    parser.add_argument("--time-up-to", type=int, default=16384, help="--versus-plain: time up to this length")
    parser.add_argument(
        "--bidirectional", action="store_true", help="--versus-plain, --arithmetic: without the causal mask"
    )
    parser.add_argument("--arithmetic", action="store_true", help="one tile's flops, every encoding against NoPE")
    parser.add_argument("--heads", type=int, default=4, help="heads of 64 (not --auto-threshold: 4 and 8)")
    parser.add_argument(
        "--auto-threshold", action="store_true", help="where blockwise overtakes materialising (plain attention)"
    )
    args = parser.parse_args(argv)
    global N
    if args.heads < 1:
        raise SystemExit(f"--heads must be at least 1, got {args.heads}")
    N = args.heads
    if args.auto_threshold:
        args.lengths = args.lengths or list(AUTO_LENGTHS)
        auto_threshold(args)
        return
    if args.arithmetic:
        args.lengths = args.lengths or [4096]
        args.encodings = args.encodings or encoding_names()
        arithmetic(args)
        return
    if args.versus_plain:
        args.lengths = args.lengths or ([1024, 2048] if args.quick else list(VERSUS_LENGTHS))
        args.encodings = args.encodings or encoding_names()
        versus_plain(args)
        return
    if args.longest:
        args.encodings = args.encodings or encoding_names()
        longest(args)
        return
    args.encodings = args.encodings or list(ENCODINGS)
    args.lengths = args.lengths or list(LENGTHS)
    limit = args.memory_limit_gib * 2**30

    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; causal forward, B={B}, N={N}, "
        f"H={H}, float32, blocks {args.block}x{args.block}"
    )
    print(
        "| encoding | T | materialise GiB | blockwise GiB | memory ratio | materialise s | blockwise s | time ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    per_element = {}  # seconds per (query, key) pair of the last timed blockwise run, to estimate the next
    for name in args.encodings:
        why = _no_hook(name)
        if why is not None:
            print(f"| {name} | – | – | – | – | – | – | {why} |", flush=True)
            continue
        for length in args.lengths:
            cells = {}
            for implementation in ("materialize", "blockwise"):
                compiled, hooks = _program(name, length, implementation, args.block)
                need = _bytes(compiled)
                estimate = per_element.get(name, 0.0) * length * length / 2
                if need > limit:
                    cells[implementation] = (need, None, "does not fit")
                elif implementation == "materialize" and length > args.time_materialize_up_to:
                    cells[implementation] = (need, None, "not timed")
                elif estimate > args.max_seconds:
                    cells[implementation] = (need, None, f"~{estimate:.0f} s, not timed")
                else:
                    rounds = args.rounds if estimate < 5 else 1
                    long = estimate > 30 or (not estimate and length > 16384)
                    seconds = _time(compiled, hooks, length, rounds, warm_up=not long)
                    if implementation == "blockwise":
                        per_element[name] = seconds / (length * length / 2)
                    cells[implementation] = (need, seconds, f"{seconds:.3g}")
                del compiled
            (m_bytes, m_s, m_text), (b_bytes, b_s, b_text) = cells["materialize"], cells["blockwise"]
            ratio = f"{b_s / m_s:.2f}×" if m_s and b_s else "–"
            print(
                f"| {name} | {length:,} | {_gib(m_bytes)} | {_gib(b_bytes)} | {m_bytes / b_bytes:.0f}× smaller | "
                f"{m_text} | {b_text} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
