"""Flash attention in Pallas with the position bias computed inside the kernel, per tile.

The bias of a tile comes from the encoding's per-head form
(:class:`~posenc_jax.functional.core.head_bias.HeadBias`, the tiled form ``head``), the same
function the materialising and blockwise paths compute the bias with: the kernel calls it on each
tile's query positions ``[bq, 1]``, key positions ``[1, bk]`` and the head's parameter rows, and
its backward kernel pulls the tile's score cotangent back through it (``jax.vjp``) for the
parameters' gradient (T5's table). No ``[T, S]`` array is built.

Backends: on the CPU the kernels run in Pallas' interpret mode (chosen in one place,
:func:`~posenc_jax.functional.kernels.pallas.backend.interpret_mode`); on a GPU they lower through
Triton, on a TPU through Mosaic. Lowering for both is tested on the CPU (``jax.export`` for
``platforms=["cuda"]`` and ``["tpu"]``); lowering is not compiling: Triton and Mosaic compile on
the device only, and no accelerator has run these kernels yet.

The kernels need jax >= 0.8 (the Pallas API they are written against); ``dot_product_attention``
selects them with ``implementation="pallas"`` (opt-in).
"""

from posenc_jax.functional.kernels.pallas.attention import DEFAULT_BLOCK, flash_attention, joined_head_bias
from posenc_jax.functional.kernels.pallas.backend import interpret_mode

__all__ = ["DEFAULT_BLOCK", "flash_attention", "interpret_mode", "joined_head_bias"]
