"""What a hook class declares: the hooks it fills, and its forms from a short closed list.

A hook (``rotate``, ``logits``, ``values``, ...: :data:`HOOKS`) says what an encoding computes; a
form says in which other shapes the attention may ask for it. Every registered encoding declares
its hooks and forms when it registers (:func:`~posenc_jax.functional.core.registry.register_encoding`),
and any other hook class with :func:`declare_forms` (``declare_forms(MyBias, Forms(hooks=("logits",)))``).
The declaration is checked against the class: a declared hook or form whose methods the class
lacks, or a hook or form whose methods it has but does not declare, is an error naming it. The
attention reads the declaration (:func:`forms_of`, :func:`~posenc_jax.functional.core.hooks.hook_names`),
never probes for a method; an object whose class declared nothing is refused where it enters.

==========  ====================  ======================================================  =========================
group       form                  methods                                                 encodings
==========  ====================  ======================================================  =========================
tiled       ``distance``          ``distance_bias(distance, context)``: a Toeplitz tile   T5, Kerple, clipped bias
            ``logits``            ``tile_logits(q, k, context)``                          Shaw, DeBERTa, FIRE
            ``head``              ``head_bias(context)``: one head's bias at positions    ALiBi, T5, Kerple,
                                                                                          Sandwich, clipped
                                                                                          bias, FIRE
            ``scores``            ``tile_scores(q, k, context, content)``                 Shaw, DeBERTa
            ``values``            ``tile_values(weights, context)``                       Shaw
            ``carried``           ``init_carry``, ``carried_logits``                      CoPE
            ``carried_from_       ``carried_logits_from_content``                         CoPE
            content``
            ``weights``           ``tile_init``, ``tile_weights``, ``tile_denominator``:  softmax, L2, relu², URPE
                                  a normaliser's online form
            ``per_call``          ``for_tiles(context, block_q, block_k)``: what every    Transformer-XL
                                  tile shares, computed once for the call
            ``per_query_block``   ``for_query_block(q, context)``: what a query block's   CoPE
                                  key tiles share, computed once for the block
cached      ``rotation``          ``rotates_per_token``: keys stored rotated when True    RoPE, axial RoPE
            ``rotation_about``    ``rotate_about(q, k, context, reference)``              xPos
            ``key_term``          ``key_features``, ``with_key_features``                 DeBERTa, Transformer-XL, ...
            ``table``             ``cache_table``, ``with_cache_table``                   Transformer-XL
            ``key_features``      ``map_key_features(fn)``                                DeBERTa, Transformer-XL
prepared    ``tables``            ``prepare(positions, head_dim)``                        RoPE
            ``bias``              ``bias(context)``: one bias for every layer             T5, ALiBi, Kerple, ...
scale       ``prescribed``        ``score_scale(head_dim)``: the content-score scale      DeBERTa, HF's fixed scale
fused       ``rows``              ``add_logits(scores, q, k, context)``                   FIRE, Transformer-XL, CoPE
            ``rows_from_content`` ``add_logits_to_content(content, q, k, context)``       Transformer-XL, CoPE
            ``features``          ``score_features(q, k, context)``                       functional relative
            ``per_call``          ``per_token_for(context)``                              RoPE, xPos
==========  ====================  ======================================================  =========================

Beside its forms, a class declares three facts (no methods go with them): ``causal_only`` (defined
for causal attention only: bidirectional attention and models refuse it by name; registration sets
it from ``forms=("causal",)`` for the hook class and its config alike), ``repeatable`` (several
objects of the class may be given to one attention: each carries its own value, as a
``SharedBias`` does) and ``softmax`` (a normaliser that is exactly softmax, which the fused kernels
compute themselves). :func:`declares` reads them; nothing tests a class or probes an attribute.

``tiled=None`` says the hook cannot be computed per tile (blockwise attention refuses it by
name, and ``implementation="auto"`` materialises); ``tiled=()`` that blockwise attention calls
its ``logits`` and ``values`` on each tile's context alone, which is right only for a term of
the tile's own queries and keys (a bias of positions, say; not CoPE's gates, which sum over
every key). A class that fills ``logits`` or ``values`` and does not say ``tiled`` is taken as
``tiled=None``: correct everywhere, materialised; declaring ``tiled=()`` opts in to the tiles.
A class filling neither (a rotation, an embedding) acts before the scores and has ``tiled=()``.

Example:
  >>> Forms(hooks=("logits",), tiled=("distance",), prepared="bias").methods()
  ('logits', 'distance_bias', 'bias')
"""

from __future__ import annotations

import dataclasses
import warnings

__all__ = [
    "CausalOnly",
    "FACTS",
    "MaterializeOnly",
    "FORMS",
    "HOOKS",
    "Forms",
    "check_declared",
    "class_facts",
    "declare_facts",
    "declare_forms",
    "declared_forms",
    "declares",
    "forms_of",
]

# The hooks, each a method of the same name, in the order of the design's table.
HOOKS: tuple[str, ...] = ("embed", "rotate", "logits", "values", "normalize", "sample")

# Each form of each group and the methods (or properties) a hook class declaring it defines.
FORMS: dict[str, dict[str, tuple[str, ...]]] = {
    "tiled": {
        "distance": ("distance_bias",),
        "logits": ("tile_logits",),
        "head": ("head_bias",),
        "scores": ("tile_scores",),
        "values": ("tile_values",),
        "carried": ("init_carry", "carried_logits"),
        "carried_from_content": ("carried_logits_from_content",),
        "weights": ("tile_init", "tile_weights", "tile_denominator"),
        "per_call": ("for_tiles",),
        "per_query_block": ("for_query_block",),
    },
    "cached": {
        "rotation": ("rotates_per_token",),
        "rotation_about": ("rotate_about",),
        "key_term": ("key_features", "with_key_features"),
        "table": ("cache_table", "with_cache_table"),
        "key_features": ("map_key_features",),
    },
    "prepared": {"tables": ("prepare",), "bias": ("bias",)},
    "scale": {"prescribed": ("score_scale",)},
    "fused": {
        "rows": ("add_logits",),
        "rows_from_content": ("add_logits_to_content",),
        "features": ("score_features",),
        "per_call": ("per_token_for",),
    },
}


# The facts a class declares beside its forms (Forms' boolean fields), and those a base class records for
# its subclasses (declare_facts): "materialize_only" (MaterializeOnly: tiled=None), "builds_itself"
# (ParameterFree: the config is its own hook, registered without hook=).
FACTS: tuple[str, ...] = ("causal_only", "repeatable", "softmax")
CLASS_FACTS: tuple[str, ...] = (*FACTS, "materialize_only", "builds_itself")

# Forms' ``tiled`` when the declaration leaves it out (see the class).
_UNSAID = object()


@dataclasses.dataclass(frozen=True)
class Forms:
    """The forms a hook class declares, by group (see the module's table).

    Attributes:
      hooks: the hooks the class fills (:data:`HOOKS`: ``("rotate",)``, ``("logits", "values")``, ...),
        kept in the order of :data:`HOOKS`; ``()`` for none (NoPE).
      tiled: the tiled forms (a tuple; ``()``: the hook's own ``logits``/``values`` per tile), or
        None when it cannot be computed per tile. Left out: None for a class filling ``logits``
        or ``values`` (their per-tile form must be declared, not assumed), ``()`` otherwise.
      cached: what decoding keeps per key beyond the keys.
      prepared: ``"tables"``, ``"bias"`` or None: what a model computes once per forward and
        shares across its layers.
      fused: faster forms of the materialising path.
      scale: ``"prescribed"`` when the hook prescribes the content-score scale (``score_scale(head_dim)``,
        DeBERTa's ``1/√(3H)``), else None.
      causal_only: defined for causal attention only (xPos, FIRE, CoPE): bidirectional attention refuses it.
      repeatable: several objects of the class may be given to one attention (``SharedBias``: one per bias).
      softmax: a normaliser that is exactly softmax (the fused kernels compute it themselves).
    """

    tiled: tuple[str, ...] | None | object = _UNSAID
    cached: tuple[str, ...] = ()
    prepared: str | None = None
    fused: tuple[str, ...] = ()
    scale: str | None = None
    hooks: tuple[str, ...] = ()
    causal_only: bool = False
    repeatable: bool = False
    softmax: bool = False

    def __post_init__(self):
        for fact in FACTS:
            if not isinstance(self.fact(fact), bool):
                raise TypeError(f"{fact} must be True or False, got {self.fact(fact)!r}")
        if isinstance(self.hooks, str) or not isinstance(self.hooks, (tuple, list)):
            raise TypeError(f"hooks must be a tuple of hook names, e.g. ('logits',), got {self.hooks!r}")
        unknown = [hook for hook in self.hooks if hook not in HOOKS]
        if unknown:
            raise ValueError(f"unknown hook {unknown[0]!r}; the hooks are {list(HOOKS)}")
        object.__setattr__(self, "hooks", tuple(hook for hook in HOOKS if hook in self.hooks))
        if self.tiled is _UNSAID:
            scores = {"logits", "values"} & set(self.hooks)
            object.__setattr__(self, "tiled", None if scores else ())
        for group in ("tiled", "cached", "fused"):
            value = getattr(self, group)
            if group == "tiled" and value is None:
                continue
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                raise TypeError(f"{group} must be a tuple of form names, got {value!r}")
            object.__setattr__(self, group, tuple(value))
            unknown = [form for form in value if form not in FORMS[group]]
            if unknown:
                raise ValueError(f"unknown {group} form {unknown[0]!r}; the {group} forms are {sorted(FORMS[group])}")
        for group in ("prepared", "scale"):
            value = getattr(self, group)
            if value is not None and value not in FORMS[group]:
                raise ValueError(f"unknown {group} form {value!r}; the {group} forms are {sorted(FORMS[group])}")

    def declared(self) -> dict[str, tuple[str, ...]]:
        """Each declared form, as ``"group.form"``, and its methods."""
        names = [("tiled", f) for f in self.tiled or ()] + [("cached", f) for f in self.cached]
        names += [("prepared", self.prepared)] if self.prepared else []
        names += [("fused", f) for f in self.fused]
        names += [("scale", self.scale)] if self.scale else []
        return {f"{group}.{form}": FORMS[group][form] for group, form in names}

    def methods(self) -> tuple[str, ...]:
        """The methods the declared hooks and forms need, in the order of the declaration."""
        return self.hooks + tuple(m for methods in self.declared().values() for m in methods)

    def fact(self, fact: str) -> bool:
        """The declared fact ``fact`` (:data:`FACTS`: ``"causal_only"``, ``"repeatable"``, ``"softmax"``)."""
        facts = {"causal_only": self.causal_only, "repeatable": self.repeatable, "softmax": self.softmax}
        if fact not in facts:
            raise ValueError(f"unknown fact {fact!r}; the facts are {list(FACTS)}")
        return facts[fact]

    def has(self, group: str, form: str) -> bool:
        """Whether ``form`` of ``group`` is declared (``has("prepared", "bias")``)."""
        value = getattr(self, group)
        return value == form if group in ("prepared", "scale") else form in (value or ())


def check_declared(hook_type: type, forms: Forms, *, name: str) -> None:
    """Raises a ValueError naming the hook or form where ``hook_type`` and ``forms`` disagree.

    A declared hook or form whose methods ``hook_type`` does not define, or a hook or form whose
    methods it defines but does not declare (a hook forgotten would never be called, a form
    forgotten would be a silent slow path).
    """
    _check_hooks(hook_type, forms, name=name)
    declared = forms.declared()
    for form, methods in declared.items():
        missing = [m for m in methods if getattr(hook_type, m, None) is None]
        if missing:
            raise ValueError(
                f"encoding {name!r} declares the form {form}, but its hook {hook_type.__name__} does not define "
                f"{', '.join(missing)}: define it, or leave the form out"
            )
    for group, group_forms in FORMS.items():
        for form, methods in group_forms.items():
            key = f"{group}.{form}"
            if key not in declared and all(getattr(hook_type, m, None) is not None for m in methods):
                raise ValueError(
                    f"encoding {name!r}: its hook {hook_type.__name__} defines {', '.join(methods)} but does not "
                    f"declare the form {key}: declare it ({group}=... in register_encoding, or "
                    f"declare_forms({hook_type.__name__}, Forms({group}=...))) so the attention uses it"
                )
    if forms.tiled is not None and class_facts(hook_type).get("materialize_only"):
        raise ValueError(f"encoding {name!r}: {hook_type.__name__} is MaterializeOnly; declare tiled=None")


def _check_hooks(hook_type: type, forms: Forms, *, name: str) -> None:
    """Raises a ValueError naming the hook that ``hook_type`` defines and ``forms`` does not declare, or the reverse."""
    cls = hook_type.__name__
    for hook in HOOKS:
        defined = getattr(hook_type, hook, None) is not None
        if hook in forms.hooks and not defined:
            raise ValueError(
                f"encoding {name!r} declares the hook {hook}, but its hook class {cls} does not define {hook}(): "
                f"define it, or leave {hook!r} out of hooks"
            )
        if defined and hook not in forms.hooks:
            hooks = (*forms.hooks, hook)
            raise ValueError(
                f"encoding {name!r}: its hook class {cls} defines {hook}() but does not declare the hook: declare it "
                f"(hooks={hooks!r} in register_encoding, or declare_forms({cls}, Forms(hooks={hooks!r}, ...))) so the "
                f"attention calls it"
            )


def declare_forms(hook_type: type, forms: Forms, *, name: str | None = None) -> type:
    """Checks ``forms`` against ``hook_type`` (:func:`check_declared`) and records them on it; returns it.

    Registration calls it for an encoding's hook class; a hook class of one's own that is not
    registered declares its hooks and forms with it (``declare_forms(MyBias, Forms(hooks=("logits",)))``),
    once, after the class is defined. A subclass inherits its base's declaration; one that fills
    other hooks or forms declares its own.
    """
    check_declared(hook_type, forms, name=name or hook_type.__name__)
    previous = hook_type.__dict__.get("_declared_forms")
    if previous is not None and previous != forms:
        fields = [f.name for f in dataclasses.fields(Forms) if getattr(previous, f.name) != getattr(forms, f.name)]
        raise ValueError(
            f"{hook_type.__name__} already declares {previous}; a second registration declares {forms} (they differ "
            f"in {', '.join(fields)}): give one"
        )
    hook_type._declared_forms = forms
    return hook_type


def declared_forms(hook) -> Forms | None:
    """The hooks and forms ``hook``'s class (or the nearest base that declared) declared; None when none did.

    :func:`forms_of` is the same for an object that must be a hook (it refuses one whose class declared
    nothing); this one lets the caller tell a hook from something else (a config, a name).
    """
    hook_type = type(hook)
    declared = next((c.__dict__["_declared_forms"] for c in hook_type.__mro__ if "_declared_forms" in c.__dict__), None)
    if declared is None:
        return None
    facts = class_facts(hook_type)
    if declared.tiled is not None and facts.get("materialize_only"):
        # MaterializeOnly mixed into a declared class (its own subclass of ALiBi, say): not per tile.
        declared = dataclasses.replace(declared, tiled=None)
    if facts.get("causal_only") and not declared.causal_only:
        # A hook class deriving from the deprecated CausalOnly base, declared without causal_only.
        declared = dataclasses.replace(declared, causal_only=True)
    return declared


def declare_facts(cls: type, **facts: bool) -> type:
    """Records ``facts`` (:data:`CLASS_FACTS`) on ``cls`` for it and its subclasses; returns it.

    What a base class says of its subclasses (``MaterializeOnly``: not per tile; ``ParameterFree``:
    the config is its own hook), and what registration says of a config class (``causal_only``).
    A fact ``cls`` itself recorded before with the other value is an error naming it.
    """
    unknown = sorted(set(facts) - set(CLASS_FACTS))
    if unknown:
        raise ValueError(f"unknown fact {unknown[0]!r}; the facts are {list(CLASS_FACTS)}")
    own = dict(cls.__dict__.get("_declared_facts", {}))
    clash = [fact for fact, value in facts.items() if own.get(fact, value) != value]
    if clash:
        raise ValueError(
            f"{cls.__name__} already declares {clash[0]}={own[clash[0]]}; a second declaration says "
            f"{clash[0]}={facts[clash[0]]}: give one"
        )
    cls._declared_facts = {**own, **facts}
    return cls


def class_facts(cls: type) -> dict[str, bool]:
    """The facts ``cls`` and its bases recorded (:func:`declare_facts`), the nearest class's first."""
    facts: dict[str, bool] = {}
    for c in reversed(cls.__mro__):
        facts.update(c.__dict__.get("_declared_facts", {}))
    return facts


def declares(obj, fact: str) -> bool:
    """Whether ``obj``'s class declares ``fact`` (:data:`FACTS`): read from its forms when it declared
    some (a hook), else from the facts its class recorded (a config: registration records ``causal_only``)."""
    declared = declared_forms(obj)
    if declared is not None:
        return declared.fact(fact)
    if fact not in FACTS:
        raise ValueError(f"unknown fact {fact!r}; the facts are {list(FACTS)}")
    return bool(class_facts(type(obj)).get(fact, False))


def forms_of(hook) -> Forms:
    """The hooks and forms ``hook``'s class declared (:func:`declare_forms`, or registration).

    Raises a TypeError naming :func:`declare_forms` when its class (and every base) declared none.
    """
    declared = declared_forms(hook)
    if declared is None:
        raise TypeError(undeclared_message(hook))
    return declared


def undeclared_message(hook) -> str:
    """The one-line error for an object given as a hook whose class declared no hooks."""
    cls = type(hook).__name__
    return (
        f"{cls} declares no hooks, so the attention cannot tell what it fills: declare them once after the class, "
        f"e.g. declare_forms({cls}, Forms(hooks=('logits',))) (posenc_jax.functional.core.forms; the hooks are "
        f"{', '.join(HOOKS)}), or register it as an encoding"
    )


class FormInterface(type):
    """The metaclass of a form's interface class (``TiledLogits``, ``PositionBias``, ...).

    Such a class names a form's methods for readers and type hints; ``isinstance(hook, TiledLogits)``
    answers from the forms ``hook``'s class declares (:func:`forms_of`), never from the methods it
    happens to have. A subclass of an interface class is an ordinary class.
    """

    def __instancecheck__(cls, instance) -> bool:
        form = cls.__dict__.get("_form")
        if form is None:
            return super().__instancecheck__(instance)
        group, name = form.split(".")
        declared = declared_forms(instance)
        return declared is not None and declared.has(group, name)


class _CausalOnlyType(type):
    # isinstance(x, CausalOnly) reads the declaration (declares(x, "causal_only")), not the class's bases.
    def __instancecheck__(cls, instance) -> bool:
        return declares(instance, "causal_only") if cls is CausalOnly else super().__instancecheck__(instance)


class CausalOnly(metaclass=_CausalOnlyType):
    """Deprecated base: an encoding defined for causal attention only declares it at registration
    (``register_encoding(..., forms=("causal",))``, which declares it for the hook class and its config)
    or, for a hook class of one's own, with ``declare_forms(MyHook, Forms(..., causal_only=True))``.

    ``isinstance(x, CausalOnly)`` answers from the declaration (xPos, FIRE, CoPE and their configs). A
    subclass still works (it records the fact ``causal_only``) and warns, naming the declaration.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        warnings.warn(
            f"{cls.__name__} derives from CausalOnly, which is deprecated: declare causal-only forms instead, "
            f"register_encoding(..., forms=('causal',)) or declare_forms({cls.__name__}, Forms(..., causal_only=True))",
            DeprecationWarning,
            stacklevel=2,
        )
        declare_facts(cls, causal_only=True)


class MaterializeOnly:
    """Base of a hook that cannot be computed per tile: blockwise attention refuses it by name. Deriving
    from it declares ``tiled=None`` (:mod:`posenc_jax.functional.core.forms`) for the class and its
    subclasses, over what a base declared (a subclass of ALiBi that is not computed per tile)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declare_facts(cls, materialize_only=True)
