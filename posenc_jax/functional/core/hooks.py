"""The encoding contract: the hooks an encoding fills and the context every hook receives.

An encoding is defined by where it acts. It fills one or more of these hooks (each typed by a
:class:`typing.Protocol` of the same name, for readers and type checkers), and
:func:`posenc_jax.functional.dot_product_attention` composes whatever it is given:

==============  ===========================================  ==================================
hook            signature                                    encodings
==============  ===========================================  ==================================
``embed``       ``embed(x, positions) -> x``                 sinusoidal, learned absolute, NoPE
``rotate``      ``rotate(q, k, context) -> (q, k)``          RoPE and its scalings, xPos, axial
``logits``      ``logits(q, k, context) -> [B,N,T,S]``       T5, ALiBi, Kerple, FIRE, Shaw, ...
``values``      ``values(weights, context) -> [B,T,N,H]``    Shaw's R_V
``normalize``   ``normalize(scores, mask, context)``         softmax, L2, relu²/n, URPE
==============  ===========================================  ==================================

Which hooks a class fills is part of its declaration, made when it registers (``hooks=``) or
with :func:`~posenc_jax.functional.core.forms.declare_forms`, and :func:`hook_names` reads it
there: the attention calls exactly the declared hooks, never looks for methods, and refuses an
object whose class declared none. Beyond the hooks, an encoding declares its forms, from a closed
list (:mod:`posenc_jax.functional.core.forms`): tiled (its term for one tile), cached (what decoding
keeps per key), prepared (computed once per forward and shared by the layers: a
:class:`PositionBias`'s ``bias(context)``, RoPE's tables), fused (faster materialising forms).
The classes named after them here (:class:`TiledLogits`, :class:`PositionBias`, ...) list a
form's methods; ``isinstance`` against one reads the declaration. A :class:`ScoreScale`
prescribes the content-score scale (DeBERTa's ``1/√(3H)``).

Every attention hook receives one :class:`AttentionContext`: the query and key positions,
the boolean mask, the score scale, the head dim and head count, whether the attention is
causal, and the key length. An encoding reads what it needs there (a term that shares the score scale
reads ``context.scale``; an encoding with a causal and a bidirectional form follows
``context.causal`` unless told otherwise); nothing rewrites an encoding's fields.

Hooks and configs are frozen dataclasses registered as pytrees with
:func:`pytree_dataclass`: fields made with :func:`parameter` are leaves (arrays that
``jax.jit``, ``jax.vmap`` and ``jax.grad`` see), every other field is a static setting.
A built hook can therefore be an argument of a transformed function.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import jax

from posenc_jax.functional.core.context import (
    AttentionContext,
    attention_context,
    parameter,
    pytree_dataclass,
    rotation_context,
)
from posenc_jax.functional.core.forms import (
    CausalOnly,
    FormInterface,
    MaterializeOnly,
    declare_facts,
    declared_forms,
    declares,
    forms_of,
    undeclared_message,
)
from posenc_jax.functional.core.validation import check_init_sizes

__all__ = [
    "AddsLogits",
    "AddsLogitsToContent",
    "AttentionContext",
    "BiasHook",
    "CausalOnly",
    "Embed",
    "KeyFeatures",
    "EncodingConfig",
    "Logits",
    "MaterializeOnly",
    "CarriedLogits",
    "CarriedLogitsFromContent",
    "DistanceBias",
    "Normalize",
    "ParameterFree",
    "PerCallRotation",
    "PerTokenRotation",
    "Placement",
    "PositionBias",
    "PositionSampler",
    "PreparedRotation",
    "PreparesTables",
    "Rotate",
    "RotatesAbout",
    "ScoreFeatures",
    "ScoreScale",
    "TiledLogits",
    "TiledNormalize",
    "TiledScores",
    "TiledValues",
    "Values",
    "attention_context",
    "builds_itself",
    "check_together",
    "hook_names",
    "one_or_more",
    "parameter",
    "pytree_dataclass",
    "rotates_each_token",
    "rotation_context",
    "with_per_call_rotations_fixed",
]

Placement = Literal["embeddings", "positions", "attention", "shared_bias", "normalizer"]
PLACEMENTS: tuple[str, ...] = ("embeddings", "positions", "attention", "shared_bias", "normalizer")


@runtime_checkable
class Embed(Protocol):
    """Adds position information to token embeddings ``x`` ``[..., T, D]`` before the first layer."""

    def embed(self, x: jax.Array, positions: jax.Array) -> jax.Array: ...


@runtime_checkable
class PositionSampler(Protocol):
    """Replaces the positions themselves (randomized positions) before any other encoding sees them."""

    def sample(self, key: jax.Array, positions: jax.Array, *, train: bool) -> jax.Array: ...


@runtime_checkable
class Rotate(Protocol):
    """Transforms queries ``[B, T, N, H]`` and keys ``[B, S, K, H]`` (RoPE family, xPos).

    The attention passes an :class:`AttentionContext`; the library's rotate hooks also take
    positions when called directly (see :func:`rotation_context`).
    """

    def rotate(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> tuple[jax.Array, jax.Array]: ...


@runtime_checkable
class Logits(Protocol):
    """A term added to the scaled ``[B, N, T, S]`` scores (float32, broadcastable), or None.

    Faster forms a hook may also fill: :class:`AddsLogits`, :class:`AddsLogitsToContent`,
    :class:`ScoreFeatures` (the attention then uses them; ``logits`` stays the reference).
    """

    def logits(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array | None: ...


class AddsLogits(metaclass=FormInterface):
    """A ``logits`` hook that adds its term into the scores itself: ``add_logits(scores, q, k, context)``
    returns ``scores + logits(q, k, context)``, the term built by blocks of query rows and never
    stored whole (FIRE's MLP bias, Transformer-XL's terms, CoPE's term). ``logits`` stays the
    reference, and blockwise attention calls it per tile."""

    _form: ClassVar[str] = "fused.rows"

    def add_logits(self, scores: jax.Array, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array: ...


class AddsLogitsToContent(metaclass=FormInterface):
    """An :class:`AddsLogits` hook that also makes the content scores when it adds the first term.

    ``add_logits_to_content(content, q, k, context)`` is called instead of ``add_logits`` when the
    hook adds the first term and no features are joined: ``content()`` makes the content scores,
    exactly ``context.scale · q·k``; the hook returns them plus its term. A term that reads them
    uses them rather than compute ``q·k`` again (CoPE's gates), and may make them inside a
    run-time conditional, which would copy scores given to it.
    """

    _form: ClassVar[str] = "fused.rows_from_content"

    def add_logits_to_content(
        self, content: Callable[[], jax.Array], q: jax.Array, k: jax.Array, context: AttentionContext
    ) -> jax.Array: ...


class ScoreFeatures(metaclass=FormInterface):
    """A ``logits`` term that splits into per-query and per-key features.

    ``score_features(q, k, context) -> (fq [B, T, N, F], fk [B|1, S, F])`` with
    ``context.scale · einsum("BTNF,BSF->BNTS", fq, fk)`` equal to the term: float32 attention
    appends them to q and k, so one contraction gives content and term (the functional
    relative encoding's sinusoid identity).
    """

    _form: ClassVar[str] = "fused.features"

    def score_features(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> tuple[jax.Array, jax.Array]: ...


class KeyFeatures(metaclass=FormInterface):
    """A hook holding per-key arrays ``[B, S, ...]`` (read from a KV cache: DeBERTa's key projections,
    Transformer-XL's ``u·k``): ``map_key_features(fn)`` is the hook with ``fn`` applied to each, which
    blockwise attention uses to pad them and cut them to each key tile."""

    _form: ClassVar[str] = "cached.key_features"

    def map_key_features(self, fn: Callable[[jax.Array], jax.Array]) -> Any: ...


class PerTokenRotation(metaclass=FormInterface):
    """A ``rotate`` hook that says whether it rotates each token by that token's position alone.

    When ``rotates_per_token`` is True (RoPE and its fixed scalings, axial RoPE) a KV cache may
    store keys rotated and each decoding step rotates only its new tokens; a length-dependent
    scaling says False. A rotate hook that does not fill this protocol is treated as not per
    token (correct, but the cache re-rotates every stored key at each step).
    """

    _form: ClassVar[str] = "cached.rotation"

    @property
    def rotates_per_token(self) -> bool: ...


def rotates_each_token(hook) -> bool:
    """Whether ``hook`` is a ``rotate`` hook that declares it rotates each token by its own position alone
    (:class:`PerTokenRotation`): a cache may store its keys rotated, and a tile may rotate its own tokens."""
    return "rotate" in hook_names(hook) and forms_of(hook).has("cached", "rotation") and hook.rotates_per_token


class PerCallRotation(metaclass=FormInterface):
    """A ``rotate`` hook whose rotation depends on the whole call through one value (xPos's centre, the
    length a length-dependent RoPE scaling follows) and, that value fixed, on each token's own position.

    ``per_token_for(context)`` fixes the value from ``context`` (the whole call's) and returns a hook
    that rotates each token by its own position alone (:func:`rotates_each_token`) and gives what this
    one gives on that call: blockwise attention rotates its tiles by it, so no rotated copy of q and
    k is stored.
    """

    _form: ClassVar[str] = "fused.per_call"

    def per_token_for(self, context: AttentionContext) -> Rotate: ...


def with_per_call_rotations_fixed(hooks: Sequence, context: AttentionContext) -> list:
    """``hooks`` with each :class:`PerCallRotation` that does not yet rotate each token by its own position
    replaced by its per-token form for the call of ``context`` (:meth:`PerCallRotation.per_token_for`)."""
    return [
        hook.per_token_for(context)
        if forms_of(hook).has("fused", "per_call") and not rotates_each_token(hook)
        else hook
        for hook in hooks
    ]


class RotatesAbout(metaclass=FormInterface):
    """A ``rotate`` hook that rotates per token given a fixed reference position (xPos's centre):
    ``rotate_about(q, k, context, reference)``; a KV cache stores its keys rotated about it."""

    _form: ClassVar[str] = "cached.rotation_about"

    def rotate_about(
        self, q: jax.Array, k: jax.Array, context: AttentionContext, reference: jax.Array | None
    ) -> tuple[jax.Array, jax.Array]: ...


class PreparesTables(metaclass=FormInterface):
    """A parameter-free ``rotate`` hook whose tables depend on positions alone.

    ``prepare(positions, head_dim)`` returns a :class:`PreparedRotation`: the rotation by tables
    computed once for those positions (an integer array, or a forward's
    :class:`AttentionContext`: its query positions); a model calls it once per forward and
    shares the result across its layers (RoPE and its scalings).
    """

    _form: ClassVar[str] = "prepared.tables"

    def prepare(self, positions: jax.Array | AttentionContext, head_dim: int) -> PreparedRotation: ...


class PreparedRotation:
    """A ``rotate`` hook with its tables computed for one array of positions (:class:`PreparesTables`).

    ``rotate_prepared(q, k)`` rotates queries and keys that are both at those positions: a
    model's layer calls it for its own tokens (self-attention at the forward's positions, a
    decoding step's new tokens), so no positions are compared. As a plain ``rotate`` hook it
    must stay right for any context it is given. The base class of what a ``prepare`` returns
    (RoPE's :class:`~posenc_jax.functional.encodings.rope.RotaryTable`).
    """

    def rotate(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError(f"{type(self).__name__} does not define rotate()")

    def rotate_prepared(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError(f"{type(self).__name__} does not define rotate_prepared()")


class CarriedLogits(metaclass=FormInterface):
    """A ``logits`` term whose tile also depends on the key tiles after it (CoPE's gate sums).

    Blockwise attention visits the key tiles of a query block last first: ``init_carry``
    gives the carry for a query block (``q`` and ``context`` are the block's), and
    ``carried_logits`` gives one tile's ``[B, N, bq, bk]`` term from the sums of the
    tiles after it, and the sums passed on. The hook still fills ``logits`` for the
    materialising path.
    """

    _form: ClassVar[str] = "tiled.carried"

    def init_carry(self, q: jax.Array, context: AttentionContext) -> Any: ...

    def carried_logits(
        self, q: jax.Array, k: jax.Array, context: AttentionContext, carry: Any
    ) -> tuple[jax.Array, Any]: ...


class CarriedLogitsFromContent(metaclass=FormInterface):
    """A :class:`CarriedLogits` hook whose tile reads the content scores (CoPE's gates are ``σ(q·k)``).

    ``carried_logits_from_content(content, q, k, context, carry)`` is called instead of
    ``carried_logits`` when the tile's scores are exactly ``content = context.scale · q·k``
    (the hook adds the tile's first term, ``[B, N, bq, bk]`` float32), so the hook reads them
    rather than compute ``q·k`` again; it returns what ``carried_logits`` returns.
    """

    _form: ClassVar[str] = "tiled.carried_from_content"

    def carried_logits_from_content(
        self, content: jax.Array, q: jax.Array, k: jax.Array, context: AttentionContext, carry: Any
    ) -> tuple[jax.Array, Any]: ...


class PositionBias(metaclass=FormInterface):
    """A ``logits`` term that depends on positions alone: computed once per forward, shared by layers."""

    _form: ClassVar[str] = "prepared.bias"

    def bias(self, context: AttentionContext) -> jax.Array: ...


class DistanceBias(metaclass=FormInterface):
    """A :class:`PositionBias` whose value at a (query, key) pair depends on the distance j − i alone (Kerple).

    ``distance_bias(distance, context)`` gives it for float32 distances ``[B|1, D]`` (each the
    exact ``key_pos - query_pos`` rounded once to float32) as ``[B|1, N, D]``. Blockwise attention
    evaluates a tile whose positions are runs at its ``bq + bk - 1`` distances only and lays
    them out as a Toeplitz tile; ``bias`` stays the reference, used for other tiles.
    """

    _form: ClassVar[str] = "tiled.distance"

    def distance_bias(self, distance: jax.Array, context: AttentionContext) -> jax.Array: ...


class TiledLogits(metaclass=FormInterface):
    """A ``logits`` hook with a form of its own for one blockwise tile, cheaper where the tile's positions
    allow: ``tile_logits(q, k, context)`` equals ``logits(q, k, context)`` for a tile's context (Shaw's and
    DeBERTa's tiles wholly past their clip read one table row). ``logits`` stays the reference."""

    _form: ClassVar[str] = "tiled.logits"

    def tile_logits(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array | None: ...


class TiledScores(metaclass=FormInterface):
    """A ``logits`` hook that can form one blockwise tile's scores together with the content product:
    ``tile_scores(q, k, context, content)`` equals ``content(q, k) + logits(q, k, context)``, where
    ``content(q, k)`` gives the tile's float32 content scores ``[B, N, bq, bk]`` of whatever queries and
    keys it is handed. A Shaw tile wholly past the clip adds its one table row ``P_K[end]`` to the keys,
    so content and term are one contraction and the term is no tile of its own; DeBERTa's adds its slot's
    rows to the queries and keys, less their own product. Blockwise attention uses it for float32 queries
    and keys when no term is joined to the content product (``ScoreFeatures``). ``logits`` stays the
    reference."""

    _form: ClassVar[str] = "tiled.scores"

    def tile_scores(self, q: jax.Array, k: jax.Array, context: AttentionContext, content) -> jax.Array: ...


class TiledValues(metaclass=FormInterface):
    """A ``values`` hook with a form of its own for one blockwise tile: ``tile_values(weights, context)``
    equals ``values(weights, context)`` for a tile's context (Shaw's R_V past its clip: each row's weights
    summed into one table row). ``values`` stays the reference."""

    _form: ClassVar[str] = "tiled.values"

    def tile_values(self, weights: jax.Array, context: AttentionContext) -> jax.Array | None: ...


@runtime_checkable
class Values(Protocol):
    """A ``[B, T, N, H]`` term added to the attention output, from the ``[B, N, T, S]`` weights, or None."""

    def values(self, weights: jax.Array, context: AttentionContext) -> jax.Array | None: ...


@runtime_checkable
class Normalize(Protocol):
    """Turns float32 scores ``[B, N, T, S]`` and a boolean mask (or None) into weights.

    The weights must be exactly zero where the mask is False (by selection, whatever the
    masked scores hold): the attention adds no selection of its own.
    """

    def normalize(self, scores: jax.Array, mask: jax.Array | None, context: AttentionContext) -> jax.Array: ...


class TiledNormalize(metaclass=FormInterface):
    """A normaliser blockwise attention runs in tiles (the form ``tiled.weights``, declared by the normaliser's
    class: ``declare_forms(MyNormalizer, Forms(tiled=("weights",)))``): ``out = Σ_tiles p · v / denominator``.

    For each block of query rows (``rows`` = ``(B, N, bq)``) the attention starts from
    ``tile_init(rows)``, a pytree of running statistics. Each key tile's float32 ``scores``
    ``[B, N, bq, bk]`` and boolean ``visible`` give ``tile_weights(...) -> (p, state,
    correction)``: the tile's unnormalised weights (zero where not visible), the new state,
    and the factor ``[B, N, bq]`` by which the output accumulated so far is rescaled (None:
    no rescaling, e.g. without a running maximum). After the last tile the output is divided
    by ``tile_denominator(state, context)`` (broadcastable to ``rows``; a zero becomes 1).
    ``context`` is the tile's in ``tile_weights`` (its positions and mask) and the query
    block's in ``tile_denominator`` (``sequence_lengths`` of the block's rows).
    """

    _form: ClassVar[str] = "tiled.weights"

    def tile_init(self, rows: tuple[int, ...]) -> Any: ...

    def tile_weights(
        self, scores: jax.Array, visible: jax.Array, state: Any, context: AttentionContext
    ) -> tuple[jax.Array, Any, jax.Array | None]: ...

    def tile_denominator(self, state: Any, context: AttentionContext) -> jax.Array: ...


class ScoreScale(metaclass=FormInterface):
    """Prescribes the content-score scale for a head dim (DeBERTa: ``1/√(3H)``): the form ``scale.prescribed``."""

    _form: ClassVar[str] = "scale.prescribed"

    def score_scale(self, head_dim: int) -> float: ...


ATTENTION_HOOKS: tuple[str, ...] = ("rotate", "logits", "values")


def one_or_more(encodings) -> list:
    """One encoding (a registered name, a config or a hook) or a sequence of them, as a list."""
    if isinstance(encodings, (str, EncodingConfig)) or not isinstance(encodings, Sequence):
        return [encodings]
    return list(encodings)


def check_together(encodings: Sequence, *, causal: bool | None) -> None:
    """Refuses encodings (configs or hooks) that cannot mean what was asked together.

    Two rotations, one encoding given twice (two objects of one type, pytrees only; a class that
    declares ``repeatable``, as a shared bias does, is exempt), two absolute encodings, or
    (``causal=False``) an encoding declared causal-only; ``causal=None`` skips that last check.
    """

    def names(chosen) -> str:
        return ", ".join(type(e).__name__ for e in chosen)

    rotations = [e for e in encodings if "rotate" in hook_names(e)]
    if len(rotations) > 1:
        raise ValueError(
            f"the encodings {names(rotations)} would rotate queries and keys {len(rotations)} times; give one rotation"
        )
    kinds = [type(e) for e in encodings if not jax.tree_util.all_leaves([e]) and not declares(e, "repeatable")]
    twice = sorted({kind.__name__ for kind in kinds if kinds.count(kind) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} is given more than once; give each encoding once")
    absolute = [e for e in encodings if isinstance(e, EncodingConfig) and e.acts_on == "embeddings"]
    if len(absolute) > 1:
        raise ValueError(
            f"the absolute encodings {names(absolute)} would both be added to the token embeddings; give one"
        )
    if causal is False:
        only = [e for e in encodings if declares(e, "causal_only")]
        if only:
            raise ValueError(
                f"{names(only)} is defined for causal attention only; pass causal=True (a causal model), or choose "
                f"an encoding with a bidirectional form"
            )


def hook_names(hook) -> tuple[str, ...]:
    """The hooks ``hook``'s class declared it fills, in the order of the design's table.

    Read from the declaration (registration, or :func:`~posenc_jax.functional.core.forms.declare_forms`),
    never from the methods the object has. A config with learned parameters fills none (its built
    hook does); any other object whose class declared no hooks is refused with a TypeError naming
    ``declare_forms``.

    Example:
      >>> from posenc_jax.functional import RoPE
      >>> hook_names(RoPE())
      ('rotate',)
    """
    declared = declared_forms(hook)
    if declared is not None:
        return declared.hooks
    if isinstance(hook, EncodingConfig):
        return ()
    raise TypeError(undeclared_message(hook))


# The inits EncodingConfig wrapped with the size check (a class made again from its namespace, as a slotted
# dataclass is, finds its init wrapped already).
_SIZE_CHECKED_INITS: weakref.WeakSet = weakref.WeakSet()


class EncodingConfig:
    """Base of every registered encoding's configuration (a frozen dataclass of settings).

    ``acts_on`` says where the encoding acts, so a model places it without building it:
    ``"embeddings"`` (added to token embeddings), ``"positions"`` (replaces the positions),
    ``"attention"`` (hooks inside each layer's attention, with that layer's parameters),
    ``"shared_bias"`` (a position-only bias with one set of parameters, computed once per
    forward for all layers) or ``"normalizer"``.
    """

    acts_on: ClassVar[Placement] = "attention"

    def __init_subclass__(cls, **kwargs):
        # Every config's init, wherever it is defined, refuses a key that is not a key and a size < 1 by
        # name, before any table is made with that size.
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("init")
        if init is not None and init not in _SIZE_CHECKED_INITS:

            @functools.wraps(init)
            def checked_init(self, key, *, num_heads, head_dim, model_dim):
                check_init_sizes(key, num_heads, head_dim, model_dim)
                return init(self, key, num_heads=num_heads, head_dim=head_dim, model_dim=model_dim)

            _SIZE_CHECKED_INITS.add(checked_init)
            cls.init = checked_init

    def init(self, key: jax.Array, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        """The encoding's parameters (a dict of arrays; empty when it has none).

        Every subclass's ``init`` refuses, before it runs, a ``key`` that is not a
        ``jax.random`` key and sizes that are not integers >= 1.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define init()")

    def build(self, params: dict):
        """The hook object made from ``params``."""
        raise NotImplementedError(f"{type(self).__name__} does not define build()")

    @property
    def length_dependent(self) -> bool:
        """Whether the encoding reads the sequence length (``max(position) + 1``): dynamic NTK, LongRoPE."""
        return False

    def for_lengths(self, *, train_length: int, max_length: int, head_dim: int) -> EncodingConfig:
        """This config sized for a model trained on ``train_length`` tokens and tested up to
        ``max_length`` (tables long enough, scalings' factors); most encodings need nothing."""
        return self


class ParameterFree(EncodingConfig):
    """Base of encodings without parameters: each is its own config (``build`` returns it).

    Deriving from it records the fact ``builds_itself``, which registration checks against
    ``hook=`` (left out: the config is its own hook); the attention tells a parameter-free config
    from one with parameters by its declaration (:func:`builds_itself`).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declare_facts(cls, builds_itself=True)

    def init(self, key: jax.Array, *, num_heads: int, head_dim: int, model_dim: int) -> dict:
        return {}

    def build(self, params: dict):
        return self


def builds_itself(encoding) -> bool:
    """Whether ``encoding`` is a config that is its own hook (parameter-free: RoPE, ALiBi): its class declared
    its hooks and forms (registered without ``hook=``, or :func:`~posenc_jax.functional.core.forms.declare_forms`).
    A config with learned parameters declares them on the hook its ``build`` returns, so this is False for it."""
    return isinstance(encoding, EncodingConfig) and declared_forms(encoding) is not None


class BiasHook:
    """Mixin for :class:`PositionBias` encodings: the ``logits`` term is ``bias(context)``."""

    def logits(self, q: jax.Array, k: jax.Array, context: AttentionContext) -> jax.Array:
        return self.bias(context)
