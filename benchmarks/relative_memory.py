"""Memory and time of the relative encodings' fast paths, as ratios to plain attention.

    python benchmarks/relative_memory.py [--length 4096] [--time-length 1024] [--repeats 7]

For each relative encoding, one head, H = 64, clip distance / span k = 128:

* compiled temporary memory (``jax.jit(f).lower(...).compile().memory_analysis()``)
  at T = S = ``--length`` of the fast path and of a reference-style version that
  materialises the relative tensor as the survey's pseudocode does (``R[T, S, H]``,
  or the ``[T, S]`` bucket matrix for the bias encodings), each as a ratio to plain
  attention's;
* steady-state time of the fast path at T = S = ``--time-length`` as a ratio to
  plain attention, measured side by side (interleaved repeats, best of each);
* the largest difference between fast and reference outputs at the timing length.

Everything is measured in one run on whatever device JAX picks; compare ratios,
not absolute times, across machines.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.functional import (
    ClippedRelativeBias,
    DeBERTa,
    Forms,
    Shaw,
    SinusoidalRelative,
    T5Bias,
    TransformerXL,
    declare_forms,
    dot_product_attention,
    t5_relative_bucket,
)
from posenc_jax.functional.encodings.deberta import deberta_relative_index

H, K_CLIP, D_XL = 64, 128, 64


def _attention(extra_logits=None, extra_values=None, scale=None):
    """Attention whose position terms come from plain callables (the reference style)."""

    class Terms:
        def logits(self, q, k, context):
            qp, kp = context.query_positions, context.key_positions
            return None if extra_logits is None else extra_logits(q, k, qp, kp)

        def values(self, w, context):
            qp, kp = context.query_positions, context.key_positions
            return None if extra_values is None else extra_values(w, qp, kp)

    declare_forms(Terms, Forms(hooks=("logits", "values")))

    def run(q, k, v, pos):
        return dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[Terms()], scale=scale)

    return run


def _with_encoding(encoding):
    def run(q, k, v, pos):
        return dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[encoding])

    return run


def _rel(qp, kp):
    return kp[None, :] - qp[:, None]  # [T, S], j - i


def _sinusoid(distance, dim, layout):
    w = jnp.asarray(np.power(10000.0, -np.arange(0, dim, 2) / dim), jnp.float32)
    angles = distance.astype(jnp.float32)[..., None] * w
    if layout == "half":
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*angles.shape[:-1], dim)


def _cases(rng):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.1, jnp.float32)
    pk, pv = normal(2 * K_CLIP + 1, H), normal(2 * K_CLIP + 1, H)
    t5_table, clip_table = normal(32, 1), normal(2 * K_CLIP + 1, 1)
    wr, u, vb = normal(D_XL, 1, H), normal(1, H), normal(1, H)
    dq, dk = normal(2 * K_CLIP, 1, H), normal(2 * K_CLIP, 1, H)
    scale = 1 / np.sqrt(H)

    def shaw_index(qp, kp):
        return jnp.clip(_rel(qp, kp), -K_CLIP, K_CLIP) + K_CLIP

    # Reference styles: the survey's einsums over a materialised R[i, j, :].
    shaw_ref = _attention(
        lambda q, k, qp, kp: jnp.einsum("BTNH,TSH->BNTS", q, pk[shaw_index(qp, kp)]) * scale,
        lambda w, qp, kp: jnp.einsum("BNTS,TSH->BTNH", w, pv[shaw_index(qp, kp)]),
    )
    functional_ref = _attention(
        lambda q, k, qp, kp: jnp.einsum("BTNH,TSH->BNTS", q, _sinusoid(_rel(qp, kp), H, "interleaved")) * scale
    )

    def xl_terms(q, k, qp, kp):
        R = jnp.einsum("TSD,DNH->TSNH", _sinusoid(-_rel(qp, kp), D_XL, "half"), wr)
        return (
            jnp.einsum("NH,BSNH->BNS", u, k)[:, :, None, :] + jnp.einsum("BTNH,TSNH->BNTS", q + vb[None, None], R)
        ) * scale

    t5_ref = _attention(
        lambda q, k, qp, kp: jnp.take(
            t5_table, t5_relative_bucket(_rel(qp, kp), num_buckets=32, max_distance=128), axis=0
        ).transpose(2, 0, 1)[None]
    )
    clip_ref = _attention(lambda q, k, qp, kp: clip_table[shaw_index(qp, kp)].transpose(2, 0, 1)[None])

    def deberta_terms(q, k, qp, kp):
        idx = deberta_relative_index(qp, kp, span=K_CLIP)[0]
        c2p = jnp.einsum("BTNH,TSNH->BNTS", q, dk[idx])
        p2c = jnp.einsum("TSNH,BSNH->BNTS", dq[idx], k)
        return (c2p + p2c) / np.sqrt(3 * H)

    return {
        "shaw (R_K + R_V)": (_with_encoding(Shaw(K_CLIP, pk, pv)), shaw_ref),
        "transformer-xl": (_with_encoding(TransformerXL(wr, u, vb)), _attention(xl_terms)),
        "t5": (_with_encoding(T5Bias(t5_table, max_distance=128)), t5_ref),
        "deberta (c2p + p2c)": (
            _with_encoding(DeBERTa(dq, dk, K_CLIP)),
            _attention(deberta_terms, scale=1 / np.sqrt(3 * H)),
        ),
        "clipped bias": (_with_encoding(ClippedRelativeBias(clip_table, K_CLIP)), clip_ref),
        "functional relative": (_with_encoding(SinusoidalRelative()), functional_ref),
    }


def _inputs(rng, length):
    qkv = [jnp.asarray(rng.normal(size=(1, length, 1, H)), jnp.float32) for _ in range(3)]
    return (*qkv, jnp.arange(length))


def _temp_bytes(fn, args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _best_times(fns, args, repeats):
    compiled = [jax.jit(fn) for fn in fns]
    for fn in compiled:
        fn(*args).block_until_ready()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(compiled):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="T = S for the memory figures")
    parser.add_argument("--time-length", type=int, default=1024, help="T = S for the timing")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.length < 2 * K_CLIP or args.time_length < 2:
        parser.error(f"--length must be >= {2 * K_CLIP} and --time-length >= 2")

    rng = np.random.default_rng(0)
    cases = _cases(rng)
    plain = lambda q, k, v, pos: dot_product_attention(q, k, v, query_positions=pos, key_positions=pos)
    mem_args, time_args = _inputs(rng, args.length), _inputs(rng, args.time_length)
    plain_mem = _temp_bytes(plain, mem_args)
    print(
        f"device: {jax.devices()[0].device_kind}; one head, H = {H}, k = {K_CLIP}; "
        f"memory at T = S = {args.length} (plain attention temp {plain_mem / 2**20:.0f} MiB), "
        f"time at T = S = {args.time_length}, best of {args.repeats}"
    )
    print(f"{'encoding':22s} {'fast mem':>9s} {'ref mem':>9s} {'fast time':>10s} {'max |fast - ref|':>17s}")
    for name, (fast, reference) in cases.items():
        fast_mem = _temp_bytes(fast, mem_args) / plain_mem
        ref_mem = _temp_bytes(reference, mem_args) / plain_mem
        plain_t, fast_t = _best_times([plain, fast], time_args, args.repeats)
        diff = float(jnp.abs(jax.jit(fast)(*time_args) - jax.jit(reference)(*time_args)).max())
        print(f"{name:22s} {fast_mem:8.2f}x {ref_mem:8.2f}x {fast_t / plain_t:9.2f}x {diff:17.1e}", flush=True)


if __name__ == "__main__":
    main()
