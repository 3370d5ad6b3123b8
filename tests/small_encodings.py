"""Tiny-size configs of every registered encoding, from each encoding's own registration
(``encoding_info(name).small_settings``: head dim 8, a handful of tokens)."""

from posenc_jax.functional import encoding_config, encoding_info


def small_config(name: str, **extra):
    """The registered config ``name`` with its tiny-size settings (and ``extra`` on top)."""
    return encoding_config(name, **{**encoding_info(name).small_settings, **extra})


# RoPE's static scalings reach the attention as numbers only (inverse frequencies and an attention factor),
# along one path: tests that follow each encoding through a path (tiles, decoding) run YaRN, whose factor is
# not 1, for all of them; their numbers are checked against their definitions in test_rope.py.
SAME_PATH_AS_YARN = ("rope-pi", "rope-ntk", "rope-llama3")


def one_per_path(names):
    """``names`` less the RoPE scalings that take YaRN's path (:data:`SAME_PATH_AS_YARN`)."""
    names = list(names)
    assert "rope-yarn" in names or not set(SAME_PATH_AS_YARN) & set(names), names
    return [name for name in names if name not in SAME_PATH_AS_YARN]


def causal_settings(name: str) -> list[bool]:
    """The ``causal`` values a per-encoding test runs ``name`` at: each form it has, less the bidirectional
    form of a rotation other than RoPE (a rotation reads no mask: its bidirectional path is RoPE's, and
    unmasked tiles are NoPE's)."""
    info = encoding_info(name)
    rotation = set(info.hooks) == {"rotate"} and name != "rope"
    return [
        causal
        for causal in (True, False)
        if ("causal" if causal else "bidirectional") in info.forms and (causal or not rotation)
    ]
