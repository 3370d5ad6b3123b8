"""Linear operations with their own transpose: fast reverse mode, forward mode intact.

A few operations of the library are linear in one array and read others (positions, a mask,
indices) as fixed: Shaw's and DeBERTa's gather of a per-distance table and its transpose, the
sum by distance; Transformer-XL's shift of ladder scores to keys; CoPE's read of interpolation
pairs. Autodiff's transpose of a gather is a scatter, slow on some backends, where the
transpose these operations have is again a gather (or one scatter of pairs). A ``custom_vjp``
would give that gradient but break ``jax.jvp``; so each such operation is a JAX primitive
with a transpose rule instead (:func:`linear_primitives`): its JVP is the operation applied to
the tangent (it is linear), its transpose is its partner's application to the cotangent. Then
reverse mode, forward mode (``jax.jvp``, ``jax.jacfwd``), and any composition (Hessians) all
work, with no switch and no context manager.

Each primitive lowers to its plain ``jax.numpy`` implementation (the same program a direct
call traces), runs eagerly through it, and is batched by folding the mapped axis into the
operands' leading (batch) axis, so ``jax.vmap`` keeps the fast transpose.

Example:
  >>> take, put = linear_primitives(  # rows [B, L] read at indices [B, M]; B is the batch axis
  ...     "example_take",
  ...     lambda x, i, *, length: jnp.take_along_axis(x, i, axis=-1),
  ...     lambda y, i, *, length: jax.vmap(lambda y, i: jnp.zeros(length, y.dtype).at[i].add(y))(y, i),
  ... )
  >>> x, i = jnp.arange(3.0)[None], jnp.array([[2, 2, 0]])
  >>> take(x, i, length=3).tolist(), jax.grad(lambda x: take(x, i, length=3).sum())(x).tolist()
  ([[2.0, 2.0, 0.0]], [[1.0, 0.0, 2.0]])
  >>> jax.jvp(lambda x: take(x, i, length=3), (x,), (jnp.ones((1, 3)),))[1].tolist()
  [[1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from posenc_jax.functional.core.operations import sum_to_shape

__all__ = ["linear_primitives", "tangent_primitive"]


def linear_primitives(name: str, apply: Callable, transpose: Callable) -> tuple[Callable, Callable]:
    """Two primitives, ``apply(x, *fixed, **params)`` and ``transpose(y, *fixed, **params)``, transposes of each other.

    Both are linear in their first operand; the other operands (``fixed``: integer positions,
    a boolean mask) are read, never differentiated. Both take the same static ``params``, which
    must not depend on the operands' leading (batch) axis.

    Every operand's leading axis is the batch axis (size B or 1, broadcasting): ``jax.vmap``
    folds its mapped axis into it, leaving ``params`` as they are.

    Returns:
      ``(apply_fn, transpose_fn)``, called as ``apply_fn(x, *fixed, **params)``.
    """
    forward = _primitive(f"{name}", apply)
    backward = _primitive(f"{name}_transpose", transpose)
    _linear_rules(forward, backward)
    _linear_rules(backward, forward)
    return functools.partial(_bind, forward), functools.partial(_bind, backward)


def _bind(primitive: Primitive, x, *fixed, **params):
    return primitive.bind(jnp.asarray(x), *(jnp.asarray(f) for f in fixed), **params)


def _primitive(name: str, impl: Callable) -> Primitive:
    primitive = Primitive(name)
    primitive.def_impl(impl)

    def abstract(x, *fixed, **params):
        out = jax.eval_shape(functools.partial(impl, **params), x, *fixed)
        return x.update(shape=out.shape, dtype=out.dtype)  # keeps what else the input's type carries

    primitive.def_abstract_eval(abstract)
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=False))
    batching.primitive_batchers[primitive] = functools.partial(_batch, primitive, impl)
    return primitive


def _linear_rules(primitive: Primitive, partner: Primitive) -> None:
    def jvp(primals, tangents, **params):
        x, *fixed = primals
        if any(type(t) is not ad.Zero and t.dtype != jax.dtypes.float0 for t in tangents[1:]):
            raise NotImplementedError(f"{primitive.name} is linear in its first operand; the others are read as fixed")
        out = primitive.bind(x, *fixed, **params)
        if type(tangents[0]) is ad.Zero:
            return out, ad.Zero.from_primal_value(out)
        return out, primitive.bind(ad.instantiate_zeros(tangents[0]), *fixed, **params)

    def transposed(cotangent, x, *fixed, **params):
        if any(ad.is_undefined_primal(f) for f in fixed):
            raise NotImplementedError(f"{primitive.name} is linear in its first operand only")
        if type(cotangent) is ad.Zero:
            return (None, *(None for _ in fixed))
        aval = x.aval
        grad = partner.bind(ad.instantiate_zeros(cotangent), *fixed, **params)
        grad = sum_to_shape(grad, aval.shape)  # over the axes the operand was broadcast along
        return (grad.astype(aval.dtype), *(None for _ in fixed))

    ad.primitive_jvps[primitive] = jvp
    ad.primitive_transposes[primitive] = transposed


def _batch(primitive: Primitive, impl: Callable, operands, dims, **params):
    """``jax.vmap``'s rule: the mapped axis folded into every operand's leading (batch) axis.

    An unmapped operand keeps its shape where it is shared (a leading axis of 1, or a scalar) and
    is repeated for each mapped entry otherwise. A mapped operand without a batch axis of its own
    (a scalar per entry) cannot be folded: then the plain implementation is mapped instead.
    """
    mapped = [d is not None for d in dims]
    size = next(x.shape[d] for x, d, m in zip(operands, dims, mapped, strict=True) if m)
    moved = [jnp.moveaxis(x, d, 0) if m else x for x, d, m in zip(operands, dims, mapped, strict=True)]
    if any(m and x.ndim < 2 for x, m in zip(moved, mapped, strict=True)):
        axes = [0 if m else None for m in mapped]
        return jax.vmap(functools.partial(impl, **params), in_axes=axes)(*moved), 0
    batch = max((x.shape[1] if m else x.shape[0]) for x, m in zip(moved, mapped, strict=True) if x.ndim > 0)
    folded = []
    for x, m in zip(moved, mapped, strict=True):
        if not m:
            shared = x.ndim == 0 or x.shape[0] == 1
            folded.append(x if shared else jnp.tile(x, (size,) + (1,) * (x.ndim - 1)))
        else:
            x = jnp.broadcast_to(x, (size, batch, *x.shape[2:]))
            folded.append(x.reshape(size * batch, *x.shape[2:]))
    out = primitive.bind(*folded, **params)
    return out.reshape(size, batch, *out.shape[1:]), 0


def tangent_primitive(name: str) -> Callable:
    """A primitive for a function's tangent with a hand-written transpose: ``tangent(jvp, transpose, tangents,
    fixed)``, where ``jvp(tangents, fixed)`` is the tangent (linear in ``tangents``, a tuple of arrays) at the
    point ``fixed`` describes (a tuple of arrays or None, read, never differentiated), and ``transpose(fixed,
    cotangent)`` returns the tangents' cotangents (a tuple like ``tangents``).

    Called from a ``jax.custom_jvp`` rule, it gives the function a reverse mode that runs ``transpose`` (what a
    ``custom_vjp`` would give) while forward mode (``jax.jvp``) runs ``jvp``; reverse mode keeps ``fixed``
    as its residuals. ``jax.vmap`` maps both functions. Derivatives of the tangent with respect to
    ``fixed`` (second order) are not defined.
    """
    primitive = Primitive(name)

    def split(operands, count):
        return tuple(operands[:count]), operands[count:]

    def impl(*operands, jvp, transpose, count, fixed_tree):
        tangents, fixed = split(operands, count)
        return jvp(tangents, jax.tree.unflatten(fixed_tree, fixed))

    primitive.def_impl(impl)
    primitive.def_abstract_eval(
        lambda *operands, **params: jax.core.ShapedArray(
            *(lambda out: (out.shape, out.dtype))(jax.eval_shape(functools.partial(impl, **params), *operands))
        )
    )
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=False))

    def jvp_rule(primals, tangents, *, jvp, transpose, count, fixed_tree):
        if any(type(t) is not ad.Zero and t.dtype != jax.dtypes.float0 for t in tangents[count:]):
            raise NotImplementedError(f"{name}: no derivative with respect to the point it is taken at")
        params = dict(jvp=jvp, transpose=transpose, count=count, fixed_tree=fixed_tree)
        out = primitive.bind(*primals, **params)
        dots = [ad.instantiate_zeros(t) for t in tangents[:count]]
        return out, primitive.bind(*dots, *primals[count:], **params)

    def transpose_rule(cotangent, *operands, jvp, transpose, count, fixed_tree):
        tangents, fixed = split(operands, count)
        if any(ad.is_undefined_primal(f) for f in fixed):
            raise NotImplementedError(f"{name} is linear in its tangents only")
        if type(cotangent) is ad.Zero:
            return (None,) * len(operands)
        grads = transpose(jax.tree.unflatten(fixed_tree, fixed), ad.instantiate_zeros(cotangent))
        grads = [sum_to_shape(g, t.aval.shape).astype(t.aval.dtype) for g, t in zip(grads, tangents, strict=True)]
        return (*grads, *(None for _ in fixed))

    def batch_rule(operands, dims, *, jvp, transpose, count, fixed_tree):
        size = next(x.shape[d] for x, d in zip(operands, dims, strict=True) if d is not None)
        moved = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims, strict=True)]
        tangents = [
            x if d is not None else jnp.broadcast_to(x, (size, *x.shape)) for x, d in zip(moved, dims, strict=True)
        ][:count]
        fixed_axes = jax.tree.unflatten(fixed_tree, [None if d is None else 0 for d in dims[count:]])
        mapped_jvp = jax.vmap(jvp, in_axes=(0, fixed_axes))
        mapped_transpose = jax.vmap(transpose, in_axes=(fixed_axes, 0))
        out = primitive.bind(
            *tangents, *moved[count:], jvp=mapped_jvp, transpose=mapped_transpose, count=count, fixed_tree=fixed_tree
        )
        return out, 0

    ad.primitive_jvps[primitive] = jvp_rule
    ad.primitive_transposes[primitive] = transpose_rule
    batching.primitive_batchers[primitive] = batch_rule

    def tangent(jvp: Callable, transpose: Callable, tangents: tuple, fixed: tuple) -> jax.Array:
        leaves, fixed_tree = jax.tree.flatten(fixed)
        params = dict(jvp=jvp, transpose=transpose, count=len(tangents), fixed_tree=fixed_tree)
        return primitive.bind(*tangents, *leaves, **params)

    return tangent
