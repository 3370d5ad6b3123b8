"""The extrapolation benchmark's presets: what a run trains and tests, as data.

A :class:`Preset` names the encodings, tasks and seeds of a run and every setting that
shapes a result (model size, optimiser, lengths). Tasks read their lengths through
:meth:`Preset.lengths`, which picks the algorithmic or the text settings by the task's
``length_family``; RoPE scalings applied to a trained RoPE model at evaluation only are
:class:`EvalVariant`\\ s. :func:`cost` counts a preset's cells and floating-point
operations, from which ``posenc-bench --help`` states each preset's expected run time.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from posenc_jax.bench.device_batches import DEVICE_TASKS
from posenc_jax.bench.tasks import FORMATTED_TASKS, STDLIB_CORPUS_SHA256, TASK_FORMATS, make_task, task_names
from posenc_jax.functional.core.normalizers import NORMALIZERS
from posenc_jax.functional.core.registry import encoding_config, encoding_info, encoding_names

__all__ = [
    "COLAB_TPU_ON_H200",
    "CPU_ESTIMATE",
    "H200_ESTIMATE",
    "IMPLEMENTATIONS",
    "PER_TASK",
    "PRESETS",
    "Rates",
    "Cost",
    "EvalVariant",
    "Preset",
    "TPU_ESTIMATE",
    "TaskLengths",
    "cell_cost",
    "cost",
    "expected_seconds",
    "finetune_batch",
    "runs_on",
    "step_flops",
    "why_not_run",
]

# Attention implementations an evaluation may ask for (those of the functional attention).
IMPLEMENTATIONS = ("materialize", "blockwise", "auto")


@dataclasses.dataclass(frozen=True)
class TaskLengths:
    """The lengths one task trains and is tested at, in the task's own unit (symbols of ``x``,
    or characters of text), and how many test examples each length gets, in batches of ``batch``
    (text: ``examples`` is the characters every length scores, in windows of that length)."""

    train: int
    eval: tuple[int, ...]
    examples: int
    batch: int
    text: bool = False
    train_min: int = 1

    def examples_at(self, length: int) -> int:
        """The test examples (text: windows) at ``length``."""
        return self.examples // length if self.text else self.examples


@dataclasses.dataclass(frozen=True)
class EvalVariant:
    """A trained model evaluated with another encoding in place of the one it trained with, by
    one of two protocols.

    * ``protocol="eval"``: applied at evaluation only. ``EvalVariant("rope", "rope-yarn")`` is the
      model trained with RoPE, evaluated with YaRN-scaled RoPE sized at each evaluation length by
      the encoding's ``for_lengths`` (factor = evaluation tokens / training tokens, original
      context = the training tokens). Rows ``rope+yarn@eval``.
    * ``protocol="finetune"``: as Chen et al. 2023 (PI) and Peng et al. 2023 (YaRN) publish it:
      the trained model takes the scaling sized for ``finetune_tokens`` (factor = those tokens /
      the training tokens), is fine-tuned briefly at that length, and is evaluated with that one
      scaling at every length. ``EvalVariant("rope", "rope", "finetune")``, plain RoPE fine-tuned
      the same way, is the control. Rows ``rope+yarn@ft`` and ``rope@ft``.
    """

    trained: str
    encoding: str
    protocol: str = "eval"

    @property
    def label(self) -> str:
        suffix = "eval" if self.protocol == "eval" else "ft"
        if self.encoding == self.trained:
            return f"{self.trained}@{suffix}"
        return f"{self.trained}+{self.encoding.removeprefix(self.trained + '-')}@{suffix}"

    def config(self, *, train_tokens: int, eval_tokens: int, head_dim: int):
        """The encoding config for one length: the evaluation length (``"eval"``), or the
        fine-tuning length (``"finetune"``: pass it as ``eval_tokens``)."""
        info = encoding_info(self.encoding)
        base = encoding_config(self.encoding, **{k: info.small_settings[k] for k in info.required})
        return base.for_lengths(train_length=train_tokens, max_length=eval_tokens, head_dim=head_dim)


def runs_on(task, encoding: str) -> bool:
    """Whether ``encoding`` (``a+b`` for a hybrid) can run on ``task`` (:func:`why_not_run`)."""
    return why_not_run(task, encoding) is None


def why_not_run(task, encoding: str) -> str | None:
    """Why ``encoding`` (``a+b`` for a hybrid) cannot run on ``task``, or None when it can: an
    encoder task needs every part to have a bidirectional form (read from the registry's
    metadata), and one whose answer slots differ (``task.slots_differ``) needs some position
    information: with none (every part fills no hook, as NoPE) a bidirectional model is
    permutation-equivariant and writes one symbol on every identical blank, so the cell could
    only measure that."""
    if task.kind != "encoder":
        return None
    parts = [encoding_info(part) for part in encoding.split("+")]
    if not all("bidirectional" in info.forms for info in parts):
        return "has no bidirectional form"
    if task.slots_differ and all(not info.hooks for info in parts):
        return "gives no position information, so a bidirectional model cannot tell the answer's blanks apart"
    return None


# The training protocols: every encoding the same steps, or each seed stopped at its criterion.
PROTOCOLS = ("fixed-budget", "to-criterion")
# Where training batches are made: numpy on the host, or jax.random inside the jitted step.
BATCHES = ("host", "device")

# The settings a task may have of its own (Preset.task_overrides): those of its model, its
# training and its gate; which cells, seeds and variants run is the preset's alone.
PER_TASK = (
    "model_dim",
    "num_layers",
    "num_heads",
    "mlp_dim",
    "dropout_rate",
    "steps",
    "batch_size",
    "learning_rate",
    "warmup_fraction",
    "weight_decay",
    "checkpoint_every",
    "check_every",
    "check_examples",
    "learned_threshold",
    "criterion_margin",
    "text_margin",
    "equivalence_margin",
    "text_equivalence_margin",
    "query_init_scale",
    "finetune_steps",
    "finetune_multiple",
    "finetune_learning_rate",
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

    def eval_variants(self, task_name: str, encoding: str, normalizer: str) -> tuple[EvalVariant, ...]:
        """The variants of one trained cell: RoPE scalings of the softmax RoPE model applied at
        evaluation (tasks in ``eval_only_tasks``) and, on text, after a short fine-tune at
        ``finetune_multiple`` times the training context (``finetune_scalings``, with plain RoPE
        fine-tuned the same way as the control, when ``finetune_steps`` > 0)."""
        if encoding != "rope" or normalizer != "softmax":
            return ()
        variants = []
        if task_name in self.eval_only_tasks:
            variants += [EvalVariant("rope", f"rope-{name}") for name in self.eval_only_scalings]
        if task_name == "text" and self.finetune_steps and self.finetune_scalings:
            variants.append(EvalVariant("rope", "rope", "finetune"))
            variants += [EvalVariant("rope", f"rope-{name}", "finetune") for name in self.finetune_scalings]
        return tuple(variants)

    def implementation_at(self, tokens: int) -> str:
        """The attention implementation evaluation uses at ``tokens`` tokens."""
        if self.blockwise_from is not None and tokens >= self.blockwise_from:
            return self.eval_implementation
        return "materialize"

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting and what to do."""
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


_CPU_ENCODINGS = ("nope", "sinusoidal", "learned", "rope", "t5", "alibi")
_TEXT_CLAIM_ENCODINGS = ("nope", "sinusoidal", "learned", "rope", "t5", "alibi", "kerple-log", "sandwich", "fire")
_LONG_TEXT_ENCODINGS = (
    *("nope", "sinusoidal", "rope", "t5", "alibi", "kerple-log", "kerple-power", "sandwich", "fire"),
    *("transformer-xl", "xpos"),
)
_DECODER_TASKS = ("counting_copy", "counting_replace", "copy", "duplicate", "reverse")
# Four of Kazemnejad et al.'s five for the Colab runtime's time (counting replace is the fifth).
_COLAB_TASKS = ("counting_copy", "copy", "duplicate", "reverse")
_ENCODER_TASKS = ("reverse_string", "missing_duplicate", "parity", "bucket_sort")
_ALL_TASKS = (*_DECODER_TASKS, *_ENCODER_TASKS, "probe", "probe_boundary", "text")
# Every registered encoding but the 2-D grid RoPE (for images) and randomized positions alone
# (a position sampler, nothing consumes its positions without another encoding): those two
# run as hybrids with the encodings Ruoss et al. randomize.
_EVERY_ENCODING = (
    *(n for n in encoding_names() if n not in ("rope-2d", "randomized")),
    "rope+randomized",
    "sinusoidal+randomized",
)

_KAZEMNEJAD_PROTOCOL = (
    "Kazemnejad et al. 2023: decoder-only 12 x 768, 12 heads, AdamW lr 3e-5, weight decay 0.05, batch 64, 40,000 "
    "steps for every encoding, 6% warm-up, dropout 0.1; train lengths up to 20, test 21-40; 3 seeds; exact match of "
    "the greedy answer"
)
_RUOSS_PROTOCOL = (
    "Ruoss et al. 2023: encoder 5 x 64, 8 heads, the same budget for every encoding; train lengths 1-40, test 41-500; "
    "randomized positions sorted from [0, 2048); per-token accuracy"
)
_PRESS_PROTOCOL = (
    "Press et al. 2022: WikiText-103, 16 x 1024, trained at 512 tokens, perplexity by evaluation length to 15,512; "
    "Chi et al. 2022, 2023 and Li et al. 2023 test Kerple, Sandwich and FIRE the same way on their corpora"
)
_COPE_PROTOCOL = (
    "Golovneva et al. 2024: flip-flop at a fixed length with the density of ignore instructions varied, and counting "
    "tasks, with larger models than here"
)

_FIVE_SEEDS = (0, 1, 2, 3, 4)
# Per-task budgets of cpu-full, from the search in docs/site/benchmark-method.md: copy, duplicate
# and reverse need 4 layers for NoPE to learn them at length 10 (2 layers reach 0.7 in 6,000
# steps) and NoPE about 5,000 steps to 0.95; the encoder tasks learn within 2,000 at 2 layers.
# The budgets leave room for the criterion's margin (0.98). Every encoding of a task trains the
# same model.
_CPU_FULL_BUDGETS = (
    *((task, (("num_layers", 4), ("steps", 10_000))) for task in ("copy", "duplicate", "reverse")),
    *((task, (("steps", 4000),)) for task in ("reverse_string", "missing_duplicate", "parity", "bucket_sort")),
    # cpu-full runs no text (below), but keeps this entry: it is part of the settings' fingerprint.
    ("text", (("steps", 1000),)),
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
        text_eval_characters=1024,
        checkpoint_every=10,
        check_every=10,
        check_examples=16,
        finetune_steps=3,
        description="a pipeline check: every step of the benchmark in seconds; its numbers mean nothing",
    ),
    # The README's figures. Counting copy is learned by every encoding within a few hundred
    # steps (docs/site/benchmark-method.md, "Per-task budgets"); the text models at this size
    # stay above the best n-gram model, which the report says (text needs a larger model
    # than a 2-core CPU trains in minutes).
    "cpu": Preset(
        name="cpu",
        encodings=_CPU_ENCODINGS,
        tasks=("counting_copy", "text"),
        seeds=_FIVE_SEEDS,
        steps=2000,
        task_overrides=(("text", (("steps", 1000),)),),
        description="the README's figures: 6 encodings on counting copy and text, 5 seeds",
    ),
    # Every encoding on every algorithmic task. No text: at 2 x 64 no text cell beats the n-gram
    # bar (0 of 5 seeds in the first five encodings), so text is gpu-text's and gpu-long's, whose
    # 4 x 256 models do. Its copy, duplicate and reverse cells for the encodings not yet run (4 x 64,
    # 10,000 steps: about 30 CPU hours) are on the accelerator queue (posenc-bench queue).
    "cpu-full": Preset(
        name="cpu-full",
        encodings=_EVERY_ENCODING,
        tasks=tuple(task for task in _ALL_TASKS if task != "text"),
        seeds=_FIVE_SEEDS,
        steps=2000,
        task_overrides=_CPU_FULL_BUDGETS,
        eval_only_tasks=_ALL_TASKS,
        description="every encoding on every algorithmic task, RoPE scalings at evaluation on every task (text: "
        "gpu-text, gpu-long)",
    ),
    # Text trained at 256 characters, tested up to 128 times longer. The longest evaluations
    # hold no [T, S] scores: from 2048 tokens on, attention runs blockwise.
    "cpu-long": Preset(
        name="cpu-long",
        encodings=_CPU_ENCODINGS,
        tasks=("text",),
        seeds=_FIVE_SEEDS,
        steps=1000,
        text_context=256,
        text_multiples=(1, 2, 4, 8, 16, 32, 64, 128),
        text_eval_characters=65_536,
        eval_implementation="blockwise",
        blockwise_from=2048,
        description="text trained at 256 characters, tested up to 32,768 (128x) with blockwise attention",
    ),
    # Text on one GPU: a model large enough to beat the best n-gram model by the margin, so its
    # curve past the training length reads how the encoding extrapolates. The encodings are those
    # of the published text claims (Press et al. 2022; Chi et al. 2022, 2023; Li et al. 2023; the
    # RoPE scalings of Chen et al. 2023 and Peng et al. 2023, at evaluation and fine-tuned). The
    # accelerator presets make their training batches on the device, 50 steps a dispatch (a step
    # made on the host kept an H200 waiting 13 ms); the queue runs gpu-text at 10 seeds.
    "gpu-text": Preset(
        name="gpu-text",
        encodings=_TEXT_CLAIM_ENCODINGS,
        tasks=("text",),
        seeds=_FIVE_SEEDS,
        model_dim=256,
        num_layers=4,
        num_heads=8,
        mlp_dim=1024,
        steps=4000,
        batch_size=32,
        text_context=128,
        text_multiples=(1, 2, 4, 8, 16, 32),
        text_eval_characters=65_536,
        eval_implementation="blockwise",
        blockwise_from=2048,
        checkpoint_every=1000,
        check_every=200,
        description="text on one GPU: 9 encodings and RoPE's scalings, 4 x 256 trained at 128 characters, to 32x",
        paper_protocol=_PRESS_PROTOCOL,
        target="accelerator",
        batches="device",
        steps_per_dispatch=50,
    ),
    # The text claims far past the training length: gpu-text's model trained at 256 characters
    # and tested to 32,768 (128x), blockwise from 2,048 tokens, with every encoding a published
    # text claim names (Kerple-power, Transformer-XL and xPos beside gpu-text's). 5 seeds; one
    # 32,768-character test text, which each length scores whole.
    "gpu-long": Preset(
        name="gpu-long",
        encodings=_LONG_TEXT_ENCODINGS,
        tasks=("text",),
        seeds=_FIVE_SEEDS,
        model_dim=256,
        num_layers=4,
        num_heads=8,
        mlp_dim=1024,
        steps=4000,
        batch_size=32,
        text_context=256,
        text_multiples=(1, 2, 4, 8, 16, 32, 64, 128),
        text_eval_characters=32_768,
        eval_implementation="blockwise",
        blockwise_from=2048,
        checkpoint_every=1000,
        check_every=200,
        description="text on one GPU: the text claims' 11 encodings and RoPE's scalings, 4 x 256 trained at 256 "
        "characters, to 128x",
        paper_protocol=_PRESS_PROTOCOL,
        target="accelerator",
        batches="device",
        steps_per_dispatch=50,
    ),
    # Kazemnejad et al. 2023 on a CPU, under one budget: their five decoder tasks in their format
    # (instruction words, [NEXT] inside duplicate's answer, 100 symbols) and their five encodings,
    # their lengths halved (train 2-10 for their 4-20, test 11-20 for 21-40). 4 layers x 64: the
    # criterion runs had NoPE and ALiBi learn copy, duplicate and reverse at 4 layers in 5,200-8,500
    # steps, so those tasks train 10,000 steps (every encoding); the counting tasks, learned within
    # 2,000 at 2 layers, 4,000.
    "kazemnejad": Preset(
        name="kazemnejad",
        encodings=("nope", "t5", "alibi", "rope", "sinusoidal"),
        tasks=_DECODER_TASKS,
        seeds=_FIVE_SEEDS,
        num_layers=4,
        steps=10_000,
        task_overrides=tuple((task, (("steps", 4000),)) for task in ("counting_copy", "counting_replace")),
        train_length=10,
        train_min_length=2,
        eval_lengths=tuple(range(2, 21)),
        eval_only_tasks=(),
        checkpoint_every=500,
        task_format="paper",
        description="Kazemnejad et al.'s five decoder tasks in their format, their five encodings, lengths halved "
        "(train 2-10, test 11-20), one budget per task, 5 seeds",
        paper_protocol=_KAZEMNEJAD_PROTOCOL,
    ),
    # The same comparison at the paper's lengths (train 4-20, test 21-40) for the accelerator queue
    # (posenc_jax/bench/queue.py): 4 x 256 keeps a unit to a few minutes
    # on an H200 (cost model: about 2-3.5 min). The paper's own 12 x 768 for 40,000 steps (preset
    # `paper`) is some 40-60 H200-hours by the cost model (3 to 5 seeds), out of reach of loans of 15 minutes.
    "kazemnejad-long": Preset(
        name="kazemnejad-long",
        encodings=("nope", "t5", "alibi", "rope", "sinusoidal"),
        tasks=_DECODER_TASKS,
        seeds=_FIVE_SEEDS,
        model_dim=256,
        num_layers=4,
        num_heads=8,
        mlp_dim=1024,
        steps=10_000,
        batch_size=64,
        learning_rate=5e-4,
        task_overrides=tuple((task, (("steps", 4000),)) for task in ("counting_copy", "counting_replace")),
        train_length=20,
        train_min_length=4,
        eval_lengths=tuple(range(20, 41)),
        eval_examples=256,
        eval_only_tasks=(),
        checkpoint_every=2000,
        task_format="paper",
        description="Kazemnejad et al.'s five decoder tasks in their format and their five encodings at their "
        "lengths (train 4-20, test 21-40), 4 x 256, one budget per task, 5 seeds, a few minutes a queue unit on "
        "an H200; their 12 x 768 x 40,000 steps is some 40-60 H200-hours: out of reach",
        paper_protocol=_KAZEMNEJAD_PROTOCOL,
        target="accelerator",
        batches="device",
        steps_per_dispatch=50,
    ),
    # Ruoss et al. 2023: randomized positions against the same encoding without them, on their
    # encoder tasks in their format (bits; bucket sort over 5 symbols; missing duplicate keeps odd
    # lengths), every pair trained together with the same seeds and steps, tested to 10x the
    # training length (they train <= 40 and test 41-500; here train <= 10, test to 100).
    "ruoss": Preset(
        name="ruoss",
        # ALiBi and ALiBi + randomized would add 2.0 h here (cost model); the same folder takes them later
        # (--encodings alibi,alibi+randomized), since the list of encodings is not part of its settings.
        encodings=("rope", "rope+randomized", "sinusoidal", "sinusoidal+randomized"),
        tasks=_ENCODER_TASKS,
        seeds=_FIVE_SEEDS,
        steps=16_000,
        eval_lengths=(5, 10, 15, 20, 30, 40, 60, 80, 100),
        eval_only_tasks=(),
        checkpoint_every=1000,
        task_format="paper",
        description="Ruoss et al.'s encoder tasks in their format, with and without randomized positions, "
        "one budget (16,000 steps), tested to 10x",
        paper_protocol=_RUOSS_PROTOCOL,
    ),
    # Golovneva et al. 2024 (CoPE): flip-flop (Liu et al. 2023) and the counting task, with CoPE
    # and the encodings the paper compares it to. Trained on up to 16 pairs or statements (the
    # counting task says little below 16), 4 layers, tested to 4x.
    "cope-tasks": Preset(
        name="cope-tasks",
        encodings=("cope", "rope", "nope", "alibi"),
        tasks=("flip_flop", "cope_count"),
        seeds=_FIVE_SEEDS,
        num_layers=4,
        steps=3000,
        train_length=16,
        eval_lengths=(4, 8, 12, 16, 24, 32, 48, 64),
        eval_only_tasks=(),
        description="the CoPE paper's tasks (flip-flop, counting) with CoPE, RoPE, NoPE and ALiBi, 4 layers",
        paper_protocol=_COPE_PROTOCOL,
    ),
    # Kazemnejad et al. 2023's decoder tasks and encodings, lengths and seeds, for a Colab TPU
    # (v2-8 or v5e, all cores data-parallel). Sized for about 20 minutes at an assumed 20 TFLOP/s;
    # at the rates its own cells ran at on an H200 (COLAB_TPU_ON_H200) it takes about 55 minutes
    # (every cell its whole budget). Not yet run on a TPU. Its batches are made on the device, 50
    # steps a dispatch (the H200 cells of docs/extrapolation-colab-tpu-partial/ made them on the
    # host, one step a call: those rows are of other settings, and a run starts afresh).
    "colab-tpu": Preset(
        name="colab-tpu",
        encodings=("nope", "t5", "alibi", "rope", "sinusoidal"),
        tasks=_COLAB_TASKS,
        seeds=_FIVE_SEEDS,
        model_dim=256,
        num_layers=4,
        num_heads=8,
        mlp_dim=1024,
        steps=1500,
        batch_size=64,
        learning_rate=5e-4,
        train_length=20,
        eval_lengths=tuple(range(1, 41)),
        eval_examples=256,
        checkpoint_every=1500,
        eval_only_tasks=(),
        batches="device",
        steps_per_dispatch=50,
        description="four of Kazemnejad et al.'s five decoder tasks (train <= 20, test to 40) with a 4 x 256 model",
        paper_protocol=_KAZEMNEJAD_PROTOCOL,
        target="colab-tpu",
    ),
    # Kazemnejad et al. 2023: 12 x 768, 12 heads, AdamW 3e-5, wd 0.05, batch 64, 40K steps,
    # 6% warmup, dropout 0.1, train <= 20, test 21-40 (they ran 3 seeds; intervals need 5). For a GPU or TPU:
    # batches made on the device, 50 steps a dispatch.
    "paper": Preset(
        name="paper",
        encodings=("nope", "t5", "alibi", "rope", "sinusoidal"),
        tasks=_DECODER_TASKS,
        seeds=_FIVE_SEEDS,
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
        batches="device",
        steps_per_dispatch=50,
        description="Kazemnejad et al. 2023's protocol (12 x 768, 40K steps); for a GPU or TPU",
        paper_protocol=_KAZEMNEJAD_PROTOCOL,
        target="accelerator",
    ),
}


def finetune_batch(preset: Preset, train_tokens: int) -> int:
    """Windows per fine-tuning step: as many tokens a step as training's (at least one window)."""
    return max(1, preset.batch_size // preset.finetune_multiple)


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a preset (or one cell) asks for: trained cells (task x encoding x normaliser, all
    seeds together), floating-point operations of training, of fine-tuning RoPE's scaled
    variants (text only; the runner times it with evaluation) and of evaluation (all seeds), and
    the evaluation programs to compile (one per shape and encoding config: every length of the
    text task or of a length-dependent encoding, every length of a variant, whose scaling
    changes with the length)."""

    cells: int
    train_flops: float
    eval_flops: float
    eval_programs: int
    finetune_flops: float = 0.0
    train_steps: int = 0  # summed over cells; one step of a cell trains all its seeds

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def seconds(self, rates: Rates) -> float:
        """The wall time this cost takes at ``rates``: training and fine-tuning at the training
        rate plus a host cost per step, evaluation at its rate plus a compilation per program,
        and a fixed cost per cell (training's compilation, checks and checkpoints).

        Example:
          >>> Cost(cells=2, train_flops=4e12, eval_flops=1e11, eval_programs=3, train_steps=100).seconds(
          ...     Rates(train_flops_per_second=2e10, seconds_per_step=0.01, eval_flops_per_second=1e10,
          ...           seconds_per_eval_program=1.0, seconds_per_cell=10.0))
          234.0
        """
        return (
            (self.train_flops + self.finetune_flops) / rates.train_flops_per_second
            + self.train_steps * rates.seconds_per_step
            + self.eval_flops / rates.eval_flops_per_second
            + self.eval_programs * rates.seconds_per_eval_program
            + self.cells * rates.seconds_per_cell
        )


@functools.cache
def _task(name: str, max_length: int, format: str = "ours"):
    return make_task(name, max_length=max_length, format=format)


def _forward_flops_per_token(preset: Preset, context: int, vocab: int) -> float:
    """Multiply-adds x 2 of one token's forward pass: projections and MLP, attention over
    ``context`` keys (scores and weighted sum, all heads), the output head."""
    d = preset.model_dim
    per_layer = 2 * (4 * d * d + 2 * d * preset.mlp_dim) + 4 * context * d
    return preset.num_layers * per_layer + 2 * d * vocab


def step_flops(preset: Preset, *, tokens: int, vocab: int, batch: int) -> float:
    """FLOPs of one optimisation step of one seed on ``batch`` sequences of ``tokens`` tokens:
    3 x the forward pass (the backward pass costs about twice the forward).

    Example:
      >>> round(step_flops(PRESETS["cpu"], tokens=64, vocab=128, batch=32) / 1e9, 2)  # GFLOP
      1.51
    """
    return 3 * batch * tokens * _forward_flops_per_token(preset, tokens, vocab)


def cell_cost(
    preset: Preset, task_name: str, encoding: str, normalizer: str = "softmax", *, steps: int | None = None
) -> Cost:
    """The FLOPs and evaluation programs of one cell of ``preset`` (all its seeds), trained for
    ``steps`` steps (default: the task's whole budget). Seeds that have learned their task keep
    being computed, frozen, while the others train on, so a cell's training costs its seeds
    times the steps of the slowest seed.

    Example:
      >>> c = cell_cost(PRESETS["cpu"], "counting_copy", "rope", steps=700)
      >>> c.cells, round(c.train_flops / 1e12, 2), c.eval_programs  # 5 seeds x 700 steps
      (1, 1.48, 1)
    """
    task = _task(task_name, max(preset.eval_lengths) + 2, preset.task_format)  # as the runner makes it
    preset = preset.for_task(task_name)
    lengths = preset.lengths(task)
    steps = preset.steps if steps is None else steps
    train_tokens = task.max_tokens(lengths.train)
    longest = task.max_tokens(max(lengths.eval))
    one_shape = task.fixed_eval_shape and not any(encoding_info(p).length_dependent for p in encoding.split("+"))
    per_model = 0.0
    for n in lengths.eval:
        tokens = longest if one_shape else task.max_tokens(n)
        per_model += lengths.examples_at(n) * tokens * _forward_flops_per_token(preset, tokens, task.vocab_size)
    found = preset.eval_variants(task_name, encoding, normalizer)
    seeds = len(preset.seeds)
    train = seeds * steps * step_flops(preset, tokens=train_tokens, vocab=task.vocab_size, batch=preset.batch_size)
    tuned = sum(v.protocol == "finetune" for v in found)
    tuned_step = step_flops(
        preset,
        tokens=train_tokens * preset.finetune_multiple,
        vocab=task.vocab_size,
        batch=finetune_batch(preset, train_tokens),
    )
    finetune = seeds * tuned * preset.finetune_steps * tuned_step
    programs = (1 if one_shape else len(lengths.eval)) + len(found) * len(lengths.eval)
    return Cost(
        cells=1,
        train_flops=train,
        eval_flops=seeds * (1 + len(found)) * per_model,
        eval_programs=programs,
        finetune_flops=finetune,
        train_steps=steps,
    )


def cost(preset: Preset) -> Cost:
    """The cells, FLOPs and evaluation programs of ``preset``: :func:`cell_cost` of every cell
    that runs, each trained for its whole budget of steps (what a ``fixed-budget`` run trains; an
    upper bound for a ``to-criterion`` one, whose cells stop once learned).

    Example:
      >>> c = cost(PRESETS["cpu"])
      >>> c.cells, round(c.train_flops / 1e12, 1), round(c.finetune_flops / 1e12, 1), c.eval_programs
      (12, 70.6, 4.2, 71)
    """
    total = Cost(cells=0, train_flops=0.0, eval_flops=0.0, eval_programs=0)
    for name in preset.tasks:
        task = _task(name, max(preset.eval_lengths) + 2, preset.task_format)
        for encoding in preset.encodings:
            if runs_on(task, encoding):
                for normalizer in preset.normalizers:
                    total += cell_cost(preset, name, encoding, normalizer)
    return total


@dataclasses.dataclass(frozen=True)
class Rates:
    """How fast one machine runs the benchmark: the rates :meth:`Cost.seconds` turns a cost into
    seconds with. :func:`posenc_jax.bench.costmodel.fit_rates` fits them to measured runs.

    Attributes:
      train_flops_per_second: training (all seeds of a cell together), fine-tuning too.
      seconds_per_step: host work of one training step of a cell, whatever its FLOPs (making
        each seed's batch, dispatching the step); what bounds small models on an accelerator.
      eval_flops_per_second: evaluation.
      seconds_per_eval_program: compiling one evaluation program.
      seconds_per_cell: training's compilation, the checks and the checkpoints of one cell.
    """

    train_flops_per_second: float
    seconds_per_step: float
    eval_flops_per_second: float
    seconds_per_eval_program: float
    seconds_per_cell: float


# Fitted (posenc_jax.bench.costmodel.fit_rates; `python benchmarks/cost_model.py` prints each fit
# and how well it predicts its runs) to the cells of docs/extrapolation-cpu/ (the cpu preset's 12,
# commit 2d47bf5) and docs/extrapolation-cpu-full/ (93 of cpu-full, commits 47ebb12 to 402a460),
# both on this project's 2-core CPU, shared with other work; tests/test_bench.py refits them. The
# fit leaves out 18 cells that took over twice what the others' fit gives them (contended, by their
# time alone: 13 of them are missing-duplicate cells at 0.08-1.8 s a step, the 9 others 0.04-0.08).
# Measured over modelled time, for the cells fitted: 1.45 for the first run, 0.93 for the second.
# No per-step host cost shows on a CPU.
CPU_ESTIMATE = Rates(
    train_flops_per_second=29.7e9,
    seconds_per_step=0.0,
    eval_flops_per_second=18.0e9,
    seconds_per_eval_program=0.408,
    seconds_per_cell=17.9,
)
# Fitted the same way to the 36 cells of docs/budget-search/, docs/extrapolation-gpu-text/ and
# docs/extrapolation-colab-tpu-partial/ (the files of commit cf1ad04; their rows say bc093da,
# dirty), run on one NVIDIA H200, the only accelerator the benchmark has been timed on; the
# gpu-text run was three processes sharing it. Small models there are bound by the 13 ms of host
# work a step, not by FLOPs. Measured over modelled time: 0.86, 0.94 and 1.66 for the three runs.
H200_ESTIMATE = Rates(
    train_flops_per_second=38.2e12,
    seconds_per_step=0.0130,
    eval_flops_per_second=1.90e12,
    seconds_per_eval_program=1.05,
    seconds_per_cell=51.0,
)
# Fitted the same way to the colab-tpu preset's own 9 cells on that H200
# (docs/extrapolation-colab-tpu-partial/), which took 1.66 times what H200_ESTIMATE gives them:
# about 45 ms a step for 5 seeds at 4 x 256 (some 6 TFLOP/s, about 1% of the H200's TF32 peak)
# and 17-75 s of compilation a cell. Their evaluation did not take longer with more FLOPs (one
# program a cell), so the fit puts it all in the per-program term.
COLAB_TPU_ON_H200 = Rates(
    train_flops_per_second=23.6e12,
    seconds_per_step=0.0328,
    eval_flops_per_second=math.inf,
    seconds_per_eval_program=16.0,
    seconds_per_cell=83.0,
)
# Assumed, not measured (nothing has run on a TPU): a Colab TPU v2-8 with all 8 cores
# data-parallel runs the colab-tpu preset as fast as the H200 ran its cells. Peaks do not settle
# it either way: the v2-8's (about 180 TFLOP/s of bfloat16) is below the H200's (about 990), but
# these cells ran at about 1% of the H200's, bound by host work per step and by compilation,
# which a TPU host does too. A v5e chip has a peak like the v2-8's.
TPU_ESTIMATE = COLAB_TPU_ON_H200


def expected_seconds(preset: Preset, rates: Rates) -> float:
    """An estimate of a whole run's wall time: :func:`cost` (every cell to its whole budget, as a
    ``fixed-budget`` run trains) at the ``rates`` of a machine (:data:`CPU_ESTIMATE`, :data:`H200_ESTIMATE`,
    :data:`TPU_ESTIMATE`).

    Example:
      >>> round(expected_seconds(PRESETS["smoke"], CPU_ESTIMATE) / 60) <= 5  # minutes
      True
    """
    return cost(preset).seconds(rates)


def duration(seconds: float) -> str:
    """A time as runs print it: ``42s``, ``3m05s``, ``2h10m``.

    Example:
      >>> duration(185), duration(7800)
      ('3m05s', '2h10m')
    """
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
