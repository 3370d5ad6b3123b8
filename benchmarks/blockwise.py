"""Blockwise against materialising attention: memory and time against length.

    python benchmarks/blockwise.py                       # 1k to 128k tokens (long: see below)
    python benchmarks/blockwise.py --lengths 1024 4096   # a quick look

One causal self-attention layer's forward, B=1, N=4, H=64, float32, for NoPE, RoPE, ALiBi,
T5, Shaw and DeBERTa. Memory is the compiled program's own account
(``jax.jit(f).lower(...).compile().memory_analysis()``: temporaries plus arguments and
output), so it needs no run; a materialising program that would not fit in this machine's
memory is compiled but not run. Time is the median of steady-state runs (after one
compiling run), both implementations timed side by side in the same process, and the
ratio is blockwise / materialising at the same length. A length whose estimated run time
exceeds ``--max-seconds`` is not timed (the table says so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

from posenc_jax.functional import dot_product_attention, encoding_config

ENCODINGS = ("rope", "alibi", "t5", "shaw", "deberta", "nope")
LENGTHS = (1024, 4096, 16384, 65536, 131072)
B, N, H = 1, 4, 64


def _hooks(name: str, length: int):
    if name == "nope":
        return []
    config = encoding_config(name)
    config = config.for_lengths(train_length=512, max_length=length, head_dim=H)
    return [config.build(config.init(jax.random.key(0), num_heads=N, head_dim=H, model_dim=N * H))]


def _program(name: str, length: int, implementation: str, block: int):
    hooks = _hooks(name, length)
    positions = jnp.arange(length)

    def attend(q, k, v, hooks):
        extra = dict(block_q=block, block_k=block) if implementation == "blockwise" else {}
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}" if n >= 2**27 else f"{n / 2**20:.0f} MiB"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--encodings", nargs="+", default=list(ENCODINGS))
    parser.add_argument("--block", type=int, default=512, help="block_q = block_k")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per cell (fewer when one run is long)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="skip timing a cell estimated above this")
    parser.add_argument("--memory-limit-gib", type=float, default=20.0, help="do not run programs needing more")
    parser.add_argument(
        "--time-materialize-up-to", type=int, default=4096, help="time the materialising path up to this length"
    )
    args = parser.parse_args(argv)
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
