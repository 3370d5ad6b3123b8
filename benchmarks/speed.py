"""Speed and memory of every encoding, as ratios measured side by side in one process.

    python benchmarks/speed.py [--rounds 9] [--sections rope,attention,memory,train,decode] [--quick]
                               [--encodings rope,t5,...]

Every figure is a ratio to a baseline timed in the same process, in the same rounds:
each round runs every case once (in a rotated order; the RoPE table's cases three times
in a row, their median taken, see ``paired_times``), each case's time is divided by
the baseline's time of that round, and the table prints the median of those ratios and
their range (min-max) over the rounds. Absolute times depend on the machine and on
whatever else runs on it; the paired ratios much less so. Compare ratios, and re-run on a
quiet machine before trusting a second decimal.

Sections (the issue's targets in the last column):

* ``rope``: :func:`apply_rope_qk` on q, k ``[4, 2048, 16, 128]`` against a copy of q and k,
  per call, in float32 and bfloat16, both layouts; beside it the same rotation written as
  three other projects write it (gemma's ``apply_rope``: angles and sin/cos inside the
  function, split halves and a concatenate; a cached table: cos/sin computed once outside
  the jitted function and passed in, Hugging Face style ``rotate_half``; a complex
  multiply with precomputed ``e^{iθ}``, as Meta's Llama does); four rotations in a row with
  advancing positions in one jitted function; and whether the compiled program evaluates
  sin/cos only on position tables of at most ``T·R`` values (never inside the ``[B, T, N, H]`` loops);
* ``attention``: causal attention, B=1, N=8, T=1024, H=64: our plain attention against
  ``jax.nn.dot_product_attention``, and every encoding against our plain attention
  (Transformer-XL with a 512-wide sinusoid);
* ``memory``: compiled temporary memory of causal attention with each encoding at T=4096,
  against plain attention;
* ``train``: a training step (forward, backward, AdamW) and a forward pass of a 2-layer
  Transformer (D=256, 4 heads, T=512, batch 8) with each encoding, against NoPE;
* ``decode``: one decoding step (batch 8, after a prefill of 512 tokens) with each encoding
  that decodes with a KV cache, against NoPE's step, with the split-state ``jax.jit`` step
  of :func:`posenc_jax.nn.decode_step`, and the number of compilations over 100 steps.
"""

from __future__ import annotations

import argparse
import importlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posenc_jax.functional import (
    apply_rope_qk,
    encoding_info,
    encoding_names,
)


@dataclass(frozen=True)
class Library:
    """The modules the attention, memory, train and decode cases are built from: posenc_jax's, or
    those of a second copy of the package under another name (``benchmarks/old_vs_new.py``)."""

    functional: ModuleType
    nn: ModuleType
    hooks: ModuleType

    @classmethod
    def load(cls, package: str = "posenc_jax") -> Library:
        return cls(
            functional=importlib.import_module(f"{package}.functional"),
            nn=importlib.import_module(f"{package}.nn"),
            hooks=importlib.import_module(f"{package}.functional.core.hooks"),
        )


LIBRARY = Library.load()

SECTIONS = ("rope", "attention", "memory", "train", "decode")
ROPE_CALLS = 3  # calls in a row per case and round in the RoPE table (see paired_times)
ONLY: set[str] | None = None  # --encodings: a subset of the registered names (NoPE stays, as the baseline)


def _selected(names: list[str]) -> list[str]:
    return [name for name in names if ONLY is None or name in ONLY or name == "nope"]


# ---------------------------------------------------------------------------------------------
# Measurement


def paired_times(
    cases: dict[str, Callable[[], object]], rounds: int, calls: int = 1, alternate: bool = False
) -> dict[str, np.ndarray]:
    """Runs every case per round (order rotated each round); ``[rounds]`` seconds per case.

    ``calls``: a case's time in a round is the median of that many calls in a row, its steady
    state (on the 2-core CPU the first call of a memory-bound case after another case was
    slower, by an amount that varied with the case before). ``alternate``: every other round
    runs the rotated order backwards, so of two neighbouring cases each runs first in half the
    rounds (``old_vs_new.py`` puts each row's two versions side by side).
    """
    for run in cases.values():
        jax.block_until_ready(run())  # compile and warm up
    names = list(cases)
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in reversed(order) if alternate and r % 2 else order:
            each = []
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(cases[name]())
                each.append(time.perf_counter() - start)
            times[name].append(float(np.median(each)))
    return {name: np.asarray(t) for name, t in times.items()}


def ratio_cell(times: dict[str, np.ndarray], name: str, base: str) -> str:
    """``median (min-max)`` of the per-round ratios of ``name`` to ``base``."""
    r = times[name] / times[base]
    return f"{np.median(r):.2f}× ({r.min():.2f}–{r.max():.2f})"


def print_table(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |", flush=True)


def temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


# ---------------------------------------------------------------------------------------------
# RoPE, and the formulations other projects use, written here as they write them


def gemma_style_rope(x, positions, *, base=10000.0):
    """Half layout; angles, sin and cos computed inside; halves split and concatenated (gemma)."""
    half = x.shape[-1] // 2
    timescale = base ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angles = (positions[..., None].astype(jnp.float32) / timescale)[..., None, :]  # [T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = x[..., :half], x[..., half:]
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)


def cached_tables(positions, head_dim, *, base=10000.0):
    """Hugging Face style tables ``[T, H]``: cos and sin of ``cat(freqs, freqs)``, made once."""
    inv = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    freqs = np.outer(np.asarray(positions), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return jnp.asarray(np.cos(emb), jnp.float32), jnp.asarray(np.sin(emb), jnp.float32)


def cached_table_rope(x, cos, sin):
    """``x·cos + rotate_half(x)·sin`` with the tables passed in (computed outside the jit)."""
    half = x.shape[-1] // 2
    rotated_half = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x.astype(jnp.float32) * cos + rotated_half.astype(jnp.float32) * sin).astype(x.dtype)


def complex_rope(x, freqs_cis):
    """Interleaved pairs as complex numbers times a precomputed ``e^{iθ}`` ``[T, H/2]`` (Llama)."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    z = jax.lax.complex(pairs[..., 0], pairs[..., 1]) * freqs_cis[:, None, :]
    return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1).reshape(x.shape).astype(x.dtype)


def trig_fusion_sizes(fn, *args) -> list[int]:
    """The output sizes (elements) of the compiled computations of ``fn`` that evaluate sin or cos."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    sizes = []
    for computation in text.split("\n\n"):
        if not re.search(r"\b(sine|cosine)\(", computation):
            continue
        result = computation.strip().split("\n")[0].split("->")[-1]
        sizes.append(
            max(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", result))
        )
    return sizes


def full_size_passes(fn, *args, elements: int) -> list[str]:
    """The element types of the top-level computations of ``fn``'s compiled program whose output
    has at least ``elements`` values (each a pass over a whole q or k): e.g. ``["f32", "bf16"]``."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    passes = []
    for line in text[text.index("ENTRY") :].split("\n")[1:]:
        found = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(", line)
        if not found or found.group(3) in ("parameter", "bitcast", "get-tuple-element", "tuple", "copy-start"):
            continue
        if np.prod([int(d) for d in found.group(2).split(",") if d]) >= elements:
            passes.append(found.group(1))
    return passes


def rope_section(rounds: int, quick: bool) -> None:
    shape = (2, 1024, 8, 128) if quick else (4, 2048, 16, 128)
    batch, length, heads, head_dim = shape
    rng = np.random.default_rng(0)
    positions = jnp.arange(length)
    cos, sin = cached_tables(np.arange(length), head_dim)
    inv = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.outer(np.arange(length), inv)
    freqs_cis = jnp.asarray(np.cos(angles) + 1j * np.sin(angles), jnp.complex64)

    copy = jax.jit(lambda q, k: (jnp.copy(q), jnp.copy(k)))
    rows = []
    checks = []
    for dtype in (jnp.float32, jnp.bfloat16):
        q = jnp.asarray(rng.normal(size=shape), dtype)
        k = jnp.asarray(rng.normal(size=shape), dtype)
        fns = {
            "copy": lambda q, k: copy(q, k),
        }
        for layout in ("interleaved", "half"):
            rope = jax.jit(lambda q, k, p, layout=layout: apply_rope_qk(q, k, p, p, layout=layout))
            fns[f"apply_rope_qk ({layout})"] = lambda q, k, rope=rope: rope(q, k, positions)
            four = jax.jit(lambda q, k, p, layout=layout: _four_rotations(q, k, p, layout))
            fns[f"4 × apply_rope_qk in a row ({layout})"] = lambda q, k, four=four: four(q, k, positions)
        gemma = jax.jit(lambda q, k, p: (gemma_style_rope(q, p), gemma_style_rope(k, p)))
        fns["gemma-style apply_rope (half)"] = lambda q, k, gemma=gemma: gemma(q, k, positions)
        table = jax.jit(lambda q, k, c, s: (cached_table_rope(q, c, s), cached_table_rope(k, c, s)))
        fns["cached cos/sin tables, rotate_half (half)"] = lambda q, k, table=table: table(q, k, cos, sin)
        cplx = jax.jit(lambda q, k, f: (complex_rope(q, f), complex_rope(k, f)))
        fns["complex multiply, precomputed e^{iθ} (interleaved)"] = lambda q, k, cplx=cplx: cplx(q, k, freqs_cis)
        # Memory-bound calls of ~20 ms: timed in steady state, the median of three calls in a row per round.
        cases = {name: (lambda fn=fn, q=q, k=k: fn(q, k)) for name, fn in fns.items()}
        times = paired_times(cases, rounds, calls=ROPE_CALLS)
        name = jnp.dtype(dtype).name
        for case in fns:
            if case != "copy":
                rows.append((case, name, ratio_cell(times, case, "copy")))
        for layout in ("interleaved", "half"):
            sizes = trig_fusion_sizes(
                lambda q, k, p, layout=layout: apply_rope_qk(q, k, p, p, layout=layout), q, k, positions
            )
            ok = max(sizes) <= 2 * length * head_dim  # tables of at most 2R values per position
            four_passes = full_size_passes(
                lambda q, k, p, layout=layout: _four_rotations(q, k, p, layout), q, k, positions, elements=q.size
            )
            kinds = ", ".join(f"{four_passes.count(t)} {t}" for t in sorted(set(four_passes)))
            checks.append((f"apply_rope_qk ({layout}), {name}", "yes" if ok else "NO", max(sizes), kinds))
    print_table(
        f"RoPE on q, k {list(shape)} vs a copy of q and k, each the median of {ROPE_CALLS} calls in a row per round "
        "(target ≤ 1.5× per call, ≤ 2× for four in a row)",
        ("case", "dtype", "time vs copy, median (range)"),
        rows,
    )
    print_table(
        "RoPE's compiled program: sin/cos only on position tables; four rotations in a row fused or not",
        (
            "function",
            "sin/cos only on tables",
            "largest output of a computation with sin/cos (elements)",
            "passes over a whole q or k, four in a row (written as)",
        ),
        checks,
    )


def _four_rotations(q, k, positions, layout):
    for i in range(4):
        q, k = apply_rope_qk(q, k, positions + i, positions + i, layout=layout)
    return q, k


# ---------------------------------------------------------------------------------------------
# Attention and its memory


def benchmark_config(name: str, *, length: int, head_dim: int, lib: Library = LIBRARY):
    """The registered config with its defaults (its small settings where it has required ones), sized for
    sequences of ``length`` tokens (``for_lengths``: CoPE's count range, the axial grid width)."""
    try:
        config = lib.functional.encoding_config(name)
    except ValueError:
        config = lib.functional.encoding_config(name, **lib.functional.encoding_info(name).small_settings)
    return config.for_lengths(train_length=length, max_length=length, head_dim=head_dim)


def _hook(name: str, *, num_heads: int, head_dim: int, model_dim: int, length: int, lib: Library = LIBRARY):
    config = benchmark_config(name, length=length, head_dim=head_dim, lib=lib)
    params = config.init(jax.random.key(1), num_heads=num_heads, head_dim=head_dim, model_dim=model_dim)
    # Learned tables start near zero; perturb them so no term is trivially zero.
    params = jax.tree.map(lambda p: p + 0.01 * jax.random.normal(jax.random.key(2), p.shape, p.dtype), params)
    return config.build(params)


def attention_encodings(causal: bool = True) -> list[str]:
    """Registered encodings that act in attention (per layer or as a shared bias), for this direction."""
    names = []
    for name in encoding_names():
        info = encoding_info(name)
        if info.acts_on not in ("attention", "shared_bias") or name == "nope":
            continue
        if ("causal" if causal else "bidirectional") not in info.forms:
            continue
        names.append(name)
    return _selected(names)


def _attention_fn(hooks, lib: Library = LIBRARY, **options):
    """Causal self-attention ``(q, k, v, pos) -> out`` with ``hooks``; ``options`` (e.g. ``implementation``)
    passed on to ``dot_product_attention``."""

    def run(q, k, v, pos):
        return lib.functional.dot_product_attention(
            q, k, v, query_positions=pos, key_positions=pos, encodings=hooks, causal=True, **options
        )

    return run


def attention_section(rounds: int, quick: bool) -> None:
    batch, length, heads, head_dim = (1, 512, 8, 64) if quick else (1, 1024, 8, 64)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32) for _ in range(3))
    pos = jnp.arange(length)
    plain = jax.jit(_attention_fn([]))
    reference = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
    cases = {"plain": lambda: plain(q, k, v, pos), "jax.nn.dot_product_attention": lambda: reference(q, k, v)}
    for name in attention_encodings():
        hook = _hook(name, num_heads=heads, head_dim=head_dim, model_dim=512, length=length)
        fn = jax.jit(_attention_fn([hook]))
        cases[name] = lambda fn=fn: fn(q, k, v, pos)
    times = paired_times(cases, rounds)
    rows = [
        ("plain (ours) vs jax.nn.dot_product_attention", ratio_cell(times, "plain", "jax.nn.dot_product_attention"))
    ]
    rows += [(f"{name} vs plain", ratio_cell(times, name, "plain")) for name in cases if name not in rows[0][0]]
    print_table(
        f"Causal attention, B={batch}, N={heads}, T={length}, H={head_dim} (targets: plain ≤ 1.05× jax.nn; "
        f"DeBERTa, Transformer-XL ≤ 1.5× plain)",
        ("case", "time, median (range)"),
        rows,
    )


def memory_section(quick: bool) -> None:
    batch, length, heads, head_dim = (1, 1024, 8, 64) if quick else (1, 4096, 8, 64)
    spec = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    pos = jax.ShapeDtypeStruct((length,), jnp.int32)
    plain = temp_bytes(_attention_fn([]), spec, spec, spec, pos)
    rows = [("plain", f"{plain / 2**20:.0f} MiB", "1.00×")]
    for name in attention_encodings():
        hook = _hook(name, num_heads=heads, head_dim=head_dim, model_dim=512, length=length)
        if isinstance(hook, LIBRARY.hooks.BiasHook):
            kind = "position bias"
        else:
            kind = "computed term" if "logits" in encoding_info(name).hooks else "rotation"
        used = temp_bytes(_attention_fn([hook]), spec, spec, spec, pos)
        rows.append((f"{name} ({kind})", f"{used / 2**20:.0f} MiB", f"{used / plain:.2f}×"))
    print_table(
        f"Compiled temporary memory, causal attention, B={batch}, N={heads}, T=S={length}, H={head_dim} "
        f"(target ≤ 1.1× plain with a computed logits term)",
        ("encoding", "temp", "vs plain"),
        rows,
    )


# ---------------------------------------------------------------------------------------------
# Models: training step, forward, decoding step

VOCAB = 256


def model_encodings(causal: bool = True) -> list[str]:
    """Registered encodings a causal Transformer can take (NoPE first: it is the baseline)."""
    names = ["nope"]
    for name in encoding_names():
        info = encoding_info(name)
        if name == "nope" or ("causal" if causal else "bidirectional") not in info.forms:
            continue
        names.append(name)
    return _selected(names)


def _model(name: str, *, model_dim: int, heads: int, layers: int, length: int, lib: Library = LIBRARY):
    return lib.nn.Transformer(
        vocab_size=VOCAB,
        model_dim=model_dim,
        num_layers=layers,
        num_heads=heads,
        mlp_dim=4 * model_dim,
        encoding=benchmark_config(name, length=length, head_dim=model_dim // heads, lib=lib),
        causal=True,
        rngs=nnx.Rngs(0),
    )


def _train_functions(model, batch: dict):
    """Split-state ``jax.jit`` training step (AdamW) and forward."""
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(batch["inputs"], batch["positions"])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
            return -jnp.take_along_axis(logp, batch["targets"][..., None], -1).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    model_graph, model_state = nnx.split(model)

    @jax.jit
    def forward(state, batch):
        return nnx.merge(model_graph, state)(batch["inputs"], batch["positions"])

    holder = {"state": state}

    def run_step():
        loss, holder["state"] = step(holder["state"], batch)
        return loss

    return run_step, lambda: forward(model_state, batch)


def train_section(rounds: int, quick: bool) -> None:
    batch_size, length, model_dim, heads, layers = (4, 256, 128, 4, 2) if quick else (8, 512, 256, 4, 2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (batch_size, length + 1)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.arange(length)}
    steps, forwards = {}, {}
    for name in model_encodings():
        model = _model(name, model_dim=model_dim, heads=heads, layers=layers, length=length)
        steps[name], forwards[name] = _train_functions(model, batch)
    step_times = paired_times(steps, rounds)
    forward_times = paired_times(forwards, rounds)
    rows = [
        (name, ratio_cell(step_times, name, "nope"), ratio_cell(forward_times, name, "nope"))
        for name in steps
        if name != "nope"
    ]
    print_table(
        f"Transformer ({layers} layers, D={model_dim}, {heads} heads, T={length}, batch {batch_size}) vs NoPE "
        f"(targets: T5, Kerple, clipped bias ≤ 1.1×; Shaw, Transformer-XL, DeBERTa, CoPE ≤ 1.5×)",
        ("encoding", "train step, median (range)", "forward, median (range)"),
        rows,
    )


class _Decoder:
    """One encoding's model, prefilled, stepping one token at a time (caches donated each step)."""

    def __init__(self, name, *, model_dim, heads, layers, batch, prefill, capacity, rng, lib: Library = LIBRARY):
        self.model = _model(name, model_dim=model_dim, heads=heads, layers=layers, length=capacity, lib=lib)
        self.traces = 0
        model = self.model
        # the split-state decoding step (absent from older checkouts, for before/after runs)
        decode_step = getattr(lib.nn, "decode_step", None)
        if decode_step is not None:
            self.step = decode_step(model, on_trace=self._count)
        else:  # before the split-state step existed: nnx.jit, as the old tests did

            @nnx.jit
            def step(model, tokens, positions, caches):
                self._count()
                return model.decode(tokens, positions, caches)

            self.step = lambda tokens, positions, caches: step(model, tokens, positions, caches)
        tokens = jnp.asarray(rng.integers(0, VOCAB, (batch, prefill)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(prefill), (batch, prefill))
        caches = model.init_cache(batch, capacity)
        _, self.caches = jax.jit(lambda t, p, c: nnx.merge(*nnx.split(model)).decode(t, p, c))(
            tokens, positions, caches
        )
        self.position = prefill
        self.batch = batch
        self.token = jnp.ones((batch, 1), jnp.int32)

    def _count(self):
        self.traces += 1

    def __call__(self):
        positions = jnp.full((self.batch, 1), self.position, jnp.int32)
        logits, self.caches = self.step(self.token, positions, self.caches)
        self.position += 1
        return logits


def decode_section(rounds: int, quick: bool) -> None:
    batch, prefill, model_dim, heads, layers = (4, 128, 128, 4, 2) if quick else (8, 512, 256, 4, 2)
    steps_per_round, count_steps = 4, 100
    rng = np.random.default_rng(0)
    capacity = prefill + count_steps + (rounds + 1) * steps_per_round + 8
    decoders = {}
    for name in model_encodings():
        info = encoding_info(name)
        if not info.kv_cache or info.length_dependent:
            continue
        decoders[name] = _Decoder(
            name,
            model_dim=model_dim,
            heads=heads,
            layers=layers,
            batch=batch,
            prefill=prefill,
            capacity=capacity,
            rng=rng,
        )

    def several(decoder):
        def run():
            for _ in range(steps_per_round):
                out = decoder()
            return out

        return run

    times = paired_times({name: several(d) for name, d in decoders.items()}, rounds)
    for decoder in decoders.values():  # the compile count over 100 further steps
        for _ in range(count_steps):
            out = decoder()
        jax.block_until_ready(out)
    rows = [(name, ratio_cell(times, name, "nope"), decoders[name].traces) for name in decoders if name != "nope"]
    nope_ms = np.median(times["nope"]) / steps_per_round * 1e3
    print_table(
        f"Decoding step (batch {batch}, after a prefill of {prefill}; {layers} layers, D={model_dim}) vs NoPE's "
        f"step ({nope_ms:.2f} ms) (target ≤ 1.1×)",
        ("encoding", "step time, median (range)", f"compilations over {count_steps + rounds * steps_per_round}"),
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds per table (7-15 recommended)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, for a smoke run")
    parser.add_argument("--encodings", default="", help="comma-separated registered names (default: all)")
    args = parser.parse_args()
    global ONLY
    if args.encodings:
        ONLY = {name.strip() for name in args.encodings.split(",") if name.strip()}
        unknown = ONLY - set(encoding_names())
        if unknown:
            parser.error(f"unknown encodings {sorted(unknown)}; registered: {', '.join(encoding_names())}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.rounds < 3:
        parser.error(f"--rounds must be >= 3 for a median and a range, got {args.rounds}")
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.device_count()} device); "
        f"{args.rounds} paired rounds per table"
    )
    for section in sections:
        if section == "rope":
            rope_section(args.rounds, args.quick)
        elif section == "attention":
            attention_section(args.rounds, args.quick)
        elif section == "memory":
            memory_section(args.quick)
        elif section == "train":
            train_section(args.rounds, args.quick)
        elif section == "decode":
            decode_section(args.rounds, args.quick)


if __name__ == "__main__":
    main()
