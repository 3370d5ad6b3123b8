"""No positional encoding (NoPE), as an explicit choice (Kazemnejad et al. 2023)."""

from __future__ import annotations

from posenc_jax.functional.core.hooks import ParameterFree, pytree_dataclass
from posenc_jax.functional.core.registry import Source, register_encoding

__all__ = ["NoPE"]

NOPE = Source.paper(
    "kazemnejad2023impact",
    title="The Impact of Positional Encoding on Length Generalization in Transformers",
    authors="Kazemnejad, Amirhossein and Padhi, Inkit and Natesan Ramamurthy, Karthikeyan and Das, Payel and "
    "Reddy, Siva",
    year=2023,
    arxiv="2305.19466",
)


@register_encoding(
    "nope",
    description="No positional encoding, as an explicit choice; a causal mask still lets a decoder infer positions.",
    source=NOPE,
    hooks=(),
    tiled=(),
    cached=(),
    prepared=None,
)
@pytree_dataclass
class NoPE(ParameterFree):
    """No positional encoding, as an explicit choice (Kazemnejad et al. 2023, arXiv:2305.19466).

    It fills no hook: a model or an attention given NoPE adds nothing anywhere. With a
    causal mask a decoder can still infer positions; a bidirectional encoder cannot.

    Example:
      >>> from posenc_jax.functional import dot_product_attention, hook_names
      >>> hook_names(NoPE())
      ()
      >>> x = jnp.ones((1, 3, 2, 4)); pos = jnp.arange(3)
      >>> dot_product_attention(x, x, x, query_positions=pos, key_positions=pos, encodings=[NoPE()]).shape
      (1, 3, 2, 4)
    """
