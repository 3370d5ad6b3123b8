"""The extrapolation benchmark's presets: what a run trains and tests, as data.

:data:`PRESETS` holds the named runs (``posenc-bench extrapolate --preset NAME``), each a
:class:`~posenc_jax.bench.preset.Preset`, and :func:`catalogue` lists them with their expected run
times (``posenc-bench extrapolate --help``). The preset class, a task's resolved settings
(:mod:`posenc_jax.bench.settings`) and the cost model (:mod:`posenc_jax.bench.cost`) import from
here too.
"""

from __future__ import annotations

import textwrap

from posenc_jax.bench.cost import (
    COLAB_TPU_ON_H200,
    CPU_ESTIMATE,
    H200_ESTIMATE,
    TPU_ESTIMATE,
    Cost,
    Rates,
    cell_cost,
    cost,
    duration,
    estimate,
    expected_seconds,
    step_flops,
)
from posenc_jax.bench.preset import BATCHES, IMPLEMENTATIONS, PROTOCOLS, Preset
from posenc_jax.bench.settings import PER_TASK, EvalVariant, TaskLengths, TaskSettings, runs_on, why_not_run
from posenc_jax.bench.tasks import task as shared_task
from posenc_jax.bench.tasks import task_names
from posenc_jax.functional.core.registry import encoding_names

__all__ = [
    "BATCHES",
    "COLAB_TPU_ON_H200",
    "CPU_ESTIMATE",
    "H200_ESTIMATE",
    "IMPLEMENTATIONS",
    "PER_TASK",
    "PRESETS",
    "PROTOCOLS",
    "TPU_ESTIMATE",
    "Cost",
    "EvalVariant",
    "Preset",
    "Rates",
    "TaskLengths",
    "TaskSettings",
    "catalogue",
    "cell_cost",
    "cost",
    "duration",
    "estimate",
    "expected_seconds",
    "runs_on",
    "step_flops",
    "why_not_run",
]

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
    # The README's main command: a real result within 15 minutes on a 2-core CPU, install
    # included. Counting copy alone: every encoding learned it within 1,000 steps at this size
    # (docs/extrapolation-cpu/, each seed to its criterion: 300-1,000), so 1,200 steps each.
    # No text: at 2 x 64 no text model beats the n-gram bar (text is gpu-text's and gpu-long's).
    "cpu": Preset(
        name="cpu",
        encodings=_CPU_ENCODINGS,
        tasks=("counting_copy",),
        seeds=_FIVE_SEEDS,
        steps=1200,
        description="the README's main command: 6 encodings on counting copy, 5 seeds, beside Kazemnejad et al.'s "
        "figures",
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
        # Batches made inside the jitted program, 50 steps a call: 1.2x (bucket sort) to 1.4x (missing duplicate)
        # the steps per second of host batches on a 2-core CPU (5 seeds, RoPE + randomized). Its fixed-budget run
        # starts with these settings; the criterion run in docs/extrapolation-ruoss has another fingerprint.
        batches="device",
        steps_per_dispatch=50,
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


def catalogue() -> str:
    """The epilog of ``extrapolate --help``: presets with sizes and expected times, tasks, encodings."""
    lines = [
        "presets (seeds train together; times are estimates, every cell to its whole budget, from each preset's",
        "FLOPs at rates fitted to the project's measured runs, posenc_jax/bench/costmodel.py):",
    ]
    for name, p in PRESETS.items():
        c = cost(p)
        size = f"{p.num_layers} x {p.model_dim}, {p.steps} steps, batch {p.batch_size}"
        shape = f"{len(p.encodings)} encodings x {len(p.tasks)} tasks x {len(p.seeds)} seeds ({c.cells} cells)"
        when = estimate(p)
        if p.target == "colab-tpu":
            when += " (not run on a TPU: the time its cells took on an H200, assumed the same there)"
        elif p.target != "cpu":
            when = f"{c.train_flops / 1e15:,.0f} PFLOP of training; {when}"
        lines.append(f"  {name:10s} {p.description}")
        lines.append(f"  {'':10s} {size}; {shape}; {when}")
    lines.append("")
    lines.append("tasks:")
    for name in task_names():
        task = shared_task(name)
        family = "characters of context" if task.length_family == "text" else "symbols"
        lines.append(f"  {name:18s} {task.kind}, {task.metric.replace('_', ' ')}; lengths in {family}")
    lines.append("")
    lines.append("encodings (a+b for a hybrid, e.g. rope+randomized):")
    lines += textwrap.wrap(", ".join(encoding_names()), width=100, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)
