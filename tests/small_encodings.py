"""Tiny-size configs of every registered encoding, from each encoding's own registration
(``encoding_info(name).small_settings``: head dim 8, a handful of tokens)."""

from posenc_jax.functional import encoding_config, encoding_info


def small_config(name: str, **extra):
    """The registered config ``name`` with its tiny-size settings (and ``extra`` on top)."""
    return encoding_config(name, **{**encoding_info(name).small_settings, **extra})
