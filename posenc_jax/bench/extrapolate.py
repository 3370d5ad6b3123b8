"""The length-extrapolation benchmark: train short, test long, for each encoding.

For every (task, encoding, seed) cell: build a small Transformer with the encoding,
train it on lengths up to ``train_length`` (checkpointing with orbax as it goes),
then evaluate at every evaluation length, appending one row per length to
``results.jsonl`` as soon as it is measured. Re-running the same command skips
finished rows and resumes interrupted training from the last checkpoint; the data
of step k depends only on (seed, k), so a resumed run ends with the same results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posenc_jax.checkpoint import Checkpointer
from posenc_jax.functional.normalizers import NORMALIZERS, normalizer_config
from posenc_jax.functional.registry import encoding_config, encoding_info, encoding_names
from posenc_jax.nn import Transformer, with_encoding
from posenc_jax.tasks import TextTask, make_task, task_names
from posenc_jax.training import (
    data_parallel_mesh,
    make_optimizer,
    replicate,
    shard_batch,
    train_step,
    warmup_cosine_adamw,
)

__all__ = ["PRESETS", "Preset", "fingerprint", "run"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """Everything that defines a run. Algorithmic tasks train on lengths 1..train_length and
    evaluate at ``eval_lengths``; the text task trains at ``text_context`` characters and
    evaluates at ``text_context`` times each of ``text_multiples``."""

    name: str
    encodings: tuple[str, ...]
    tasks: tuple[str, ...]
    seeds: tuple[int, ...]
    model_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_dim: int = 256
    dropout_rate: float = 0.0
    steps: int = 1000
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_fraction: float = 0.06
    weight_decay: float = 0.05
    train_length: int = 10
    eval_lengths: tuple[int, ...] = (2, 4, 6, 8, 10, 12, 14, 16, 18, 20)
    eval_examples: int = 128
    text_context: int = 64
    text_multiples: tuple[int, ...] = (1, 2, 4, 8, 16)
    text_eval_windows: int = 16
    checkpoint_every: int = 200
    # RoPE scalings applied at evaluation only to the RoPE model of the text task (extra rows).
    eval_only_scalings: tuple[str, ...] = ("pi", "ntk", "yarn")
    # Attention normalisers; rows of a non-softmax normaliser are labelled "encoding|normaliser".
    normalizers: tuple[str, ...] = ("softmax",)

    def validate(self) -> None:
        unknown = [part for e in self.encodings for part in e.split("+") if part not in encoding_names()]
        if unknown:
            raise ValueError(
                f"unknown encodings {unknown}; known encodings: {', '.join(encoding_names())} "
                f"(combine them with '+', e.g. rope+randomized)"
            )
        unknown = [n for n in self.normalizers if n not in NORMALIZERS]
        if unknown:
            raise ValueError(f"unknown normalizers {unknown}; known normalizers: {', '.join(NORMALIZERS)}")
        unknown = [t for t in self.tasks if t not in task_names()]
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; known tasks: {', '.join(task_names())}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}: a model must train before it is tested")
        if self.train_length < 1 or self.text_context < 2:
            raise ValueError(
                f"train_length must be >= 1 and text_context >= 2, got {self.train_length}, {self.text_context}"
            )
        if not self.eval_lengths or max(self.eval_lengths) <= self.train_length:
            raise ValueError(
                f"eval lengths {self.eval_lengths} must reach beyond the training length {self.train_length}; "
                f"an extrapolation benchmark tests longer than it trains"
            )
        if min(self.eval_lengths) < 1 or not self.text_multiples or max(self.text_multiples) <= 1:
            raise ValueError(
                f"eval lengths must be >= 1 and text multiples must include one > 1, got "
                f"{self.eval_lengths}, {self.text_multiples}"
            )
        if self.model_dim % self.num_heads:
            raise ValueError(f"model_dim={self.model_dim} is not divisible by num_heads={self.num_heads}")
        if not self.seeds:
            raise ValueError("need at least one seed")


_CPU_ENCODINGS = ("nope", "sinusoidal", "learned", "rope", "t5", "alibi")
_ALGO_TASKS = (
    "counting_copy",
    "copy",
    "duplicate",
    "reverse",
    "reverse_string",
    "missing_duplicate",
    "parity",
    "bucket_sort",
)

PRESETS = {
    "smoke": Preset(
        name="smoke",
        encodings=("nope", "rope", "alibi"),
        tasks=("counting_copy", "text"),
        seeds=(0,),
        model_dim=32,
        num_layers=1,
        num_heads=2,
        mlp_dim=64,
        steps=30,
        batch_size=16,
        train_length=4,
        eval_lengths=(2, 4, 6, 8),
        eval_examples=16,
        text_context=16,
        text_multiples=(1, 2, 4),
        text_eval_windows=4,
        checkpoint_every=10,
    ),
    "cpu": Preset(
        name="cpu",
        encodings=_CPU_ENCODINGS,
        tasks=("counting_copy", "text"),
        seeds=(0, 1),
        steps=700,
    ),
    "cpu-full": Preset(
        name="cpu-full",
        encodings=(
            *(n for n in encoding_names() if n not in ("rope-2d", "randomized")),
            "rope+randomized",
            "sinusoidal+randomized",
        ),
        tasks=(*_ALGO_TASKS, "probe", "probe_boundary", "text"),
        seeds=(0, 1),
        steps=700,
    ),
    # Kazemnejad et al. 2023: 12 x 768, 12 heads, AdamW 3e-5, wd 0.05, batch 64, 40K steps,
    # 6% warmup, dropout 0.1, train <= 20, test 21-40, 3 seeds. For a GPU or TPU.
    "paper": Preset(
        name="paper",
        encodings=("nope", "t5", "alibi", "rope", "sinusoidal"),
        tasks=("counting_copy", "copy", "duplicate", "reverse"),
        seeds=(0, 1, 2),
        model_dim=768,
        num_layers=12,
        num_heads=12,
        mlp_dim=3072,
        dropout_rate=0.1,
        steps=40_000,
        batch_size=64,
        learning_rate=3e-5,
        weight_decay=0.05,
        train_length=20,
        eval_lengths=tuple(range(1, 41)),
        eval_examples=256,
        checkpoint_every=2000,
    ),
}


def _encodings_for(name: str, head_dim: int, train_tokens: int, max_tokens: int) -> list:
    """The configs of ``name`` (``a+b`` for a hybrid) sized by each config's ``for_lengths``: tables
    long enough for the longest evaluation, RoPE scalings from the training to the longest length.
    A position sampler (randomized positions) is sized first; the others then cover its range.
    Settings an encoding cannot do without (a scaling's factor) start from its small settings
    and are then set by ``for_lengths``."""
    configs = []
    for part in name.split("+"):
        info = encoding_info(part)
        configs.append(encoding_config(part, **{k: info.small_settings[k] for k in info.required}))
    reach = max_tokens
    for i, config in enumerate(configs):
        if config.acts_on == "positions":
            configs[i] = config.for_lengths(train_length=train_tokens, max_length=max_tokens, head_dim=head_dim)
            reach = max(reach, configs[i].max_length)
    return [
        c if c.acts_on == "positions" else c.for_lengths(train_length=train_tokens, max_length=reach, head_dim=head_dim)
        for c in configs
    ]


# Encodings with no bidirectional form, which refuse a bidirectional attention: not run on encoder tasks.


def _runs_on(task, name: str) -> bool:
    """Whether the encoding ``name`` (``a+b`` for a hybrid) can run on ``task``."""
    return task.kind != "encoder" or all("bidirectional" in encoding_info(part).forms for part in name.split("+"))


def _length_dependent(name: str) -> bool:
    return any(encoding_info(part).length_dependent for part in name.split("+"))


def _lengths(task, preset: Preset):
    if isinstance(task, TextTask):
        return [preset.text_context * m for m in preset.text_multiples], preset.text_context
    return list(preset.eval_lengths), preset.train_length


def fingerprint(preset: Preset) -> str:
    """A hash of every setting that shapes a result (not the lists of encodings, tasks, seeds)."""
    settings = dataclasses.asdict(preset)
    for key in ("name", "encodings", "tasks", "seeds", "normalizers"):
        settings.pop(key)
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def _check_writable(out: pathlib.Path) -> None:
    """Makes ``out`` and writes a file in it, so a path that cannot hold the results fails before any
    training, with the path and what to do."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; pass a folder for the results")
    probe = out / ".write-test"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"cannot write to --out {out} ({error.strerror or error}); choose a folder you can write to"
        ) from None


def _done(results_path: pathlib.Path, settings: str) -> set:
    """Finished cells; refuses rows made with other settings, drops a half-written last line."""
    if not results_path.exists():
        return set()
    lines = results_path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line)) if line.strip() else None
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{results_path} line {i + 1} is not JSON; remove it or use another --out") from None
            results_path.write_text("".join(f"{kept}\n" for kept in lines[:-1]))  # killed mid-write
    foreign = {row.get("settings") for row in rows} - {settings}
    if foreign:
        raise ValueError(
            f"{results_path} holds results made with other settings ({sorted(map(str, foreign))}, now {settings}); "
            f"choose another --out, or delete that folder to start over"
        )
    return {(row["task"], row["encoding"], row["seed"], row["length"]) for row in rows}


def _git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                cwd=pathlib.Path(__file__).parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict:
    import flax
    import optax
    import orbax.checkpoint

    return {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "orbax-checkpoint": orbax.checkpoint.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _train_batch(task, preset: Preset, seed: int, step: int, max_tokens: int) -> dict:
    rng = np.random.default_rng([seed, step])
    if isinstance(task, TextTask):
        return task.batch(rng, [preset.text_context] * preset.batch_size)
    lengths = rng.integers(1, preset.train_length + 1, preset.batch_size)
    return task.batch(rng, lengths, pad_to=max_tokens)


def _eval_batches(task, preset: Preset, seed: int, length: int, max_tokens: int):
    rng = np.random.default_rng([seed, 1_000_003, length])
    if isinstance(task, TextTask):
        for start in range(0, preset.text_eval_windows, 4):
            yield task.batch(rng, [length] * min(4, preset.text_eval_windows - start), split="test")
        return
    # One padded shape for every length: one compilation (padding is masked or causally unseen).
    for start in range(0, preset.eval_examples, 64):
        yield task.batch(rng, [length] * min(64, preset.eval_examples - start), pad_to=max_tokens)


@nnx.jit
def _predict(model, batch):
    logits = model(batch["inputs"], batch["positions"], key_mask=batch.get("key_mask"))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    return logits.argmax(-1), target_log_probs


def run(preset: Preset, out: pathlib.Path, *, corpus: str | None = None, progress: bool = True, log=print) -> dict:
    """Runs (or resumes) every cell of ``preset``, writing into ``out``; returns the run record."""
    preset.validate()
    out = pathlib.Path(out)
    _check_writable(out)
    results_path = out / "results.jsonl"
    settings = fingerprint(preset)
    done = _done(results_path, settings)
    record = {
        "preset": dataclasses.asdict(preset),
        "corpus": corpus,
        "versions": _versions(),
        "device": {
            "platform": jax.devices()[0].platform,
            "kind": jax.devices()[0].device_kind,
            "count": jax.local_device_count(),
        },
        "git_commit": _git_commit(),
        "settings": settings,
        "cells": [],
    }
    run_json = out / "run.json"
    if run_json.exists():
        previous = json.loads(run_json.read_text())
        record["cells"] = previous.get("cells", [])
    mesh = data_parallel_mesh()
    use_mesh = jax.local_device_count() > 1 and preset.batch_size % jax.local_device_count() == 0
    tasks = {name: make_task(name, corpus=corpus, max_length=max(preset.eval_lengths) + 2) for name in preset.tasks}
    for task_name, task in tasks.items():
        if isinstance(task, TextTask):
            record["text_corpus"] = task.corpus_description
        eval_lengths, train_length = _lengths(task, preset)
        max_tokens = task.max_tokens(max(eval_lengths))
        for encoding_name in preset.encodings:
            if not _runs_on(task, encoding_name):
                log(f"{encoding_name} has no bidirectional form: not run on the encoder task {task_name}")
                continue
            for normalizer in preset.normalizers:
                label = row_label(encoding_name, normalizer)
                for seed in preset.seeds:
                    todo = [n for n in eval_lengths if (task_name, label, seed, n) not in done]
                    scaled = _eval_only_rows(task, label, preset)
                    scaled_todo = [
                        (name, n) for name in scaled for n in eval_lengths if (task_name, name, seed, n) not in done
                    ]
                    if not todo and not scaled_todo:
                        continue
                    timings = _run_cell(
                        task,
                        task_name,
                        encoding_name,
                        normalizer,
                        seed,
                        preset,
                        out,
                        results_path,
                        todo,
                        scaled_todo,
                        train_length,
                        max_tokens,
                        mesh if use_mesh else None,
                        progress,
                        log,
                    )
                    record["cells"].append(timings)
                    run_json.write_text(json.dumps(record, indent=1))
    run_json.write_text(json.dumps(record, indent=1))
    return record


def row_label(encoding_name: str, normalizer: str) -> str:
    """The ``encoding`` field of a result row: the encoding, with ``|normaliser`` unless softmax."""
    return encoding_name if normalizer == "softmax" else f"{encoding_name}|{normalizer}"


def _eval_only_rows(task, encoding_name: str, preset: Preset) -> list[str]:
    if not isinstance(task, TextTask) or encoding_name != "rope":
        return []
    return [f"rope+{method}@eval" for method in preset.eval_only_scalings]


def _scaled_rope(row_name: str, length: int, train_length: int):
    """The scaling of an eval-only row at one evaluation length: factor length / train_length."""
    method = row_name.split("+")[1].split("@")[0]
    factor = max(1.0, length / train_length)
    settings = {"factor": factor}
    if method == "yarn":
        settings["original_context"] = train_length
    return encoding_config(f"rope-{method}", **settings)


def _model(task, preset: Preset, config, seed: int, normalizer: str = "softmax") -> Transformer:
    return Transformer(
        vocab_size=task.vocab_size,
        model_dim=preset.model_dim,
        num_layers=preset.num_layers,
        num_heads=preset.num_heads,
        mlp_dim=preset.mlp_dim,
        encoding=config,
        causal=task.kind == "decoder",
        normalizer=normalizer_config(normalizer),
        dropout_rate=preset.dropout_rate,
        rngs=nnx.Rngs(params=seed, dropout=seed + 1),
    )


def _evaluate(model, task, preset: Preset, seed: int, length: int, max_tokens: int) -> float:
    scores = []
    for batch in _eval_batches(task, preset, seed, length, max_tokens):
        predictions, target_log_probs = _predict(model, {k: jnp.asarray(v) for k, v in batch.items()})
        if isinstance(task, TextTask):
            scores.append(task.score(np.asarray(target_log_probs), batch))
        else:
            scores.append(task.score(np.asarray(predictions), batch))
    return float(np.concatenate(scores).mean())


def _run_cell(
    task,
    task_name,
    encoding_name,
    normalizer,
    seed,
    preset,
    out,
    results_path,
    todo,
    scaled_todo,
    train_length,
    max_tokens,
    mesh,
    progress,
    log,
):
    label = row_label(encoding_name, normalizer)
    train_tokens = task.max_tokens(preset.text_context if isinstance(task, TextTask) else train_length)
    head_dim = preset.model_dim // preset.num_heads
    configs = _encodings_for(encoding_name, head_dim, train_tokens, max_tokens)
    model = _model(task, preset, configs, seed, normalizer)
    # Frequencies that follow the sequence length (max position + 1) must see each length unpadded.
    length_dependent = _length_dependent(encoding_name)
    tx = warmup_cosine_adamw(
        learning_rate=preset.learning_rate,
        total_steps=preset.steps,
        warmup_steps=max(0, int(preset.warmup_fraction * preset.steps)),
        weight_decay=preset.weight_decay,
    )
    optimizer = make_optimizer(model, tx)
    if mesh is not None:
        replicate(model, mesh)
        replicate(optimizer, mesh)
    # Two steps kept, so a damaged newest one falls back to the one before (same results: the
    # data of step k depends only on (seed, k)). Each records what it is a checkpoint of.
    ckpt = Checkpointer(
        out / "checkpoints" / fingerprint(preset) / task_name / label.replace("|", "-") / f"seed{seed}", max_to_keep=2
    )
    recorded = {
        "settings": fingerprint(preset),
        "task": task_name,
        "encoding": label,
        "seed": seed,
        "encoding_configs": [repr(c) for c in configs],
    }
    start_step = ckpt.restore(model, optimizer, config=recorded) if ckpt.latest_step() is not None else 0
    timings = {"task": task_name, "encoding": label, "seed": seed, "resumed_from_step": start_step}

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=preset.steps,
            initial=start_step,
            desc=f"{task_name} / {label} / seed {seed}",
            leave=False,
            dynamic_ncols=True,
        )
    compile_seconds, train_seconds = 0.0, 0.0
    loss = None  # unknown when a resumed cell has no steps left
    for step in range(start_step, preset.steps):
        batch = {k: jnp.asarray(v) for k, v in _train_batch(task, preset, seed, step, train_tokens).items()}
        if mesh is not None:
            batch = shard_batch(batch, mesh)
        began = time.perf_counter()
        loss = float(train_step(model, optimizer, batch))
        elapsed = time.perf_counter() - began
        if step == start_step:
            compile_seconds = elapsed
        else:
            train_seconds += elapsed
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if (step + 1) % preset.checkpoint_every == 0 or step + 1 == preset.steps:
            ckpt.save(step + 1, model, optimizer, config=recorded)
    if bar is not None:
        bar.close()
    ckpt.close()
    timings.update(compile_seconds=compile_seconds, train_seconds=train_seconds, final_loss=loss)

    began = time.perf_counter()

    def write(name, length, value):
        row = {
            "task": task_name,
            "encoding": name,
            "seed": seed,
            "length": int(length),
            "metric": task.metric,
            "value": value,
            "train_length": int(train_length),
            "in_distribution": bool(length <= train_length),
            "preset": preset.name,
            "settings": fingerprint(preset),
        }
        with results_path.open("a") as results:
            results.write(json.dumps(row) + "\n")

    for length in todo:
        pad = task.max_tokens(length) if length_dependent else max_tokens
        write(label, length, _evaluate(model, task, preset, seed, length, pad))
    for name, length in scaled_todo:
        scaled = with_encoding(model, _scaled_rope(name, length, train_length))  # the RoPE model's weights
        write(name, length, _evaluate(scaled, task, preset, seed, length, max_tokens))
    timings["eval_seconds"] = time.perf_counter() - began
    if loss is None:
        training = f"resumed at step {start_step} of {preset.steps}, no steps left"
    else:
        training = f"loss {loss:.3f}" + (f" (resumed from step {start_step})" if start_step else "")
    log(
        f"{task_name:14s} {label:12s} seed {seed}: {training}, "
        f"compile {compile_seconds:.1f}s, train {train_seconds:.1f}s, eval {timings['eval_seconds']:.1f}s"
    )
    return timings
