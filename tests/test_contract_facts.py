"""The encoding contract's facts (issue 54): what an encoding can or cannot do is declared (causal-only,
repeatable, softmax, its own hook) and read from the declaration, never found by a class test or an
attribute probe; a registration whose hook class and config disagree, or that omits what one of them
declares, fails naming the form."""

import ast
import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest

import posenc_jax
from posenc_jax.functional import (
    ALiBi,
    BiasHook,
    ParameterFree,
    SharedBias,
    dot_product_attention,
    encoding_config,
    encoding_info,
    encoding_names,
    pytree_dataclass,
    register_encoding,
)
from posenc_jax.functional.core import registry
from posenc_jax.functional.core.forms import Forms, declare_forms, declares
from posenc_jax.functional.core.hooks import CausalOnly, EncodingConfig, MaterializeOnly, check_together
from posenc_jax.functional.core.normalizers import as_normalizer
from posenc_jax.functional.core.registry import carries_encodings, resolve_encodings

PACKAGE = pathlib.Path(posenc_jax.__file__).parent
# The capabilities the code once found by a class test, and the marker attributes it once probed.
CAPABILITY_CLASSES = {"CausalOnly", "MaterializeOnly", "ParameterFree", "SharedBias", "Softmax"}
CAPABILITY_ATTRIBUTES = {"_materialize_only", "_checks_sizes", "encodings", "_causal_only", "causal_only"}
_SOURCE = registry.Source.paper("test", title="A test encoding", authors="Nobody", year=2024, arxiv="2401.00001")
_DECLARE = dict(description="d", source=_SOURCE, hooks=("logits",), tiled=None, cached=(), prepared=None)


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    yield
    encoding_info.cache_clear()


def _names(node) -> set[str]:
    """The class names an isinstance/issubclass second argument mentions (a name, a.b, or a tuple of them)."""
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(element) for element in node.elts))
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return {node.id} if isinstance(node, ast.Name) else set()


def _capability_checks(path: pathlib.Path) -> tuple[list[str], int]:
    """The class tests and attribute probes against a capability in ``path``, and how many such calls it has."""
    found, calls = [], 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in {"_materialize_only", "_checks_sizes"}:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        name, second = node.func.id, node.args[1]
        if name in ("isinstance", "issubclass"):
            calls += 1
            hit = _names(second) & CAPABILITY_CLASSES
        elif name in ("getattr", "hasattr"):
            calls += 1
            hit = {second.value} & CAPABILITY_ATTRIBUTES if isinstance(second, ast.Constant) else set()
        else:
            continue
        if hit:
            found.append(f"{path.name}:{node.lineno}: {name}(..., {sorted(hit)[0]})")
    return found, calls


def test_no_capability_is_found_by_a_class_test_or_an_attribute_probe():
    """In functional/ (and the Flax attention_fn, which reads the same fact) a capability is read from the
    declaration: no isinstance/issubclass against a capability's class, no getattr/hasattr of its marker."""
    paths = sorted((PACKAGE / "functional").rglob("*.py")) + [PACKAGE / "nn" / "flax_attention.py"]
    found, calls = [], 0
    for path in paths:
        more, counted = _capability_checks(path)
        found += more
        calls += counted
    assert calls > 50, f"only {calls} isinstance/getattr calls found in {len(paths)} files: the walk is broken"
    assert not found, f"capabilities found by class tests or probes, not declarations: {found}"


def test_the_walk_finds_a_class_test_and_a_probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("isinstance(e, (str, CausalOnly))\ngetattr(init, '_checks_sizes', False)\nf._materialize_only\n")
    found, calls = _capability_checks(path)
    assert calls == 2 and len(found) == 3, found


def _bias_hook(name: str):
    @pytree_dataclass
    class Hook:
        def logits(self, q, k, context):
            return jnp.zeros((1, 1, 1, 1), jnp.float32)

    Hook.__name__ = Hook.__qualname__ = name
    return Hook


def _config(name: str, hook: type, *bases):
    @pytree_dataclass
    class Config(*bases, EncodingConfig):
        def init(self, key, *, num_heads, head_dim, model_dim):
            return {}

        def build(self, params):
            return hook()

    Config.__name__ = Config.__qualname__ = name
    return Config


def test_causal_only_is_declared_once_for_the_hook_and_its_config(scratch_registry):
    """``forms=("causal",)`` declares the hook class and its config causal-only: both are refused by
    bidirectional attention by name, and ``isinstance(x, CausalOnly)`` reads the declaration."""
    hook = _bias_hook("OneWayBias")
    config = register_encoding("test-one-way", forms=("causal",), hook=hook, **_DECLARE)(_config("OneWay", hook))
    assert encoding_info("test-one-way").forms == ("causal",)
    assert declares(hook(), "causal_only") and declares(config(), "causal_only")
    assert isinstance(hook(), CausalOnly) and isinstance(config(), CausalOnly)
    for encoding in (config(), hook()):
        with pytest.raises(ValueError, match=f"{type(encoding).__name__} is defined for causal attention only"):
            check_together([encoding], causal=False)
        check_together([encoding], causal=True)
    # The library's causal-only encodings, configs and hooks alike; the others have both forms.
    for name in ("xpos", "fire", "cope"):
        assert declares(encoding_config(name), "causal_only") and isinstance(encoding_config(name), CausalOnly)
    assert not declares(encoding_config("rope"), "causal_only") and not isinstance(ALiBi(), CausalOnly)


def test_a_registration_contradicting_the_hooks_causal_declaration_fails_naming_the_form(scratch_registry):
    """A hook class declared causal-only registered without ``forms=("causal",)`` (the form omitted), and one
    declared with a bidirectional form registered as causal-only: the hook and its config would disagree."""
    causal = declare_forms(_bias_hook("CausalBias"), Forms(hooks=("logits",), causal_only=True))
    with pytest.raises(
        ValueError,
        match=r"register_encoding\('test-omits'\) declares forms=\('causal', 'bidirectional'\), but CausalBias is "
        r"declared causal-only \(the form 'causal' alone\).*declare forms=\('causal',\)",
    ):
        register_encoding("test-omits", hook=causal, **_DECLARE)(_config("Omits", causal))
    both = declare_forms(_bias_hook("BothWaysBias"), Forms(hooks=("logits",)))
    with pytest.raises(
        ValueError, match=r"BothWaysBias is declared with a bidirectional form \(the form 'causal' and bidirectional\)"
    ):
        register_encoding("test-contradicts", forms=("causal",), hook=both, **_DECLARE)(_config("Contradicts", both))
    assert not {name for name in encoding_names() if name.startswith("test-")}
    # A second registration of one hook class that declares it otherwise names the differing fact.
    register_encoding("test-first", forms=("causal",), hook=causal, **_DECLARE)(_config("First", causal))
    with pytest.raises(ValueError, match=r"CausalBias is declared causal-only"):
        register_encoding("test-second", hook=causal, **_DECLARE)(_config("Second", causal))
    with pytest.raises(ValueError, match=r"they differ in causal_only"):
        declare_forms(causal, Forms(hooks=("logits",)))


def test_the_deprecated_causal_only_base_still_declares_and_is_checked_at_registration(scratch_registry):
    """A config (or hook) deriving from the deprecated ``CausalOnly`` warns, naming the declaration, and is
    still causal-only; registering it with a hook of both forms and without ``forms=("causal",)`` fails."""
    hook = _bias_hook("PlainBias")
    with pytest.warns(DeprecationWarning, match=r"CausalOnly, which is deprecated.*forms=\('causal',\)"):
        config = _config("OldStyle", hook, CausalOnly)
    assert declares(config(), "causal_only") and isinstance(config(), CausalOnly)
    with pytest.raises(ValueError, match=r"OldStyle is declared causal-only \(the form 'causal' alone\)"):
        register_encoding("test-old-style", hook=hook, **_DECLARE)(config)
    with pytest.warns(DeprecationWarning):
        old_hook = _bias_hook("Unused")
        old_hook = type("OldHook", (CausalOnly, old_hook), {})
    declare_forms(old_hook, Forms(hooks=("logits",)))
    assert declares(old_hook(), "causal_only")  # the base's fact, over a declaration that left it out
    with pytest.raises(ValueError, match=r"OldHook is defined for causal attention only"):
        check_together([old_hook()], causal=False)


def test_facts_are_booleans_and_known():
    with pytest.raises(TypeError, match=r"causal_only must be True or False, got 'yes'"):
        Forms(hooks=("logits",), causal_only="yes")
    with pytest.raises(ValueError, match=r"unknown fact 'fast'; the facts are"):
        declares(ALiBi(), "fast")


def test_repeatable_hooks_may_be_given_more_than_once():
    """A shared bias carries its own value, so several are several biases (declared ``repeatable``); two
    objects of any other class are one encoding given twice."""
    pos = jnp.arange(4)
    q = k = v = jnp.ones((1, 4, 2, 8))
    bias = SharedBias(jnp.zeros((1, 2, 4, 4)))
    assert declares(bias, "repeatable") and not declares(ALiBi(), "repeatable")
    check_together([bias, bias, ALiBi()], causal=False)
    out = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[bias, bias])
    assert out.shape == q.shape
    with pytest.raises(ValueError, match=r"ALiBi is given more than once"):
        check_together([ALiBi(), ALiBi()], causal=None)


def test_softmax_is_a_declared_fact_of_the_normalizer():
    assert declares(as_normalizer("softmax"), "softmax")
    assert not declares(as_normalizer("l2"), "softmax")
    assert not declares(as_normalizer(lambda scores, mask: scores), "softmax")


def test_a_config_is_its_own_hook_by_its_declaration(scratch_registry):
    """A parameter-free config is its own hook (its class declared its forms); one with learned parameters is
    refused by the attention, which does not hold them, by name."""
    pos = jnp.arange(4)
    q = k = v = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"has learned parameters, which dot_product_attention does not hold"):
        dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[encoding_config("t5")])
    hook = _bias_hook("Unregistered")
    with pytest.raises(ValueError, match=r"Unregistered builds a hook of another class; pass hook="):
        register_encoding("test-not-its-own", **_DECLARE)(_config("Unregistered", hook))

    @pytree_dataclass
    class Own(BiasHook, ParameterFree):
        def bias(self, context):
            return jnp.zeros((1, 1, 1, 1), jnp.float32)

    declare_forms(Own, Forms(hooks=("logits",), prepared="bias"))
    out = dot_product_attention(q, k, v, query_positions=pos, key_positions=pos, encodings=[Own()])
    assert out.shape == q.shape


def test_an_object_carrying_encodings_is_declared(scratch_registry):
    """``resolve_encodings`` reads the encodings of an object whose class declared it carries them
    (``carries_encodings``, as ``HFEncoding`` does); an undeclared object with an ``encodings`` field is
    not unpacked by guess, and is refused as a hook whose class declared nothing."""

    class Bundle:
        def __init__(self, encodings):
            self.encodings = encodings

    with pytest.raises(TypeError, match=r"Bundle declares no hooks"):
        check_together(resolve_encodings(Bundle(("rope", "alibi"))), causal=None)
    carries_encodings(Bundle, read=lambda bundle: list(bundle.encodings))
    try:
        assert [type(e).__name__ for e in resolve_encodings(Bundle(("rope", "alibi")))] == ["RoPE", "ALiBi"]
    finally:
        registry._CARRIERS.pop(Bundle)


def test_an_init_is_wrapped_with_the_size_check_once():
    """A config class made again from its namespace (as a slotted dataclass is) keeps the one checked init."""

    class Sized(EncodingConfig):
        def init(self, key, *, num_heads, head_dim, model_dim):
            return {}

    namespace = {k: v for k, v in Sized.__dict__.items() if k not in ("__dict__", "__weakref__")}
    again = type("Sized", (EncodingConfig,), namespace)
    assert again.init is Sized.init
    with pytest.raises(ValueError, match=r"num_heads"):
        Sized().init(jax.random.key(0), num_heads=0, head_dim=8, model_dim=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(encoding_config("xpos"), CausalOnly)  # reading the declaration warns of nothing
    assert not isinstance(ALiBi(), MaterializeOnly)
