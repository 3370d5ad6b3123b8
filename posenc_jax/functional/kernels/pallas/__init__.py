"""Flash attention in Pallas with the position bias computed inside the kernel, per tile.

The bias of a tile comes from the encoding's per-head form
(:class:`~posenc_jax.functional.core.head_bias.HeadBias`, the tiled form ``head``), the same
function the materialising and blockwise paths compute the bias with: the kernel calls it on each
tile's query positions ``[bq, 1]``, key positions ``[1, bk]`` and the head's parameter rows, and
its backward kernel pulls the tile's score cotangent back through it (``jax.vjp``) for the
parameters' gradient (T5's and the clipped bias's tables, Kerple's ``r1``, ``r2``, FIRE's MLP, ``c``
and ``L``). No ``[T, S]`` array is built. The encodings: ALiBi, T5, Kerple (log, power), Sandwich,
the learned clipped bias and FIRE, and sums of them.

What a tile's bias costs beside its ``q kᵀ`` (per score, forward; each backward kernel evaluates
it again, and the key-tile kernel also pulls its cotangent back): ALiBi and Kerple a few
elementwise operations; T5 one selection per bucket; the clipped bias ``2k`` selections (a tree on
the bits of the clipped distance, :func:`~posenc_jax.functional.core.head_bias.head_select`);
FIRE about five operations per hidden unit; Sandwich one ``[bq, W] × [W, bk]`` product at full
float32 precision (``W`` its sinusoid width d̄ rounded up to a power of two >= 16) and the tiles'
phase tables, ``O((bq + bk) · W)``. These are operation counts, not measurements.

Backends: on the CPU the kernels run in Pallas' interpret mode (chosen in one place,
:func:`~posenc_jax.functional.kernels.pallas.backend.interpret_mode`); on a GPU they lower through
Triton, on a TPU through Mosaic. Lowering for both is tested on the CPU (``jax.export`` for
``platforms=["cuda"]`` and ``["tpu"]``); lowering is not compiling: Triton and Mosaic compile on
the device only, and no accelerator has run these kernels yet.

Structure (one kernel form for both backends): the forward and ``dq`` kernels run a grid
``(B, N, T / bq)`` and walk the key tiles of their key/value head in a loop; the ``dk``/``dv``
kernel runs ``(B, N, S / bk)`` and walks the query tiles. Each program reads the whole sequence
it walks as one block, so on a TPU, where a block lives in VMEM, the length is bounded by VMEM
(a grid over the walked tiles with scratch accumulators would lift that). Causal attention visits
every key tile, masked by position (positions may be any integers, so no tile is skipped by its
index). ``dk`` and ``dv`` are written per query head, float32, and summed over each group
outside; the parameters' partial gradients ``[B, N, S / bk, 1, P]`` are summed outside too.

The kernels are written against jax 0.10's Pallas API (the tests skip on older jax);
``dot_product_attention`` selects them with ``implementation="pallas"`` (opt-in).
"""

from posenc_jax.functional.kernels.pallas.attention import DEFAULT_BLOCK, flash_attention, joined_head_bias
from posenc_jax.functional.kernels.pallas.backend import interpret_mode

__all__ = ["DEFAULT_BLOCK", "flash_attention", "interpret_mode", "joined_head_bias"]
