"""Fast forms, of operations the encodings share and of one encoding's terms: same values as their
plain forms, other programs.

Each module says which backends it is for and keeps the plain form beside it; a test holds
the two equal. A module here may import ``core`` but never an encoding: an encoding calls its
kernel through one named function and hands it what the kernel needs of its mathematics.
Core never imports a kernel: importing this package registers the forms of core's operations
(:class:`~posenc_jax.functional.core.operations.Operation`) that the modules here implement.
"""

from posenc_jax.functional.kernels import (
    broadcast,
    cope,
    cudnn,
    fire,
    pallas_dispatch,
    relative,
    relative_tiles,
    row_blocks,
    transformer_xl,
)

__all__ = [
    "broadcast",
    "cope",
    "cudnn",
    "fire",
    "pallas_dispatch",
    "relative",
    "relative_tiles",
    "row_blocks",
    "transformer_xl",
]
