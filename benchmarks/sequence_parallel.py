"""Per-device memory of one long attention split over the devices of a mesh.

    python benchmarks/sequence_parallel.py                    # 8 simulated CPU devices
    python benchmarks/sequence_parallel.py --devices 4 --lengths 65536

One causal RoPE + ALiBi self-attention (B=1, 8 query heads, H=64, float32, the default 512 × 512
tiles), compiled three ways and read from each compiled program's ``memory_analysis()``
(temporaries, arguments and output; nothing is run, so the figures are exact and need no quiet
machine): on one device (``dot_product_attention(..., implementation="blockwise")``), and with
q, k and v arriving split along T over the devices (``sequence_parallel_attention``), the keys
and values gathered whole on every device (the default) or passed round a ring (``ring=True``).
On a CPU the devices are simulated (``--xla_force_host_platform_device_count``); on a machine
with accelerators the mesh is its devices. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored off the CPU)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--key-heads", type=int, nargs="+", default=[2, 8], help="key/value heads K (N = 8)")
    args = parser.parse_args(argv)
    if "jax" in sys.modules:
        raise RuntimeError("run this benchmark in its own process: it sets the device count before jax starts")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from posenc_jax.functional import dot_product_attention, sequence_parallel_attention

    mesh = Mesh(np.asarray(jax.devices()), ("sequence",))
    devices = mesh.devices.size
    num_heads, head_dim = 8, 64

    def per_device_bytes(attention, length, key_heads, split):
        sharding = NamedSharding(mesh, P(None, "sequence")) if split else None
        shapes = [
            jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.float32, sharding=sharding)
            for heads in (num_heads, key_heads, key_heads)
        ]
        positions = jnp.arange(length)
        kwargs = dict(query_positions=positions, key_positions=positions, encodings=["rope", "alibi"], causal=True)
        compiled = jax.jit(lambda q, k, v: attention(q, k, v, **kwargs)).lower(*shapes).compile()
        analysis = compiled.memory_analysis()
        return analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes

    def one(q, k, v, **kwargs):
        return dot_product_attention(q, k, v, implementation="blockwise", **kwargs)

    def gathered(q, k, v, **kwargs):
        return sequence_parallel_attention(q, k, v, mesh=mesh, **kwargs)

    def ring(q, k, v, **kwargs):
        return sequence_parallel_attention(q, k, v, mesh=mesh, ring=True, **kwargs)

    mib = 2**20
    print(f"{devices} devices ({jax.devices()[0].platform}), jax {jax.__version__}")
    print()
    print("| T = S | key/value heads | one device | gathered, per device | ratio | ring, per device | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        for key_heads in args.key_heads:
            alone = per_device_bytes(one, length, key_heads, split=False)
            split = [per_device_bytes(f, length, key_heads, split=True) for f in (gathered, ring)]
            cells = [f"{alone / mib:,.0f} MiB"] + [f"{part / mib:,.0f} MiB | {part / alone:.2f}" for part in split]
            print(f"| {length:,} | {key_heads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
