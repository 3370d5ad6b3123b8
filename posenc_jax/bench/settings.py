"""One task's settings in a run, resolved once from its preset: what a cell trains and tests with.

A :class:`~posenc_jax.bench.presets.Preset` describes a whole run; :meth:`Preset.resolve
<posenc_jax.bench.presets.Preset.resolve>` turns it, for one task, into a :class:`TaskSettings`:
the preset's settings with the task's own overrides applied, the task's lengths
(:class:`TaskLengths`) and the evaluation variants it asks for (:class:`EvalVariant`). The
runner resolves each task once; the cells, the criterion, the baselines and the cost model read
these, and nothing downstream goes back to the preset.
"""

from __future__ import annotations

import dataclasses

from posenc_jax.functional.core.registry import encoding_config, encoding_info

__all__ = ["PER_TASK", "EvalVariant", "TaskLengths", "TaskSettings", "runs_on", "why_not_run"]

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


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """Everything one task of a run trains and is tested with, resolved from the preset once
    (:meth:`Preset.resolve <posenc_jax.bench.presets.Preset.resolve>`): the preset's settings with
    the task's overrides (``task_overrides``) applied, its lengths, and the RoPE scalings its
    trained RoPE model is evaluated with.

    The fields of the model, training, the gate and fine-tuning mean what the
    :class:`~posenc_jax.bench.presets.Preset` fields of the same names do. ``task`` is the task
    itself (not compared: the name stands for it), ``preset`` the preset's name (each row's
    ``preset``), ``eval_scalings`` the scalings applied at evaluation only (empty unless the
    preset lists the task in ``eval_only_tasks``), ``finetune_scalings`` those fine-tuned into
    the text task's model (empty for any other task, or with no fine-tuning steps).
    """

    name: str
    task: object = dataclasses.field(compare=False, repr=False)
    preset: str
    seeds: tuple[int, ...]
    lengths: TaskLengths
    model_dim: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float
    query_init_scale: float
    steps: int
    batch_size: int
    learning_rate: float
    warmup_fraction: float
    weight_decay: float
    protocol: str
    batches: str
    steps_per_dispatch: int
    checkpoint_every: int
    check_every: int
    check_examples: int
    learned_threshold: float
    criterion_margin: float
    text_margin: float
    equivalence_margin: float
    text_equivalence_margin: float
    eval_implementation: str
    blockwise_from: int | None
    eval_scalings: tuple[str, ...]
    finetune_scalings: tuple[str, ...]
    finetune_steps: int
    finetune_multiple: int
    finetune_learning_rate: float

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @property
    def finetune_batch(self) -> int:
        """Windows per fine-tuning step: as many tokens a step as training's (at least one window)."""
        return max(1, self.batch_size // self.finetune_multiple)

    def variants(self, encoding: str, normalizer: str) -> tuple[EvalVariant, ...]:
        """The variants of one trained cell: RoPE scalings of the softmax RoPE model applied at
        evaluation (``eval_scalings``) and after a short fine-tune at ``finetune_multiple`` times
        the training context (``finetune_scalings``, with plain RoPE fine-tuned the same way as
        the control)."""
        if encoding != "rope" or normalizer != "softmax":
            return ()
        variants = [EvalVariant("rope", f"rope-{name}") for name in self.eval_scalings]
        if self.finetune_scalings:
            variants.append(EvalVariant("rope", "rope", "finetune"))
            variants += [EvalVariant("rope", f"rope-{name}", "finetune") for name in self.finetune_scalings]
        return tuple(variants)

    def implementation_at(self, tokens: int) -> str:
        """The attention implementation evaluation uses at ``tokens`` tokens."""
        if self.blockwise_from is not None and tokens >= self.blockwise_from:
            return self.eval_implementation
        return "materialize"

    def with_seeds(self, seeds) -> TaskSettings:
        """These settings for ``seeds`` alone (what the cost of part of a cell is counted for)."""
        return dataclasses.replace(self, seeds=tuple(seeds))


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
