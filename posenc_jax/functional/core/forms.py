"""The forms an encoding declares beside its hooks, from a short closed list.

A hook (``rotate``, ``logits``, ``values``, ...) says what an encoding computes; a form says
in which other shapes the attention may ask for it. Every registered encoding declares its
forms when it registers (:func:`~posenc_jax.functional.core.registry.register_encoding`), and
registration checks them against its hook class: a declared form whose methods the class lacks,
or a form whose methods it has but does not declare, is a registration error naming the form.
The attention reads the declaration (:func:`forms_of`), never probes for a method.

==========  ====================  ======================================================  =========================
group       form                  methods                                                 encodings
==========  ====================  ======================================================  =========================
tiled       ``distance``          ``distance_bias(distance, context)``: a Toeplitz tile   T5, Kerple, clipped bias
            ``logits``            ``tile_logits(q, k, context)``                          Shaw, DeBERTa, FIRE
            ``head``              ``head_bias(context)``: one head's bias at positions    ALiBi, T5, Kerple
            ``scores``            ``tile_scores(q, k, context, content)``                 Shaw, DeBERTa
            ``values``            ``tile_values(weights, context)``                       Shaw
            ``carried``           ``init_carry``, ``carried_logits``                      CoPE
            ``carried_from_       ``carried_logits_from_content``                         CoPE
            content``
            ``weights``           ``tile_init``, ``tile_weights``, ``tile_denominator``:  softmax, L2, relu², URPE
                                  a normaliser's online form
            ``per_call``          ``for_tiles(context, block_q, block_k)``: what every    Transformer-XL
                                  tile shares, computed once for the call
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

``tiled=None`` says the hook cannot be computed per tile (blockwise attention refuses it by
name); ``tiled=()`` that blockwise attention calls its ``logits`` and ``values`` on each
tile's context, which every hook of the contract must allow.

Example:
  >>> Forms(tiled=("distance",), prepared="bias").methods()
  ('distance_bias', 'bias')
"""

from __future__ import annotations

import dataclasses

__all__ = ["FORMS", "Forms", "check_declared", "declare_forms", "forms_of"]

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


@dataclasses.dataclass(frozen=True)
class Forms:
    """The forms a hook class declares, by group (see the module's table).

    Attributes:
      tiled: the tiled forms (a tuple; ``()``: the hook's own ``logits``/``values`` per tile), or
        None when it cannot be computed per tile.
      cached: what decoding keeps per key beyond the keys.
      prepared: ``"tables"``, ``"bias"`` or None: what a model computes once per forward and
        shares across its layers.
      fused: faster forms of the materialising path.
      scale: ``"prescribed"`` when the hook prescribes the content-score scale (``score_scale(head_dim)``,
        DeBERTa's ``1/√(3H)``), else None.
    """

    tiled: tuple[str, ...] | None = ()
    cached: tuple[str, ...] = ()
    prepared: str | None = None
    fused: tuple[str, ...] = ()
    scale: str | None = None

    def __post_init__(self):
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
        """The methods the declared forms need, in the order of the declaration."""
        return tuple(m for methods in self.declared().values() for m in methods)

    def has(self, group: str, form: str) -> bool:
        """Whether ``form`` of ``group`` is declared (``has("prepared", "bias")``)."""
        value = getattr(self, group)
        return value == form if group in ("prepared", "scale") else form in (value or ())


def check_declared(hook_type: type, forms: Forms, *, name: str) -> None:
    """Raises a ValueError naming the form where ``hook_type`` and ``forms`` disagree.

    A declared form whose methods ``hook_type`` does not define, or a form whose methods it
    defines but does not declare (a form forgotten would be a silent slow path).
    """
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
    if forms.tiled is not None and getattr(hook_type, "_materialize_only", False):
        raise ValueError(f"encoding {name!r}: {hook_type.__name__} is MaterializeOnly; declare tiled=None")


def declare_forms(hook_type: type, forms: Forms, *, name: str | None = None) -> type:
    """Checks ``forms`` against ``hook_type`` (:func:`check_declared`) and records them on it; returns it.

    Registration calls it for an encoding's hook class; a hook class of one's own that is not
    registered declares its forms with it too (``declare_forms(MyHook, Forms(...))``).
    """
    check_declared(hook_type, forms, name=name or hook_type.__name__)
    previous = hook_type.__dict__.get("_declared_forms")
    if previous is not None and previous != forms:
        raise ValueError(
            f"{hook_type.__name__} already declares {previous}; a second registration declares {forms}: give one"
        )
    hook_type._declared_forms = forms
    return hook_type


def forms_of(hook) -> Forms:
    """The forms ``hook``'s class declared (:func:`declare_forms`, or registration).

    A hook class of one's own that declared none has none: no form's methods may then be defined
    on it (a ValueError names the form to declare), and it is computed per tile by its hooks
    (``tiled=()``; ``tiled=None`` for a :class:`~posenc_jax.functional.core.hooks.MaterializeOnly`).
    """
    hook_type = type(hook)
    declared = next((c.__dict__["_declared_forms"] for c in hook_type.__mro__ if "_declared_forms" in c.__dict__), None)
    materialize_only = getattr(hook_type, "_materialize_only", False)
    if declared is None:
        declared = Forms(tiled=None if materialize_only else ())
        check_declared(hook_type, declared, name=hook_type.__name__)
    elif declared.tiled is not None and materialize_only:
        # MaterializeOnly mixed into a declared class (its own subclass of ALiBi, say): not per tile.
        declared = dataclasses.replace(declared, tiled=None)
    return declared


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
        return forms_of(instance).has(group, name)
