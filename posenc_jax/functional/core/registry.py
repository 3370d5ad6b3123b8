"""Encodings by name: the registry, and the metadata each encoding registers with.

Each encoding registers itself where it is defined::

    @register_encoding(
        "t5", description="...", source=Source(...), small_settings=dict(num_buckets=8),
        hook=T5Bias, hooks=("logits",), tiled=("distance",), cached=(), prepared="bias",
    )
    @pytree_dataclass
    class T5Config(EncodingConfig):
        ...

``encoding_config("t5", num_buckets=64)`` then returns a frozen config with ``init``
(its parameters) and ``build`` (its hook object), ``encoding_names()`` lists every name,
and ``encoding_info("t5")`` says what it is, where it acts, and where it comes from. The
hooks it fills (``hooks``) and its forms (``tiled``, ``cached``, ``prepared``, ``fused``:
:mod:`posenc_jax.functional.core.forms`) are checked against the hook class when it registers: a
declared hook or form it does not define, or one it defines and does not declare, is an error
naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax

from posenc_jax.functional.core.forms import Forms, class_facts, declare_facts, declare_forms, forms_of
from posenc_jax.functional.core.hooks import PLACEMENTS, EncodingConfig, hook_names

__all__ = [
    "EncodingInfo",
    "Source",
    "carries_encodings",
    "encoding_config",
    "encoding_info",
    "encoding_names",
    "encoding_labels",
    "register_encoding",
    "resolve_encoding",
    "resolve_encodings",
]

FORMS = ("causal", "bidirectional")
_UNDECLARED = object()


@dataclasses.dataclass(frozen=True)
class Source:
    """Where an encoding comes from: the paper, and a BibTeX entry to cite it by."""

    title: str
    authors: str
    year: int
    arxiv: str | None
    bibtex: str

    @classmethod
    def paper(
        cls, key: str, *, title: str, authors: str, year: int, arxiv: str | None = None, venue: str | None = None
    ) -> Source:
        """A source whose BibTeX entry is made from its fields (``authors`` as BibTeX writes them,
        ``" and "``-separated)."""
        lines = [f"  title = {{{title}}}", f"  author = {{{authors}}}", f"  year = {{{year}}}"]
        if venue:
            lines.append(f"  journal = {{{venue}}}")
        if arxiv:
            lines += [f"  eprint = {{{arxiv}}}", "  archivePrefix = {arXiv}"]
        bibtex = f"@article{{{key},\n" + ",\n".join(lines) + "\n}"
        return cls(title=title, authors=authors, year=year, arxiv=arxiv, bibtex=bibtex)


@dataclasses.dataclass(frozen=True)
class EncodingInfo:
    """What ``encoding_info(name)`` tells about a registered encoding.

    Attributes:
      name: the registered name.
      description: one line.
      acts_on: ``"embeddings"``, ``"positions"``, ``"attention"``, ``"shared_bias"``
        (a position-only bias shared by all layers) or ``"normalizer"``.
      hooks: the hooks its built object fills (``("rotate",)``, ``("logits", "values")``, ...), as
        its hook class declared them.
      forms: ``("causal", "bidirectional")`` when it has both forms (it then follows the
        attention's ``causal`` unless set), or the one form it is defined for. ``("causal",)``
        declares the encoding causal-only, for its hook class and its config alike (the fact
        ``causal_only``, :mod:`posenc_jax.functional.core.forms`), and bidirectional attention
        and models refuse it by name.
      kv_cache: whether decoding with a KV cache gives the logits of the full forward.
      length_dependent: whether it reads the sequence length (``max(position) + 1``).
      blockwise: whether blockwise attention can compute it tile by tile (read off the
        built hook: False only for a ``MaterializeOnly`` hook).
      settings: the names ``encoding_config(name, ...)`` accepts.
      required: those of them without a default.
      small_settings: settings for a tiny model (head dim 8, up to 16 tokens) that
        exercise every branch; the tests use them.
      source: the paper.
    """

    name: str
    description: str
    acts_on: str
    hooks: tuple[str, ...]
    forms: tuple[str, ...]
    kv_cache: bool
    length_dependent: bool
    blockwise: bool
    settings: tuple[str, ...]
    required: tuple[str, ...]
    small_settings: Mapping
    source: Source


@dataclasses.dataclass(frozen=True)
class _Entry:
    """How to make the config, and the metadata given at registration (the rest is read off the code)."""

    factory: Callable
    config_type: type
    metadata: dict  # the EncodingInfo fields given to register_encoding


_REGISTRY: dict[str, _Entry] = {}


def dataclass_settings(config_type: type, fixed: Mapping = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A dataclass's settings (its init fields less ``fixed``) and the required ones among them."""
    fields = [f for f in dataclasses.fields(config_type) if f.init and f.name not in fixed]
    missing = dataclasses.MISSING
    required = [f.name for f in fields if f.default is missing and f.default_factory is missing]
    return tuple(f.name for f in fields), tuple(required)


def register_encoding(
    name: str,
    *,
    description: str,
    source: Source,
    forms: tuple[str, ...] = FORMS,
    kv_cache: bool = True,
    length_dependent: bool = False,
    small_settings: Mapping | None = None,
    fixed: Mapping | None = None,
    factory: Callable | None = None,
    settings: tuple[str, ...] | None = None,
    required: tuple[str, ...] = (),
    hook: type | None = None,
    hooks: tuple[str, ...] | object = _UNDECLARED,
    tiled: tuple[str, ...] | None | object = _UNDECLARED,
    cached: tuple[str, ...] | object = _UNDECLARED,
    prepared: str | None | object = _UNDECLARED,
    fused: tuple[str, ...] = (),
    scale: str | None = None,
):
    """Registers an encoding config class under ``name`` (a class decorator).

    Args:
      name: the name users pass to ``encoding_config``, models and the benchmark.
      description, source, forms, kv_cache, length_dependent, small_settings:
        the metadata (see :class:`EncodingInfo`); ``forms=("causal",)`` declares the encoding
        causal-only, which a hook class or config whose base says otherwise contradicts (an error
        naming the form).
      fixed: settings this name fixes (``kerple-log`` fixes ``variant="log"``); they are
        not among the name's settings.
      factory: ``factory(**settings) -> config`` when the name is not the class itself
        (the RoPE scalings); then ``settings`` lists what it accepts and ``required`` what
        it cannot do without.
      hook: the class of the hook ``build`` returns (a parameter-free encoding is its own
        hook: then leave it out).
      hooks: the hooks that class fills (``("rotate",)``, ``("logits", "values")``; ``()`` for
        none): the attention calls exactly these.
      tiled, cached, prepared, fused, scale: the hook's declared forms
        (:class:`~posenc_jax.functional.core.forms.Forms`); ``hooks``, ``tiled``, ``cached`` and
        ``prepared`` are required (``()`` or None where the hook has none of the group).
    """
    fixed = dict(fixed or {})
    if not set(forms) <= set(FORMS) or not forms:
        raise ValueError(f"forms must be a non-empty subset of {FORMS}, got {forms!r}")
    groups = dict(hooks=hooks, tiled=tiled, cached=cached, prepared=prepared)
    missing = [group for group, value in groups.items() if value is _UNDECLARED]
    if missing:
        some = "some of its hooks and forms but not" if len(missing) < len(groups) else "none of its hooks and forms:"
        raise ValueError(
            f"register_encoding({name!r}) declares {some} {', '.join(missing)}: declare "
            f"{', '.join(f'{group}=' for group in missing)} too (() or None where the hook has none; the hooks and "
            f"forms are listed in posenc_jax.functional.core.forms)"
        )
    causal_only = tuple(forms) == ("causal",)
    declared = Forms(
        hooks=hooks, tiled=tiled, cached=cached, prepared=prepared, fused=fused, scale=scale, causal_only=causal_only
    )

    def add(config_type):
        if name in _REGISTRY:
            raise ValueError(f"encoding name {name!r} is already registered")
        if not (isinstance(config_type, type) and issubclass(config_type, EncodingConfig)):
            raise TypeError(f"register_encoding({name!r}) decorates an EncodingConfig subclass, got {config_type!r}")
        if config_type.acts_on not in PLACEMENTS:
            raise ValueError(f"{config_type.__name__}.acts_on must be one of {PLACEMENTS}, got {config_type.acts_on!r}")
        hook_type = hook if hook is not None else config_type
        if hook is None and not class_facts(config_type).get("builds_itself"):
            raise ValueError(
                f"register_encoding({name!r}): {config_type.__name__} builds a hook of another class; pass hook= (the "
                f"class its build returns) so its forms can be checked"
            )
        _check_causal_only(name, forms, hook_type, config_type)
        declare_forms(hook_type, declared, name=name)
        declare_facts(config_type, causal_only=causal_only)
        make = factory if factory is not None else functools.partial(config_type, **fixed) if fixed else config_type
        names, needed = (
            (tuple(settings), tuple(required)) if factory is not None else dataclass_settings(config_type, fixed)
        )
        metadata = dict(
            settings=names,
            required=needed,
            description=description,
            source=source,
            forms=tuple(forms),
            kv_cache=kv_cache,
            length_dependent=length_dependent,
            small_settings=dict(small_settings or {}),
        )
        _REGISTRY[name] = _Entry(factory=make, config_type=config_type, metadata=metadata)
        return config_type

    return add


def _check_causal_only(name: str, forms: tuple[str, ...], hook_type: type, config_type: type) -> None:
    """Raises a ValueError naming the form ``causal`` where ``forms`` and what the hook class or the config
    class already declares (a base's fact, an earlier declaration) disagree on being causal-only."""
    causal_only = tuple(forms) == ("causal",)
    for cls in dict.fromkeys((hook_type, config_type)):
        said = class_facts(cls).get("causal_only")
        previous = cls.__dict__.get("_declared_forms")
        said = previous.causal_only if said is None and previous is not None else said
        if said is not None and said != causal_only:
            want = "forms=('causal',)" if said else "forms=('causal', 'bidirectional') (the default)"
            raise ValueError(
                f"register_encoding({name!r}) declares forms={tuple(forms)!r}, but {cls.__name__} is declared "
                f"{'causal-only' if said else 'with a bidirectional form'} (the form 'causal' "
                f"{'alone' if said else 'and bidirectional'}): the hook and its config must agree; declare {want}"
            )


def encoding_names() -> list[str]:
    """The registered encoding names, sorted."""
    return sorted(_REGISTRY)


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown encoding {name!r}; known encodings: {', '.join(encoding_names())}")
    return _REGISTRY[name]


def encoding_config(name: str, **settings) -> EncodingConfig:
    """The config registered as ``name``, with ``settings`` for its fields.

    Example:
      >>> encoding_config("alibi")
      ALiBi(bidirectional=None)
      >>> encoding_config("rope-pi", factor=4.0).scaling
      LinearScaling(factor=4.0)
    """
    entry = _entry(name)
    accepted = entry.metadata["settings"]
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(f"bad settings {unknown} for encoding {name!r}; its settings are {list(accepted)}")
    missing = [name for name in entry.metadata["required"] if name not in settings]
    if missing:
        given = "".join(f", {key}={value!r}" for key, value in settings.items())
        needed = "".join(f", {key}=..." for key in missing)
        raise ValueError(
            f"encoding {name!r} needs the settings {missing}, which have no default: make its config with "
            f"encoding_config({name!r}{given}{needed}) and pass that"
        )
    try:
        return entry.factory(**settings)
    except TypeError as error:
        raise ValueError(
            f"bad settings {settings} for encoding {name!r} (its settings: {list(accepted)}): {error}"
        ) from None


def resolve_encoding(encoding):
    """The config registered as ``encoding`` when it is a name, else ``encoding`` as it is (a config or a hook).

    One encoding; :func:`resolve_encodings` reads every way of naming several.

    Example:
      >>> resolve_encoding("rope")
      RoPE(base=10000.0, rotary_dim=None, layout='interleaved', scaling=None)
    """
    return encoding_config(encoding) if isinstance(encoding, str) else encoding


# The classes of objects that carry encodings (carries_encodings), each with how to read them.
_CARRIERS: dict[type, Callable] = {}


def carries_encodings(cls: type | None = None, *, read: Callable = lambda carrier: tuple(carrier.encodings)):
    """Declares ``cls`` a class whose objects carry encodings (a class decorator; ``read(obj)``: the
    encodings, by default its ``encodings`` field): :func:`resolve_encodings` and everything that takes
    encodings then read them from such an object (``posenc_jax.hf.HFEncoding``, ``from_hf_config``'s result)."""

    def add(carrier: type) -> type:
        if not isinstance(carrier, type):
            raise TypeError(f"carries_encodings decorates a class, got {carrier!r}")
        _CARRIERS[carrier] = read
        return carrier

    return add if cls is None else add(cls)


def resolve_encodings(encodings) -> list:
    """Encodings as the attention, the modules and the benchmark take them, as a list of configs and hooks.

    The one reading of every way to name them: a registered name (``"rope"``, one name, never
    its characters), names joined by ``+`` (``"rope+alibi"``), a config or a built hook, an
    object that carries its encodings (``from_hf_config``'s result), or a list or tuple of any
    of these (``["rope", "alibi"]``, ``["rope+alibi", T5Bias(table)]``); ``None`` or ``()``
    for none. An unknown name is an error listing the known ones.

    Example:
      >>> [type(e).__name__ for e in resolve_encodings("rope+alibi")]
      ['RoPE', 'ALiBi']
      >>> [type(e).__name__ for e in resolve_encodings(["rope", encoding_config("alibi")])]
      ['RoPE', 'ALiBi']
    """
    if encodings is None:
        return []
    read = next((_CARRIERS[c] for c in type(encodings).__mro__ if c in _CARRIERS), None)
    if read is not None:
        encodings = read(encodings)  # e.g. posenc_jax.hf.HFEncoding
    if isinstance(encodings, (str, EncodingConfig)) or not isinstance(encodings, Sequence):
        encodings = [encodings]
    resolved = []
    for encoding in encodings:
        if isinstance(encoding, str):
            parts = [part.strip() for part in encoding.split("+")]
            if not all(parts):
                raise ValueError(
                    f"bad encoding name {encoding!r}: join registered names with '+', e.g. 'rope+alibi'; "
                    f"known encodings: {', '.join(encoding_names())}"
                )
            resolved.extend(encoding_config(part) for part in parts)
        elif isinstance(encoding, Sequence):
            raise TypeError(f"encodings nest one list deep: got {encoding!r} inside a list; flatten it")
        else:
            resolved.append(encoding)
    return resolved


def encoding_labels(encodings) -> tuple[str, ...]:
    """The benchmark's encodings as labels: each a registered name or names joined by ``+``.

    A bare string is one label (``"rope+alibi"``: one hybrid cell), a list or tuple one
    label each; every name is checked as :func:`resolve_encodings` checks it.

    Example:
      >>> encoding_labels("rope"), encoding_labels(["rope", "rope + alibi"])
      (('rope',), ('rope', 'rope+alibi'))
    """
    labels = [encodings] if isinstance(encodings, str) else encodings
    if not isinstance(labels, (list, tuple)) or not all(isinstance(label, str) for label in labels):
        raise TypeError(
            f"the benchmark names its encodings: a name, 'a+b', or a list of them (e.g. ['rope', 'rope+alibi']), "
            f"got {encodings!r}"
        )
    for label in labels:
        resolve_encodings(label)
    return tuple("+".join(part.strip() for part in label.split("+")) for label in labels)


@functools.cache
def encoding_info(name: str) -> EncodingInfo:
    """The metadata of the encoding registered as ``name``.

    Example:
      >>> info = encoding_info("t5")
      >>> info.acts_on, info.hooks, info.forms, info.source.arxiv
      ('shared_bias', ('logits',), ('causal', 'bidirectional'), '1910.10683')
    """
    entry = _entry(name)
    # Where it acts and which hooks it fills are read off the code (the hooks off a tiny built
    # instance, traced abstractly: nothing is computed), so they cannot drift from it.
    config = entry.factory(**entry.metadata["small_settings"])
    read = {}

    def build(key):
        hook = config.build(config.init(key, num_heads=2, head_dim=8, model_dim=16))
        read.update(hooks=hook_names(hook), blockwise=forms_of(hook).tiled is not None)

    jax.eval_shape(build, jax.random.key(0))
    return EncodingInfo(name=name, acts_on=entry.config_type.acts_on, **read, **entry.metadata)
