"""Attention on an accelerator: this library's paths against ``jax.nn.dot_product_attention``, per encoding.

    python benchmarks/device.py                        # an accelerator: T = 1k to 32k, H = 128 and 64, ~4 minutes
    python benchmarks/device.py --budget-seconds 900   # more of the grid
    python benchmarks/device.py --tiny                 # a CPU: T = 128 and 256, H = 64, Pallas interpreted
                                                       # (about 100 small programs compiled: minutes)

Causal self-attention of bfloat16 ``q, k, v [B, T, N, H]`` (``B·T = --tokens``, ``N·H = --width``, so the
arithmetic per call grows as T), forward, and forward and backward (the gradients with respect to q, k, v and
the encoding's parameters, pulled back from a fixed bfloat16 cotangent), per encoding and path:

* ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (a GPU only);
* ``xla``: the same with ``implementation="xla"``.
  For both, a rotation (RoPE) rotates q and k first (``hook.rotate``), and a bias encoding's bias is
  materialised inside the program as ``[1, N, T, S]`` (``hook.bias(context)``, the array a model shares across
  layers), cast to bfloat16 and passed as ``bias=``, so forward and backward includes its gradient to the
  encoding's parameters. NoPE on ``cudnn`` is plain attention without a bias: the baseline of the ratios.
* ``blockwise``: ``posenc_jax.functional.dot_product_attention(..., implementation="blockwise")``;
* ``pallas``: ``implementation="pallas"``, the flash-attention kernels computing the bias per tile (in Pallas'
  interpret mode on a CPU); a rotation rotates q and k before the kernel, as for ``cudnn``.

The encodings: NoPE, RoPE, and every registered encoding the Pallas kernels take, read at run time from
``posenc_jax.functional.kernels.pallas_dispatch.unsupported`` (or ``--encodings``). A path that cannot compute
an encoding gets a row saying why.

Time: each program is compiled first (``lower().compile()``, timed apart), run once (not counted), then run
``--reps`` times, each ended by ``block_until_ready``; the figure is the median. Every row of one run is
measured in the same process, so its ratios are side by side: each time over the baseline's (``cudnn`` NoPE at
the same T and H; XLA's plain attention, ``xla`` NoPE, on a backend without cuDNN or, marked †, where cuDNN's
failed). Memory: the compiled
program's own account (``memory_analysis()``: temporaries + arguments + output); on a GPU also the
allocator's peak in use (``memory_stats()``), given where the row raised it (the allocator's peak never comes
down, so a row that did not raise it is at most the earlier peak). ``rel. diff``: the largest difference from
the ``blockwise`` path's result over the largest magnitude of that result, in float32 (forward: the output;
forward and backward: the largest of dq's, dk's, dv's and the parameters' gradients' taken together).

Sizes: the grid is measured in priority order (H = 128 first; T = 8,192 first, then the lengths farthest from
those done), and a combination predicted to exceed what is left of ``--budget-seconds`` (from the compiles and
runs measured so far, the run time scaled by ``B·T²``) or the memory (``--memory-gib``; by default 90% of the
allocator's limit, or half the host's memory) is skipped, and printed as skipped. The table and a JSON file
are rewritten after every row, so a run stopped part-way keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from posenc_jax.functional import dot_product_attention, encoding_config, encoding_info, encoding_names
from posenc_jax.functional.core.context import attention_context
from posenc_jax.functional.core.forms import forms_of
from posenc_jax.functional.core.hooks import hook_names
from posenc_jax.functional.core.normalizers import softmax_weights
from posenc_jax.functional.kernels import pallas_dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = ("blockwise", "cudnn", "xla", "pallas")  # blockwise first: every other path's result is compared with it
MODES = ("fwd", "fwd+bwd")
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (128, 64)
TARGET_LENGTH = 8192  # the target size, measured first
FIRST_ENCODINGS = ("nope", "alibi", "t5", "rope")  # the baseline, the targets, the rotation
TINY = dict(lengths=(128, 256), head_dims=(64,), tokens=256, width=128, reps=2, budget_seconds=3600.0)
DEFAULT_COMPILE_SECONDS = 10.0  # the guess for a path's first compile, before any was measured


# --- the encodings and what each path can do with them ---------------------------------------------------------


def _no_hook(name: str) -> bool:
    """Whether ``name`` acts outside attention (embeddings, replaced positions): its attention is NoPE's."""
    return encoding_info(name).acts_on in ("embeddings", "positions")


def build_hooks(name: str, length: int, heads: int, head_dim: int) -> list:
    """``name``'s attention hooks as a model of ``heads`` x ``head_dim`` trained on 512 tokens builds them."""
    if name == "nope":
        return []
    info = encoding_info(name)
    config = encoding_config(name, **{key: info.small_settings[key] for key in info.required})
    config = config.for_lengths(train_length=min(512, length), max_length=length, head_dim=head_dim)
    return [
        config.build(config.init(jax.random.key(0), num_heads=heads, head_dim=head_dim, model_dim=heads * head_dim))
    ]


def _is_rotation(hook) -> bool:
    return set(hook_names(hook)) == {"rotate"}


def _split(hooks) -> tuple[list, list]:
    """``(rotations, the rest)``: the hooks that only rotate q and k, and the others."""
    return [h for h in hooks if _is_rotation(h)], [h for h in hooks if not _is_rotation(h)]


def pallas_reason(hooks) -> str | None:
    """Why the Pallas kernels cannot compute these hooks (rotations are applied before them), or None."""
    return pallas_dispatch.unsupported(_split(hooks)[1], softmax_weights, None, 0.0)


def jax_nn_reason(hooks) -> str | None:
    """Why ``jax.nn.dot_product_attention`` cannot take these hooks as a rotation and a bias, or None."""
    for hook in _split(hooks)[1]:
        if not forms_of(hook).has("prepared", "bias"):
            return f"{type(hook).__name__} is neither a rotation nor a bias of positions (no bias(context) form)"
    return None


def default_encodings() -> list[str]:
    """NoPE, RoPE and every registered encoding the Pallas kernels take (read from pallas_dispatch)."""
    names = ["nope", "rope"]
    for name in encoding_names():
        if name in names or _no_hook(name):
            continue
        if pallas_dispatch.unsupported(build_hooks(name, 256, 2, 64), softmax_weights, None, 0.0) is None:
            names.append(name)  # the kernels take it as it is (not only after a rotation outside them)
    first = [n for n in FIRST_ENCODINGS if n in names]
    return first + [n for n in names if n not in first]


# --- the programs ------------------------------------------------------------------------------------------------


def _scale(hooks, head_dim: int) -> float:
    prescribed = [float(h.score_scale(head_dim)) for h in hooks if forms_of(h).has("scale", "prescribed")]
    return prescribed[0] if prescribed else head_dim**-0.5


def attention(path: str, length: int, *, causal: bool, block: int | None):
    """``attend(q, k, v, hooks) -> out`` by ``path`` for self-attention at positions ``0 .. length - 1``."""
    positions = jnp.arange(length)

    def context_of(q, hooks):
        _, _, heads, head_dim = q.shape
        scale = _scale(hooks, head_dim)
        return attention_context(
            positions, positions, scale=scale, causal=causal, head_dim=head_dim, num_heads=heads
        ), scale

    def rotated(q, k, hooks, context):
        for hook in _split(hooks)[0]:
            q, k = hook.rotate(q, k, context)
        return q, k

    if path in ("cudnn", "xla"):

        def attend(q, k, v, hooks):
            context, scale = context_of(q, hooks)
            q, k = rotated(q, k, hooks, context)
            biases = [hook.bias(context) for hook in _split(hooks)[1]]
            bias = sum(biases[1:], biases[0]).astype(q.dtype) if biases else None
            return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=causal, implementation=path)

    elif path == "pallas":

        def attend(q, k, v, hooks):
            context, _ = context_of(q, hooks)
            q, k = rotated(q, k, hooks, context)
            return dot_product_attention(
                q,
                k,
                v,
                query_positions=positions,
                key_positions=positions,
                encodings=_split(hooks)[1],
                causal=causal,
                implementation="pallas",
                block_q=block,
                block_k=block,
            )

    else:

        def attend(q, k, v, hooks):
            return dot_product_attention(
                q,
                k,
                v,
                query_positions=positions,
                key_positions=positions,
                encodings=hooks,
                causal=causal,
                implementation="blockwise",
            )

    return attend


def program(attend, mode: str):
    """The forward, or the forward and backward (``(dq, dk, dv, d hooks)`` pulled back from ``dout``)."""
    if mode == "fwd":
        return lambda q, k, v, hooks, dout: attend(q, k, v, hooks)

    def both(q, k, v, hooks, dout):
        _, pull_back = jax.vjp(attend, q, k, v, hooks)
        return pull_back(dout)

    return both


def inputs(batch: int, length: int, heads: int, head_dim: int):
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16) for key in keys)


# --- measuring ---------------------------------------------------------------------------------------------------


def _float_leaves(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _relative_difference(result, reference) -> float:
    """The largest of ``max |result - reference| / max |reference|`` over the output (forward) or over dq, dk,
    dv and the parameters' gradients taken together (forward and backward), in float32. Together, because a
    parameter whose exact gradient is zero (FIRE's output bias: a constant per row, which softmax ignores) gets
    bfloat16 rounding noise on every path, with no scale of its own to be relative to."""
    if isinstance(reference, tuple):  # (dq, dk, dv, d hooks)
        groups = [[x] for x in reference[:3]], [[x] for x in result[:3]]
        groups = (groups[0] + [_float_leaves(reference[3])], groups[1] + [_float_leaves(result[3])])
    else:
        groups = [[reference]], [[result]]
    worst = 0.0
    for expected, found in zip(*groups, strict=True):
        if not expected:
            continue
        scale = max(float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in expected)
        error = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(found, expected, strict=True)
        )
        worst = max(worst, error / max(scale, 1e-30))
    return worst


def _device_memory() -> dict | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # a backend without an allocator's account
        return None
    return stats if stats and "peak_bytes_in_use" in stats else None


def memory_limit(gib: float | None) -> int:
    """The bytes a program may need: ``gib``, else 90% of the device allocator's limit, else half the host's."""
    if gib is not None:
        return int(gib * 2**30)
    stats = _device_memory()
    if stats and stats.get("bytes_limit"):
        return int(0.9 * stats["bytes_limit"])
    try:
        return int(0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def predicted_bytes(path: str, mode: str, batch: int, length: int, heads: int, head_dim: int, biases: int) -> int:
    """A rough floor of a program's memory before compiling it: the inputs and outputs, and the ``[.., T, S]``
    arrays a materialising path holds (the scores' float32 logits and weights, the bias in float32 and
    bfloat16, and their gradients). The compiled program's own account is checked again before it runs."""
    tokens = batch * length * heads * head_dim * 2
    both = mode == "fwd+bwd"
    total = (8 if both else 4) * tokens
    pairs = heads * length * length
    if path in ("cudnn", "xla") and biases:
        total += (12 if both else 6) * pairs
    if path == "xla":
        total += (16 if both else 8) * batch * pairs
    return total


class Planner:
    """Predicts a program's cost from the compiles and runs measured so far, against the deadline."""

    def __init__(self, deadline: float, reps: int):
        self.deadline, self.reps = deadline, reps
        self.runs: dict[tuple, list[tuple[float, float]]] = {}
        self.compiles: dict[str, list[float]] = {}

    def record(self, key: tuple, work: float, compile_seconds: float, run_seconds: float) -> None:
        self.compiles.setdefault(key[0], []).append(compile_seconds)
        self.runs.setdefault(key, []).append((work, run_seconds))

    def run_seconds(self, key: tuple, work: float) -> float | None:
        """The run time of ``key = (path, encoding, head_dim, mode)`` at ``work`` (``B·T²``), scaled from the
        nearest measured work of the same key, else of NoPE on the same path, else None."""
        path, _, head_dim, mode = key
        for candidate in (key, (path, "nope", head_dim, mode)):
            measured = self.runs.get(candidate)
            if measured:
                near_work, seconds = min(measured, key=lambda m: abs(math.log(m[0] / work)))
                return seconds * work / near_work
        return None

    def plan(self, key: tuple, work: float) -> tuple[int, str | None]:
        """``(reps, None)`` to measure, or ``(0, why)`` to skip: the compile and ``1 + reps`` runs must end
        before the deadline (with one rep where ``reps`` would not)."""
        compiled = self.compiles.get(key[0])
        compile_seconds = statistics.median(compiled) if compiled else DEFAULT_COMPILE_SECONDS
        run = self.run_seconds(key, work) or 0.0
        left = self.deadline - time.monotonic()
        for reps in (self.reps, 1):
            if compile_seconds + (1 + reps) * run <= left:
                return reps, None
        need = compile_seconds + 2 * run
        return (
            0,
            f"budget: predicted {need:.3g} s (compile {compile_seconds:.3g} s, run {run:.3g} s), {left:.3g} s left",
        )


def measure(compiled, arguments, reps: int) -> tuple[list[float], object]:
    """``reps`` steady-state run times (after one run not counted) and the last result."""
    result = compiled(*arguments)
    jax.block_until_ready(result)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = compiled(*arguments)
        jax.block_until_ready(result)
        times.append(time.perf_counter() - start)
    return times, result


def _error(exception: BaseException) -> str:
    text = f"{type(exception).__name__}: {exception}".strip().splitlines()
    return (text[0] if text else type(exception).__name__)[:300]


def measure_mode(case: dict, mode: str, attend, hooks, arrays, planner: Planner, limit: int, reference) -> dict:
    """One program of a row: skipped (why), failed (the error's first line), or measured."""
    batch, length, heads, head_dim = case["batch"], case["length"], case["heads"], case["head_dim"]
    biases = len(_split(hooks)[1])
    need = predicted_bytes(case["path"], mode, batch, length, heads, head_dim, biases)
    if need > limit:
        return {"status": "skipped", "reason": f"memory: predicted over {_size(need)}, limit {_size(limit)}"}
    key = (case["path"], case["encoding"], head_dim, mode)
    work = float(batch) * length * length
    reps, why = planner.plan(key, work)
    if why:
        return {"status": "skipped", "reason": why}
    q, k, v, dout = arrays
    try:
        started = time.perf_counter()
        # jax.nn's XLA path mixes dtypes, which jax's "strict" promotion (this project's tests) refuses.
        promotion = "standard" if case["path"] in ("cudnn", "xla") else jax.config.jax_numpy_dtype_promotion
        with jax.numpy_dtype_promotion(promotion):
            compiled = jax.jit(program(attend, mode)).lower(q, k, v, hooks, dout).compile()
        compile_seconds = time.perf_counter() - started
        analysis = compiled.memory_analysis()
        memory = None
        if analysis is not None:
            memory = analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes
        result = {"status": "measured", "compile_seconds": compile_seconds, "memory_bytes": memory}
        if analysis is not None:
            result["temp_bytes"] = analysis.temp_size_in_bytes
        if memory is not None and memory > limit:
            planner.compiles.setdefault(case["path"], []).append(compile_seconds)
            return {**result, "status": "skipped", "reason": f"memory: compiled {_size(memory)}, limit {_size(limit)}"}
        before = _device_memory()
        times, out = measure(compiled, (q, k, v, hooks, dout), reps)
        after = _device_memory()
    except Exception as exception:  # a path that fails on this backend (lowering, cuDNN's checks, memory)
        return {"status": "error", "reason": _error(exception)}
    planner.record(key, work, compile_seconds, statistics.median(times))
    result.update(seconds=statistics.median(times), runs=times)
    if before and after:
        raised = after["peak_bytes_in_use"] > before["peak_bytes_in_use"]
        result["device_peak_bytes"] = after["peak_bytes_in_use"]
        result["device_peak_raised"] = raised
    result["finite"] = all(bool(jnp.all(jnp.isfinite(x))) for x in _float_leaves(out))
    if reference is not None:
        result["relative_difference"] = _relative_difference(out, reference)
    result["_out"] = out
    return result


# --- the grid ----------------------------------------------------------------------------------------------------


def length_order(lengths) -> list[int]:
    """The target length first (or the middle one), then repeatedly the length farthest (in log2) from those
    taken, the longer on a tie: a budget cut short leaves the range covered, not its top cut off."""
    rest = sorted(set(lengths))
    first = TARGET_LENGTH if TARGET_LENGTH in rest else rest[len(rest) // 2]
    order = [first]
    rest.remove(first)
    while rest:
        far = max(rest, key=lambda n: (min(abs(math.log2(n / m)) for m in order), n))
        order.append(far)
        rest.remove(far)
    return order


def sizes(length: int, head_dim: int, tokens: int, width: int) -> tuple[int, int]:
    """``(B, N)``: ``B·T = tokens`` (at least one row), ``N·H = width`` (at least one head)."""
    return max(1, tokens // length), max(1, width // head_dim)


def run(args, report) -> list[dict]:
    """Measures the grid in priority order; ``report(rows)`` after every row."""
    backend = jax.default_backend()
    planner = Planner(args.deadline, args.reps)
    limit = memory_limit(args.memory_gib)
    rows: list[dict] = []
    for head_dim in sorted(set(args.head_dims), reverse=True):
        for length in length_order(args.lengths):
            batch, heads = sizes(length, head_dim, args.tokens, args.width)
            arrays = inputs(batch, length, heads, head_dim)
            for encoding in args.encodings:
                hooks = build_hooks(encoding, length, heads, head_dim)
                references = dict.fromkeys(MODES)
                for path in args.paths:
                    case = dict(
                        encoding=encoding, path=path, length=length, head_dim=head_dim, batch=batch, heads=heads
                    )
                    why = None
                    if path == "cudnn" and backend != "gpu":
                        why = f"no cuDNN on {backend}"
                    elif path in ("cudnn", "xla"):
                        why = jax_nn_reason(hooks)
                    elif path == "pallas":
                        why = pallas_reason(hooks)
                    if why:
                        case.update({mode: {"status": "skipped", "reason": why} for mode in MODES})
                    else:
                        attend = attention(path, length, causal=not args.bidirectional, block=args.block)
                        for mode in MODES:
                            result = measure_mode(case, mode, attend, hooks, arrays, planner, limit, references[mode])
                            out = result.pop("_out", None)
                            if path == "blockwise" and out is not None:
                                references[mode] = out
                            case[mode] = result
                            del out
                    rows.append(case)
                    report(rows)
            del arrays
    return rows


# --- the table ---------------------------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "–"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def baseline_path(backend: str) -> str:
    return "cudnn" if backend == "gpu" else "xla"


def ratios(rows: list[dict], backend: str) -> dict:
    """``(length, head_dim, mode) -> (seconds, mark)`` of the baseline: NoPE on cudnn (on xla without cuDNN);
    where cuDNN's was not measured on a GPU, xla's, marked ``†``."""
    paths = ("cudnn", "xla") if baseline_path(backend) == "cudnn" else ("xla",)
    found = {}
    for path, mark in zip(paths, ("", " †"), strict=False):
        for row in rows:
            if row["encoding"] != "nope" or row["path"] != path:
                continue
            for mode in MODES:
                at = (row["length"], row["head_dim"], mode)
                if row.get(mode, {}).get("status") == "measured" and at not in found:
                    found[at] = (row[mode]["seconds"], mark)
    return found


def header(facts: dict) -> str:
    base = "cuDNN's" if facts["backend"] == "gpu" else "XLA's"
    base_row = "`cudnn` NoPE" if facts["backend"] == "gpu" else "`xla` NoPE (no cuDNN on this backend)"
    settings = facts["settings"]
    causal = "bidirectional" if settings["bidirectional"] else "causal"
    return "\n".join(
        [
            f"# Attention on {facts['device_kind']} ({facts['backend']})",
            "",
            f"`{facts['command']}`, {facts['date']}; jax {facts['jax']}, jaxlib {facts['jaxlib']}; "
            f"{facts['device_count']} device(s), one used.",
            "",
            f"**Precision: bfloat16 inputs.** q, k, v and the cotangent are bfloat16 `[B, T, N, H]`; "
            f"`jax_default_matmul_precision` = {facts['matmul_precision']} (None: the backend's default, under which "
            "an H100 or H200 runs float32 matrix products in TF32); each path chooses its internal precision (this "
            "library's blockwise and Pallas paths compute scores and the softmax in float32); the bias handed to "
            "`jax.nn.dot_product_attention` is cast to bfloat16.",
            "",
            f"{causal.capitalize()} self-attention, B·T = {settings['tokens']:,} tokens per call and N·H = "
            f"{settings['width']:,} (B = max(1, {settings['tokens']:,} / T), N = {settings['width']:,} / H); "
            "forward, and forward and backward (gradients of q, k, v and the encoding's parameters). Time: "
            f"median of {settings['reps']} runs after a compile and one run not counted, ms. Ratio (×): to "
            f"{base} plain attention without a bias ({base_row}) at the same T and H, measured in this run"
            + ("; † where cuDNN's was not measured: to `xla` NoPE. " if facts["backend"] == "gpu" else ". ")
            + "Memory: the compiled program's account (temporaries + arguments + output); device peak: the "
            "allocator's peak while the row ran, where the row raised it (≤: it did not, so at most that). "
            "rel. diff: largest difference from the blockwise path's result over its largest magnitude (the "
            "output; the largest of dq's, dk's, dv's and the parameters' gradients' taken together). "
            "`cudnn`/`xla` take a bias encoding as a materialised `[1, N, T, S]` bias and rotate q, k for RoPE; "
            "`pallas` computes the bias per tile (RoPE: q, k rotated before the kernel).",
        ]
    )


def _cell(result: dict | None, key: str, base: float | None = None) -> str:
    if not result or result.get("status") != "measured":
        return result["status"] if result and key == "seconds" else "–"
    if key == "seconds":
        return _ms(result["seconds"])
    if key == "ratio":
        return f"{result['seconds'] / base[0]:.2f}×{base[1]}" if base else "–"
    if key == "memory":
        return _size(result.get("memory_bytes"))
    if key == "peak":
        if "device_peak_bytes" not in result:
            return "–"
        return ("" if result["device_peak_raised"] else "≤ ") + _size(result["device_peak_bytes"])
    if key == "diff":
        value = result.get("relative_difference")
        return "–" if value is None else f"{value:.1e}"
    raise ValueError(key)


def table(rows: list[dict], facts: dict) -> str:
    base = ratios(rows, facts["backend"])
    order = {name: i for i, name in enumerate(facts["settings"]["encodings"])}
    path_order = {name: i for i, name in enumerate(PATHS)}
    lines = [header(facts)]
    for head_dim in sorted({row["head_dim"] for row in rows}, reverse=True):
        lines += [
            "",
            f"## H = {head_dim}",
            "",
            "| T | B×N | encoding | path | fwd ms | fwd × | fwd+bwd ms | fwd+bwd × | memory fwd | memory fwd+bwd | "
            "device peak fwd+bwd | rel. diff fwd | rel. diff fwd+bwd | note |",
            "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        selected = sorted(
            (row for row in rows if row["head_dim"] == head_dim),
            key=lambda row: (row["length"], order.get(row["encoding"], len(order)), path_order[row["path"]]),
        )
        for row in selected:
            fwd, both = row.get("fwd"), row.get("fwd+bwd")
            at = (row["length"], head_dim)
            notes = []
            for mode, result in (("fwd", fwd), ("fwd+bwd", both)):
                if result and result["status"] != "measured":
                    notes.append(f"{mode} {result['status']}: {result['reason']}")
                elif result and not result["finite"]:
                    notes.append(f"{mode}: NOT FINITE")
            note = "; ".join(notes)
            if len(notes) == 2 and fwd["reason"] == both["reason"]:
                note = f"{fwd['status']}: {fwd['reason']}"
            cells = [
                f"{row['length']:,}",
                f"{row['batch']}×{row['heads']}",
                row["encoding"],
                row["path"],
                _cell(fwd, "seconds"),
                _cell(fwd, "ratio", base.get((*at, "fwd"))),
                _cell(both, "seconds"),
                _cell(both, "ratio", base.get((*at, "fwd+bwd"))),
                _cell(fwd, "memory"),
                _cell(both, "memory"),
                _cell(both, "peak"),
                _cell(fwd, "diff"),
                _cell(both, "diff"),
                note.replace("|", "\\|"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def facts_of(args, argv) -> dict:
    device = jax.devices()[0]
    import jaxlib

    return {
        "command": " ".join(["python benchmarks/device.py", *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "?"),
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "matmul_precision": repr(jax.config.jax_default_matmul_precision),
        "dtype": "bfloat16",
        "settings": {
            "lengths": list(args.lengths),
            "head_dims": list(args.head_dims),
            "tokens": args.tokens,
            "width": args.width,
            "reps": args.reps,
            "budget_seconds": args.budget_seconds,
            "encodings": list(args.encodings),
            "paths": list(args.paths),
            "bidirectional": args.bidirectional,
            "pallas_block": args.block,
        },
    }


def write(out: pathlib.Path, rows: list[dict], facts: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table(rows, facts))
    (out / "results.json").write_text(json.dumps({**facts, "rows": rows}, indent=1) + "\n")


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a CPU preset: T = 128, 256; H = 64; 256 tokens, N·H = 128; budget 3600 s (compiling dominates)",
    )
    parser.add_argument("--lengths", type=int, nargs="+", help=f"T (default {', '.join(map(str, LENGTHS))})")
    parser.add_argument("--head-dims", type=int, nargs="+", help="H (default 128 64)")
    parser.add_argument("--tokens", type=int, help="B·T per call (default 16384)")
    parser.add_argument("--width", type=int, help="N·H (default 2048)")
    parser.add_argument("--encodings", help="comma-separated (default: nope, rope and every encoding pallas takes)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--reps", type=int, help="timed runs per program (default 5)")
    parser.add_argument("--budget-seconds", type=float, help="the whole run's time, setup included (default 240)")
    parser.add_argument("--memory-gib", type=float, help="skip programs needing more (default: 90%% of the device's)")
    parser.add_argument("--block", type=int, default=None, help="the Pallas kernels' tile (default: theirs)")
    parser.add_argument("--bidirectional", action="store_true", help="no causal mask")
    parser.add_argument(
        "--out", type=pathlib.Path, help="folder for table.md and results.json (default docs/device/<backend>-<date>)"
    )
    args = parser.parse_args(argv)
    defaults = dict(lengths=LENGTHS, head_dims=HEAD_DIMS, tokens=16384, width=2048, reps=5, budget_seconds=240.0)
    for name, value in (TINY if args.tiny else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown:
        parser.error(f"--paths {unknown} unknown: choose from {', '.join(PATHS)}")
    args.paths = [p for p in PATHS if p in args.paths]  # blockwise first, the others compare with it
    for name in ("lengths", "head_dims"):
        bad = [n for n in getattr(args, name) if n < 1]
        if bad:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {bad}")
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.encodings is None:
        args.encodings = default_encodings()
    else:
        args.encodings = [n.strip() for n in args.encodings.split(",") if n.strip()]
        known = set(encoding_names())
        bad = [n for n in args.encodings if n not in known or (n != "nope" and _no_hook(n))]
        if bad:
            parser.error(f"--encodings {bad}: not registered or acting outside attention; see encoding_names()")
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    started = time.monotonic()
    args = parse(argv)
    args.deadline = started + args.budget_seconds - 5.0  # the setup counts; 5 s kept for the last writes
    facts = facts_of(args, argv)
    out = args.out or ROOT / "docs" / "device" / f"{facts['backend']}-{datetime.date.today().isoformat()}"
    device = jax.devices()[0]
    print(
        f"{device.platform} ({device.device_kind}), jax {jax.__version__}; bfloat16 inputs; "
        f"{len(args.encodings)} encodings x {len(args.paths)} paths x {len(args.lengths)} lengths x "
        f"{len(args.head_dims)} head dims; budget {args.budget_seconds:.0f} s; writing to {out}",
        flush=True,
    )

    def report(rows):
        row = rows[-1]
        states = ", ".join(
            f"{mode} "
            + (_ms(row[mode]["seconds"]) + " ms" if row[mode]["status"] == "measured" else row[mode]["status"])
            for mode in MODES
        )
        print(f"T={row['length']} H={row['head_dim']} {row['encoding']:>14s} {row['path']:>9s}: {states}", flush=True)
        write(out, rows, facts)

    rows = run(args, report)
    write(out, rows, facts)
    print(table(rows, facts), flush=True)


if __name__ == "__main__":
    main()
