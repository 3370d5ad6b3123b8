"""Shared pieces of the tests of a logits term's fast forms (``add_logits``, ``score_features``):
the reference way of adding a term, and the compiled temporary memory of causal attention."""

import dataclasses

import jax
import jax.numpy as jnp
from compiled import compiled

from posenc_jax.functional import Forms, declare_forms, dot_product_attention

HEADS, HEAD_DIM = 4, 16


@dataclasses.dataclass(frozen=True)
class TermOnly:
    """A hook with only ``logits``: the reference way of adding a hook's term to the scores."""

    hook: object

    def logits(self, q, k, context):
        return self.hook.logits(q, k, context)


declare_forms(TermOnly, Forms(hooks=("logits",)))


def score_buffer_bytes(length: int) -> int:
    """Bytes of one float32 ``[1, HEADS, length, length]`` score buffer."""
    return HEADS * length * length * 4


def causal_attention_temp(make_hooks, length: int) -> int:
    """Compiled temporary bytes of causal materialised attention (``implementation="materialize"``, the
    path that builds the scores, whatever ``auto`` would pick) on ``[1, length, HEADS, HEAD_DIM]`` q, k, v
    with the hooks ``make_hooks()`` builds (inside the compiled function, as in a model). The positions
    are an argument, as a model's are: run-time checks on them stay in the program, where a constant
    would let XLA fold them away (and with them, say, a conditional's copy of the scores)."""
    spec = jax.ShapeDtypeStruct((1, length, HEADS, HEAD_DIM), jnp.float32)
    positions = jax.ShapeDtypeStruct((length,), jnp.int32)

    def attend(q, k, v, pos):
        hooks = make_hooks()
        return dot_product_attention(
            q,
            k,
            v,
            query_positions=pos,
            key_positions=pos,
            encodings=hooks,
            causal=True,
            implementation="materialize",
        )

    return compiled(jax.jit(attend).lower(spec, spec, spec, positions)).memory_analysis().temp_size_in_bytes


def materialised_backward_temp(hooks, length: int, heads: int, dim: int) -> int:
    """Temporary bytes of causal materialised attention's forward and backward (gradients of q, k, v and
    the hooks' parameters) at ``[1, length, heads, dim]``, over positions ``arange(length)``."""
    spec = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.float32)
    positions = jnp.arange(length)

    def loss(q, k, v, hooks):
        out = dot_product_attention(
            q, k, v, query_positions=positions, key_positions=positions, encodings=hooks, causal=True,
            implementation="materialize",
        )  # fmt: skip
        return out.sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return compiled(grad.lower(spec, spec, spec, hooks)).memory_analysis().temp_size_in_bytes
