"""A run's settings: the :class:`Preset` class, its checks, and how it resolves each task's settings.

A :class:`Preset` names the encodings, tasks and seeds of a run and every setting that shapes a
result (model size, optimiser, lengths). Tasks read their lengths through :meth:`Preset.lengths`,
which picks the algorithmic or the text settings by the task's ``length_family``; the runner
resolves each task's settings once (:meth:`Preset.resolve`, a
:class:`~posenc_jax.bench.settings.TaskSettings`) and hands them to the cells. The named presets
are :data:`posenc_jax.bench.presets.PRESETS`.
"""

from __future__ import annotations

import dataclasses
import math

from posenc_jax.bench.device_batches import DEVICE_TASKS
from posenc_jax.bench.settings import PER_TASK, TaskLengths, TaskSettings
from posenc_jax.bench.tasks import FORMATTED_TASKS, STDLIB_CORPUS_SHA256, TASK_FORMATS, make_task, task, task_names
from posenc_jax.functional.core.normalizers import NORMALIZERS
from posenc_jax.functional.core.registry import encoding_names

__all__ = ["BATCHES", "IMPLEMENTATIONS", "PROTOCOLS", "Preset"]

# Attention implementations an evaluation may ask for (those of the functional attention).
IMPLEMENTATIONS = ("materialize", "blockwise", "auto")

# The training protocols: every encoding the same steps, or each seed stopped at its criterion.
PROTOCOLS = ("fixed-budget", "to-criterion")
# Where training batches are made: numpy on the host, or jax.random inside the jitted step.
BATCHES = ("host", "device")
# What a task's resolved settings take from the preset as they are, after its overrides.
_RESOLVED = (
    *PER_TASK,
    *("protocol", "batches", "steps_per_dispatch", "eval_implementation", "blockwise_from"),
)


@dataclasses.dataclass(frozen=True)
class Preset:
    """Everything that defines a run.

    Algorithmic tasks train on lengths ``train_min_length``..``train_length`` (drawn
    uniformly) and are tested at ``eval_lengths`` on ``eval_examples`` examples each, in
    ``task_format``: ``"ours"`` (the benchmark's compact format) or ``"paper"`` (the format of
    the authors' code, for the tasks that have one: see :data:`~posenc_jax.bench.tasks.TASK_FORMATS`);
    the text task trains at ``text_context`` characters and is tested at ``text_context`` times each of
    ``text_multiples``, every length on the same ``text_eval_characters`` characters of the
    test split, cut into non-overlapping windows of that length (Press et al. 2022's
    evaluation). Those windows depend on the corpus and the length alone, the same for every
    encoding, seed, run and preset (``text_eval_characters`` only says how many of them are
    scored; :meth:`~posenc_jax.bench.tasks.TextTask.window_starts`). The seeds of one task and
    encoding train together (one compiled program for all of them).

    **The text is pinned.** ``text_corpus_sha256`` is the SHA-256 of the text corpus
    (:attr:`~posenc_jax.bench.tasks.TextTask.sha256`): a run refuses any other corpus. The
    presets pin the default corpus, Python source code (78 standard-library files, the same on
    every interpreter that has them: :func:`~posenc_jax.bench.tasks.stdlib_corpus`), so the text
    claims are tested on Python source, not on the papers' corpora (WikiText-103 and the others
    they trained on). A corpus of your own (``--corpus PATH``) replaces the hash with its own,
    which ``run.json`` records with the preset.

    **One budget.** Under the ``fixed-budget`` protocol (the default) every encoding of a task
    trains exactly ``steps`` steps (the task's own, from ``task_overrides``), so a comparison
    never mixes an encoding with its number of steps. Every ``check_every`` steps each seed is
    scored on ``check_examples`` held-out examples at the longest training length (text:
    held-out windows of the training context); the first step at which a seed scored at least
    ``learned_threshold + criterion_margin`` at two checks in a row is recorded as its steps to
    criterion, a measurement that stops nothing. ``protocol="to-criterion"`` is the method of
    runs made before the fixed budget (a seed stops at that criterion, a cell when every seed
    has, or at ``steps``); every row records which protocol made it.

    **Learned first.** A cell is learned when the mean over all its seeds at the longest
    training length is at least ``learned_threshold`` (text: below the best n-gram model by
    ``text_margin`` bits per character on the same characters); only a learned cell's scores
    beyond the training length are reported, over all its seeds. A model only just below a
    count-based model barely uses its context, so its curve past the training length says
    little: hence the text margin. ``learned_fraction`` is kept for the earlier method's runs
    and no longer read. ``equivalence_margin`` (accuracy) and ``text_equivalence_margin``
    (bits per character) are the margins, declared before the run, within which an
    equivalence test may call two encodings tied.
    ``finetune_scalings``: RoPE scalings fine-tuned into the trained text RoPE model for
    ``finetune_steps`` steps at ``finetune_multiple`` times the training context, at peak
    learning rate ``finetune_learning_rate`` (warm-up and cosine over those steps; 0 steps: none).
    ``extrapolates=False`` allows a preset tested only at its training lengths (the probe).
    ``task_overrides`` gives a task its own settings (its budget of steps, its learning rate):
    ``(("copy", (("steps", 6000),)),)``; :meth:`for_task` applies them.

    ``eval_only_scalings`` are RoPE scalings (``"yarn"`` for ``rope-yarn``) applied at
    evaluation only to the RoPE model of the tasks in ``eval_only_tasks``. ``normalizers``:
    rows of a non-softmax normaliser are labelled ``encoding|normaliser``.
    ``eval_implementation`` and ``blockwise_from``: the attention implementation for
    evaluation lengths of at least ``blockwise_from`` tokens (None: every length
    materialises its scores). ``query_init_scale`` multiplies every layer's initial query
    projection, so the initial scores' standard deviation shrinks by that factor (Su 2022's
    advice for L2-normalised attention in a standard Attention + FFN block). ``description``
    and ``target`` (what it is sized for: ``"cpu"``, ``"colab-tpu"`` or ``"accelerator"``) are
    documentation only, and so is ``paper_protocol``: the protocol of the paper a preset
    reproduces, which its report prints beside ours.

    **Batches and dispatches.** ``batches="host"`` makes each training batch on the host with
    numpy (the task's ``batch``), one jitted step at a time; ``"device"`` makes them with
    ``jax.random`` inside the jitted program (:mod:`posenc_jax.bench.device_batches`: the same
    distribution and layout, another random stream), and ``steps_per_dispatch`` steps run in one
    call (a ``lax.scan`` over steps), for an accelerator that the host would otherwise keep
    waiting. Checks and checkpoints fall on dispatch boundaries: the steps per dispatch divide
    ``steps``, ``check_every`` and ``checkpoint_every``.
    """

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
    text_eval_characters: int = 16_384
    text_corpus_sha256: str = STDLIB_CORPUS_SHA256
    checkpoint_every: int = 200
    eval_only_scalings: tuple[str, ...] = ("pi", "ntk", "yarn")
    normalizers: tuple[str, ...] = ("softmax",)
    eval_only_tasks: tuple[str, ...] = ("text",)
    eval_implementation: str = "materialize"
    blockwise_from: int | None = None
    query_init_scale: float = 1.0
    learned_threshold: float = 0.95
    learned_fraction: float = 0.8
    criterion_margin: float = 0.03
    text_margin: float = 0.2
    equivalence_margin: float = 0.02
    text_equivalence_margin: float = 0.05
    protocol: str = "fixed-budget"
    check_every: int = 100
    check_examples: int = 64
    task_overrides: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    extrapolates: bool = True
    finetune_scalings: tuple[str, ...] = ("pi", "ntk", "yarn")
    finetune_multiple: int = 4
    finetune_steps: int = 100
    finetune_learning_rate: float = 1e-3
    description: str = ""
    target: str = "cpu"
    paper_protocol: str = ""
    task_format: str = "ours"
    train_min_length: int = 1
    batches: str = "host"
    steps_per_dispatch: int = 1

    def for_task(self, task_name: str) -> Preset:
        """The settings ``task_name`` trains with: this preset with the task's own overrides
        (``task_overrides``, e.g. more steps for copy than for counting copy)."""
        for name, overrides in self.task_overrides:
            if name == task_name:
                return dataclasses.replace(self, **dict(overrides))
        return self

    def lengths(self, task) -> TaskLengths:
        """The lengths of ``task``, by its ``length_family``."""
        if task.length_family == "text":
            return TaskLengths(
                train=self.text_context,
                eval=tuple(self.text_context * m for m in self.text_multiples),
                examples=self.text_eval_characters,
                batch=max(1, 4096 // self.text_context),
                text=True,
            )
        return TaskLengths(
            train=self.train_length,
            eval=tuple(self.eval_lengths),
            examples=self.eval_examples,
            batch=64,
            train_min=self.train_min_length,
        )

    def task(self, name: str, corpus: str | None = None):
        """Task ``name`` as this preset's runs make it: in ``task_format``, sized for the longest
        evaluation length (the probe's position classes), on ``corpus`` (text; None: the pinned
        one). Made once and shared (:func:`posenc_jax.bench.tasks.task`), except on a corpus of
        the caller's, which is made afresh and so read as it is now."""
        made = task if corpus is None else make_task
        return made(name, format=self.task_format, max_length=max(self.eval_lengths) + 2, corpus=corpus)

    def resolve(self, task) -> TaskSettings:
        """The settings ``task`` (a task object) trains and is tested with in this preset, resolved
        once: its overrides applied (:meth:`for_task`), its lengths (:meth:`lengths`) and its
        evaluation variants' scalings. What the runner gives each of the task's cells."""
        own = self.for_task(task.name)
        text = task.length_family == "text"
        return TaskSettings(
            name=task.name,
            task=task,
            preset=self.name,
            seeds=self.seeds,
            lengths=self.lengths(task),
            **{name: getattr(own, name) for name in _RESOLVED},
            eval_scalings=self.eval_only_scalings if task.name in self.eval_only_tasks else (),
            finetune_scalings=self.finetune_scalings if text and own.finetune_steps else (),
        )

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting and what to do."""
        self._validate_names()
        self._validate_training()
        self._validate_lengths()
        self._validate_formats()
        self._validate_shapes()

    def _validate_names(self) -> None:
        """The names: encodings, tasks, seeds, normalisers and scalings, each known and named once."""
        for what, values, example in (
            ("encodings", self.encodings, "--encodings rope,alibi"),
            ("tasks", self.tasks, "--tasks counting_copy"),
            ("seeds", self.seeds, "--seeds 0,1,2"),
            ("normalizers", self.normalizers, "softmax"),
        ):
            if not values:
                raise ValueError(f"no {what} given; name at least one (e.g. {example})")
            duplicated = sorted({v for v in values if values.count(v) > 1})
            if duplicated:
                raise ValueError(f"{what} {duplicated} named twice; name each once")
        unknown = [part for e in self.encodings for part in e.split("+") if part not in encoding_names()]
        if unknown:
            raise ValueError(
                f"unknown encodings {unknown}; known encodings: {', '.join(encoding_names())} "
                f"(combine them with '+', e.g. rope+randomized)"
            )
        unknown = [n for n in self.normalizers if n not in NORMALIZERS]
        if unknown:
            raise ValueError(f"unknown normalizers {unknown}; known normalizers: {', '.join(NORMALIZERS)}")
        unknown = [t for t in (*self.tasks, *self.eval_only_tasks) if t not in task_names()]
        if unknown:
            raise ValueError(f"unknown tasks {unknown}; known tasks: {', '.join(task_names())}")
        scalings = (*self.eval_only_scalings, *self.finetune_scalings)
        unknown = [s for s in scalings if f"rope-{s}" not in encoding_names()]
        if unknown:
            scalings = [n.removeprefix("rope-") for n in encoding_names() if n.startswith("rope-")]
            raise ValueError(
                f"unknown RoPE scalings {unknown} in eval_only_scalings or finetune_scalings; "
                f"known: {', '.join(scalings)}"
            )

    def _validate_training(self) -> None:
        """The training settings: fine-tuning, steps, seeds, rates, sizes, the gate and the margins."""
        if self.finetune_steps < 0 or self.finetune_multiple < 2 or not self.finetune_learning_rate > 0:
            raise ValueError(
                f"finetune_steps must be >= 0, finetune_multiple >= 2 and finetune_learning_rate > 0, got "
                f"{self.finetune_steps}, {self.finetune_multiple}, {self.finetune_learning_rate}"
            )
        if not (self.query_init_scale > 0 and math.isfinite(self.query_init_scale)):
            raise ValueError(
                f"query_init_scale must be a positive finite number, got {self.query_init_scale}; "
                "1.0 keeps the default initialisation, 0.1 shrinks the initial scores tenfold"
            )
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}: a model must train before it is tested")
        bad_seeds = [s for s in self.seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad_seeds:
            raise ValueError(
                f"seeds must be integers >= 0, got {bad_seeds} in {list(self.seeds)}; e.g. seeds=(0, 1, 2)"
            )
        if self.text_context < 2 or self.train_length < 1 or any(n < 1 for n in self.eval_lengths):
            raise ValueError(
                f"text_context must be >= 2 and train_length and every eval length >= 1, got {self.text_context}, "
                f"{self.train_length} and {list(self.eval_lengths)}: a model trains and is tested on at least a "
                "symbol (text: a character to predict from another)"
            )
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(
                f"learning_rate must be a positive finite number, got {self.learning_rate}; 1e-3 is the CPU presets'"
            )
        for flag, name in (("--model-dim", "model_dim"), ("--layers", "num_layers"), ("--heads", "num_heads")):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)} ({flag}): a model needs one or more")
        if self.batch_size < 1 or self.eval_examples < 1 or self.check_examples < 1 or self.check_every < 1:
            raise ValueError(
                f"batch_size, eval_examples, check_examples and check_every must be >= 1, got {self.batch_size}, "
                f"{self.eval_examples}, {self.check_examples}, {self.check_every}"
            )
        if not 0 < self.learned_threshold <= 1 or not 0 < self.learned_fraction <= 1:
            raise ValueError(
                f"learned_threshold and learned_fraction must be in (0, 1], got {self.learned_threshold} and "
                f"{self.learned_fraction}; 0.95 and 0.8 are the defaults (a score of 0.95 at the training length, "
                "on 4 of 5 seeds)"
            )
        if not 0 <= self.criterion_margin < 1:
            raise ValueError(
                f"criterion_margin must be in [0, 1), got {self.criterion_margin}; 0.03 is the default "
                "(training stops at learned_threshold + criterion_margin, the gate reads learned_threshold)"
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}; fixed-budget trains every "
                "encoding the same steps (the default), to-criterion stops each seed once it has learned"
            )
        for name in ("equivalence_margin", "text_equivalence_margin"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(
                    f"{name} must be in (0, 1), got {getattr(self, name)}; 0.02 (accuracy) and 0.05 (bits per "
                    "character) are the defaults"
                )
        if not 0 <= self.text_margin < 8:
            raise ValueError(
                f"text_margin must be in [0, 8) bits per character, got {self.text_margin}; 0.2 is the default "
                "(text trains until it beats the best n-gram model by this much)"
            )

    def _validate_lengths(self) -> None:
        """The lengths, the text corpus and windows, the per-task overrides (each task's settings validated too)."""
        if self.train_length not in self.eval_lengths or 1 not in self.text_multiples:
            raise ValueError(
                f"eval lengths {self.eval_lengths} must include the training length {self.train_length}, and text "
                f"multiples {self.text_multiples} must include 1: the score there decides whether a cell learned "
                "its task before its extrapolation is reported"
            )
        sha = self.text_corpus_sha256
        if not isinstance(sha, str) or len(sha) != 64 or set(sha) - set("0123456789abcdef"):
            raise ValueError(
                f"text_corpus_sha256 must be a SHA-256 in 64 lowercase hexadecimal digits, got "
                f"{self.text_corpus_sha256!r}; the default corpus's is STDLIB_CORPUS_SHA256, another's is its "
                "TextTask(corpus).sha256"
            )
        uneven = [
            self.text_context * m for m in self.text_multiples if self.text_eval_characters % (self.text_context * m)
        ]
        if uneven:
            raise ValueError(
                f"text_eval_characters={self.text_eval_characters} must be a multiple of every text evaluation "
                f"length (so that each length scores the same characters), not of {uneven}; "
                f"use a multiple of {self.text_context * max(self.text_multiples)}"
            )
        for task_name, overrides in self.task_overrides:
            unknown = [key for key, _ in overrides if key not in PER_TASK]
            if task_name not in task_names() or unknown:
                raise ValueError(
                    f"task_overrides for {task_name!r}: name a known task ({', '.join(task_names())}) and only "
                    f"settings a task may have of its own ({', '.join(PER_TASK)}); got {unknown or 'an unknown task'}"
                )
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}; 0.06 is the default")
        for task_name in self.tasks:
            if task_name in dict(self.task_overrides):
                dataclasses.replace(self.for_task(task_name), task_overrides=()).validate()
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")

    def _validate_formats(self) -> None:
        """The task format, where batches are made and how many steps a dispatch runs."""
        if self.task_format not in TASK_FORMATS:
            raise ValueError(f"task_format must be one of {', '.join(TASK_FORMATS)}, got {self.task_format!r}")
        unformatted = [t for t in self.tasks if self.task_format != "ours" and t not in FORMATTED_TASKS]
        if unformatted:
            raise ValueError(
                f"task_format={self.task_format!r}, but {', '.join(unformatted)} have only the benchmark's own format; "
                f"a paper-format preset runs only {', '.join(FORMATTED_TASKS)}"
            )
        if self.batches not in BATCHES:
            raise ValueError(
                f"batches must be one of {', '.join(BATCHES)}, got {self.batches!r}; host makes training batches "
                "with numpy, device with jax.random inside the jitted step"
            )
        if self.batches == "device":
            hostbound = [t for t in self.tasks if t not in DEVICE_TASKS]
            if hostbound:
                raise ValueError(
                    f"batches='device', but {', '.join(hostbound)} have no device generator (only "
                    f"{', '.join(DEVICE_TASKS)} do); run them with batches='host'"
                )
        k = self.steps_per_dispatch
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"steps_per_dispatch must be an integer >= 1, got {k!r}")
        if k > 1 and self.batches != "device":
            raise ValueError(
                f"steps_per_dispatch={k} needs batches='device' (host batches are made one step at a time)"
            )
        undivided = [
            f"{name}={getattr(self, name)}"
            for name in ("steps", "check_every", "checkpoint_every")
            if getattr(self, name) % k
        ]
        if undivided:
            raise ValueError(
                f"steps_per_dispatch={k} must divide steps, check_every and checkpoint_every (checks and "
                f"checkpoints fall between dispatches), not {', '.join(undivided)}"
            )

    def _validate_shapes(self) -> None:
        """The lengths' ranges, the model's shape and the evaluation's implementation."""
        if not 1 <= self.train_min_length <= self.train_length:
            raise ValueError(
                f"train_min_length must be in 1..train_length ({self.train_length}), got {self.train_min_length}"
            )
        if self.train_length < 1 or self.text_context < 2:
            raise ValueError(
                f"train_length must be >= 1 and text_context >= 2, got {self.train_length}, {self.text_context}"
            )
        if not self.eval_lengths or (self.extrapolates and max(self.eval_lengths) <= self.train_length):
            raise ValueError(
                f"eval lengths {self.eval_lengths} must reach beyond the training length {self.train_length}; "
                f"an extrapolation benchmark tests longer than it trains"
            )
        if min(self.eval_lengths) < 1 or not self.text_multiples or max(self.text_multiples) <= 1:
            raise ValueError(
                f"eval lengths must be >= 1 and text multiples must include one > 1, got "
                f"{self.eval_lengths}, {self.text_multiples}"
            )
        if min(self.text_multiples) < 1:
            raise ValueError(f"text multiples must be >= 1, got {self.text_multiples}")
        if self.model_dim % self.num_heads:
            raise ValueError(f"model_dim={self.model_dim} is not divisible by num_heads={self.num_heads}")
        if self.eval_implementation not in IMPLEMENTATIONS:
            raise ValueError(f"eval_implementation must be one of {IMPLEMENTATIONS}, got {self.eval_implementation!r}")
        if self.blockwise_from is not None and self.blockwise_from < 1:
            raise ValueError(f"blockwise_from must be >= 1 tokens (or None), got {self.blockwise_from}")
