"""A short tour of the foundation: measured, not asserted. Runs in seconds on a CPU.

    python benchmarks/demo.py [--out results/demo]

It prints, computed now on this machine:
  1. the sinusoidal table against d2l's and the shift-by-k rotation;
  2. the neighbour similarity <PE(t), PE(t+k)>, symmetric and decaying;
  3. RoPE: scores depend only on n - m; the phase error at position 100,000,
     exact-modulo-2π phases versus a plain float32 product;
  4. a learned absolute table asked for a position past its end: an error.
and writes two PNGs (needs matplotlib, the ``bench`` extra): the sinusoidal heat map
of d2l §11.6 and the neighbour-similarity curve.

This is a stand-in for the main job until the length-extrapolation benchmark lands.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional import (
    apply_rope,
    learned_position_embedding,
    sinusoidal_encoding,
)
from posenc_jax.functional.core.positions import position_angles
from posenc_jax.functional.encodings.rope import rope_inverse_frequencies
from posenc_jax.reference import d2l_positional_encoding, su_rope


def _sinusoidal(out: pathlib.Path) -> None:
    table = np.asarray(sinusoidal_encoding(jnp.arange(1000), 32), np.float64)
    print(
        "[1] sinusoidal vs d2l table (1000 x 32): max |diff| = "
        f"{np.abs(table - d2l_positional_encoding(1000, 32)).max():.2e}"
    )
    k = 7
    w = np.power(10000.0, -np.arange(0, 32, 2) / 32)
    shifted = np.empty_like(table[:-k])
    sin_t, cos_t = table[:-k, 0::2], table[:-k, 1::2]
    shifted[:, 0::2] = np.cos(k * w) * sin_t + np.sin(k * w) * cos_t
    shifted[:, 1::2] = -np.sin(k * w) * sin_t + np.cos(k * w) * cos_t
    print(
        f"    PE(t+{k}) = M_{k} PE(t) with one block rotation for all t: max |diff| = "
        f"{np.abs(shifted - table[k:]).max():.2e}"
    )

    big = np.asarray(sinusoidal_encoding(jnp.arange(0, 400), 128), np.float64)
    ks = np.arange(-60, 61)
    sim = np.array([big[200] @ big[200 + kk] for kk in ks])
    print(
        "[2] <PE(200), PE(200+k)> for k = 0, ±1, ±5, ±20, ±60: "
        + ", ".join(f"{sim[60 + kk]:.1f}/{sim[60 - kk]:.1f}" for kk in (0, 1, 5, 20, 60))
    )

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("    (matplotlib not installed: pip install -e '.[bench]' for the plots)")
        return
    fig, ax = plt.subplots(figsize=(4, 4.5))
    image = ax.imshow(table[:60], cmap="Blues", aspect="auto")
    ax.set(xlabel="Column (encoding dimension)", ylabel="Row (position)", title="Sinusoidal P, d = 32")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "sinusoidal_heatmap.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(ks, sim)
    ax.set(xlabel="offset k", ylabel="<PE(200), PE(200+k)>", title="Neighbour similarity, d = 128")
    fig.tight_layout()
    fig.savefig(out / "neighbour_similarity.png", dpi=120)
    plt.close(fig)
    print(f"    wrote {out / 'sinusoidal_heatmap.png'} and {out / 'neighbour_similarity.png'}")


def _rope() -> None:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 32, 1, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 32, 1, 64)), jnp.float32)
    pos = jnp.arange(32)
    scores = lambda p: np.einsum("TH,SH->TS", apply_rope(q, p)[0, :, 0], apply_rope(k, p)[0, :, 0])
    print(
        "[3] RoPE scores at positions p and p + 50,000: max |diff| = "
        f"{np.abs(scores(pos) - scores(pos + 50_000)).max():.2e}"
    )
    print(
        f"    agreement with Su's pseudocode: max |diff| = "
        f"{np.abs(np.asarray(apply_rope(q, pos)) - su_rope(np.asarray(q), np.asarray(pos))).max():.2e}"
    )
    freq = rope_inverse_frequencies(128)
    p = 100_000
    exact = np.mod(p * freq, 2 * np.pi)
    ours = np.mod(np.asarray(position_angles(jnp.array([p]), freq), np.float64)[0], 2 * np.pi)
    naive = np.mod((np.float32(p) * freq.astype(np.float32)).astype(np.float64), 2 * np.pi)
    wrap = lambda d: np.abs(np.angle(np.exp(1j * d))).max()
    print(
        f"    phase error at position {p:,}: exact-modulo-2π phases {wrap(ours - exact):.1e} rad, "
        f"float32 product {wrap(naive - exact):.1e} rad (bfloat16 half-ulp at 1.0 is {2**-9:.1e})"
    )
    # Cost of exact phases, side by side with the float32-product phases (a traced
    # frequency vector takes that path), in one run: a ratio, not an absolute time.
    x = jnp.asarray(rng.normal(size=(8, 2048, 8, 128)), jnp.bfloat16)
    positions = jnp.arange(2048)
    exact_rope = jax.jit(lambda x, p: apply_rope(x, p))
    float32_rope = jax.jit(lambda x, p, f: apply_rope(x, p, inverse_frequency=f))
    freq32 = jnp.asarray(rope_inverse_frequencies(128), jnp.float32)
    runs = {"exact": lambda: exact_rope(x, positions), "float32": lambda: float32_rope(x, positions, freq32)}
    best = {name: float("inf") for name in runs}
    for run in runs.values():
        run().block_until_ready()  # compile
    for _ in range(5):  # interleaved repeats, best of 5
        for name, run in runs.items():
            start = time.perf_counter()
            run().block_until_ready()
            best[name] = min(best[name], time.perf_counter() - start)
    print(
        f"    apply_rope on [8, 2048, 8, 128] bfloat16, steady state on {jax.devices()[0].platform}: "
        f"exact phases / float32 phases = {best['exact'] / best['float32']:.2f}x"
    )


def _learned() -> None:
    table = jnp.zeros((64, 16))
    try:
        learned_position_embedding(table, jnp.arange(100))
    except ValueError as error:
        print(f"[4] learned table of 64 asked for position 99: ValueError: {error}")
    else:  # pragma: no cover - would be a bug
        raise SystemExit("learned_position_embedding silently accepted a position past its table")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/demo"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"posenc_jax demo on {jax.devices()[0].device_kind} (jax {jax.__version__})")
    _sinusoidal(args.out)
    _rope()
    _learned()


if __name__ == "__main__":
    main()
