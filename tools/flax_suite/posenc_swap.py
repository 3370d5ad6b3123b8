"""A pytest plugin that makes posenc_jax's attention function Flax's default, for running Flax's
own attention tests against it (tools/run_flax_attention_tests.py loads it with ``-p posenc_swap``).

Every place Flax keeps its ``dot_product_attention`` (``flax.nnx.dot_product_attention``,
``flax.linen.dot_product_attention``, the modules' ``attention_fn`` defaults) gets
``posenc_jax.nn.make_attention_fn(encoding)``, ``encoding`` from ``POSENC_FLAX_SUITE_ENCODING``
(default ``nope``). Flax's own function is made to raise, so a test that reached it would fail,
and the number of calls of ours is printed at the end (a run that never called it proves nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

ENCODING = os.environ.get("POSENC_FLAX_SUITE_ENCODING", "nope")
CALLS = {"posenc": 0}


def _ours():
    from posenc_jax.nn.flax_attention import make_attention_fn

    attention_fn = make_attention_fn(ENCODING)

    @functools.wraps(attention_fn)  # keeps the signature: Linen passes only the arguments it names
    def counted(*args, **kwargs):
        CALLS["posenc"] += 1
        return attention_fn(*args, **kwargs)

    return counted


def _refused(*args, **kwargs):
    raise AssertionError("flax's own dot_product_attention was called while posenc_jax's is the default")


def _swap(old: dict, new) -> int:
    """Replaces every reference to one of ``old`` in flax's modules, functions' defaults and dataclass fields."""
    swapped = 0

    def swap_defaults(function) -> None:
        nonlocal swapped
        function = getattr(function, "__func__", function)
        wrapped = getattr(function, "__wrapped__", None)  # Linen wraps its dataclasses' __init__
        if wrapped is not None and wrapped is not function:
            swap_defaults(wrapped)
        if getattr(function, "__defaults__", None) and any(id(d) in old for d in function.__defaults__):
            function.__defaults__ = tuple(new if id(d) in old else d for d in function.__defaults__)
            swapped += 1
        if getattr(function, "__kwdefaults__", None):
            for name, value in function.__kwdefaults__.items():
                if id(value) in old:
                    function.__kwdefaults__[name] = new
                    swapped += 1

    for name, module in list(sys.modules.items()):
        if not name.startswith("flax") or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in old:
                setattr(module, attribute, new)
                swapped += 1
            elif isinstance(value, type) and value.__module__.startswith("flax"):
                swap_defaults(value.__init__)
                for field in getattr(value, "__dataclass_fields__", {}).values():
                    if id(field.default) in old:
                        field.default = new
                        swapped += 1
                if id(value.__dict__.get("attention_fn")) in old:
                    value.attention_fn = new
                    swapped += 1
    return swapped


def pytest_configure(config):
    import flax.linen.attention as linen_attention
    import flax.nnx.nn.attention as nnx_attention

    if ENCODING == "flax":  # stock Flax, for the count to compare with
        return
    old = {id(f): f for f in (nnx_attention.dot_product_attention, linen_attention.dot_product_attention)}
    ours = _ours()
    swapped = _swap(old, ours)
    if not swapped:
        raise RuntimeError("found no reference to flax's dot_product_attention to swap")
    # Flax's functions themselves now raise, should anything still hold them.
    for function in old.values():
        function.__code__ = _refused.__code__
    assert not dataclasses.is_dataclass(ours)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"posenc_swap: encoding {ENCODING!r}; posenc_jax's attention_fn was called {CALLS['posenc']} times"
    )
