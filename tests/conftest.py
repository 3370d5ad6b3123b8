"""Test configuration: strict dtype and rank promotion, so silent broadcasting bugs fail loudly; and
quicker compilation.

Most of the suite's time is XLA compiling many small programs. The suite compiles them with
``jax_disable_most_optimizations``, which turns off LLVM's optimisation of the generated machine code
only: XLA's own passes (fusion, layout, buffer assignment) still run, so the compiled programs' form and
their ``memory_analysis()``, which tests pin, are the ones users get, and float results do not depend on
it beyond rounding. Where the installed XLA has them, the suite also compiles with XLA:CPU's legacy fusion
emitters (``--xla_cpu_use_fusion_emitters=false``), which halves its compile time; their pipeline is not
quite the users' (scatters become loops, products round differently), so a test that reads a compiled
program's form or memory compiles with the users' emitters, and so do the children checking the library's
bitwise claims (``compiled.py``).
Both are set in the environment, so subprocesses (the notebooks' kernels, the benchmark's command line)
inherit them; ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 python -m pytest`` runs the suite fully optimised with
the default emitters.
"""

import os

import jax
import numpy as np
import pytest
from compiled import choose_emitters

_quick_compile = os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1").lower() not in ("0", "false")
if _quick_compile:
    choose_emitters()

# Data and fixture modules of the tests, not tests: p_rope.py registers an encoding when imported, which
# test_contract.py does in a scratch registry only.
collect_ignore = ["p_rope.py", "bad_inputs.py"]

jax.config.update("jax_disable_most_optimizations", _quick_compile)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


# The slow tier (marker ``slow``): tests that cost the most time and whose feature a faster test in the main
# suite also covers. ``python -m pytest`` leaves them out (pyproject's addopts: ``-m "not slow"``);
# ``python -m pytest -m slow`` runs them alone (CI's own step) and ``python -m pytest -m ""`` runs everything.
# Most carry ``@pytest.mark.slow`` in their files; marked here by node id: the tests in SLOW, and the
# parametrized tests whose cases split between the tiers (SLOW_BUT).

# Whole tests (every case), each with why it is slow and what keeps its feature in the main suite.
SLOW = {
    "tests/test_broadcast.py::test_shared_bias_gradients_match_a_bias_broadcast_by_hand": (
        "its cost check (test_shared_bias_gradient_sums_the_batch_at_less_cost_than_plain_broadcasting) stays"
    ),
    "tests/test_nn.py::test_length_dependent_scalings_decode_one_layer_as_the_forward_of_each_prefix": (
        "a decode per prefix; test_contract's length-dependent scalings and test_hf's current-length rotation stay"
    ),
    "tests/test_caches.py::test_fuzz_caches_made_for_another_model_or_layer_are_refused_naming_it": (
        "40 drawn pairs of models; test_a_layer_refuses_a_cache_made_for_another_layer_naming_what_differs stays"
    ),
    "tests/test_notebooks.py::test_install_cell_installs_a_wheel_uploaded_beside_it_in_a_fresh_kernel": (
        "a fresh environment and kernel; CI's own step runs the whole quickstart from an uploaded wheel"
    ),
    "tests/test_project.py::test_readme_quickstart_runs": (
        "a subprocess running every python block of the README; the calls it makes are tested in test_nn and"
        " test_attention"
    ),
    "tests/test_training.py::test_checkpoint_round_trip_and_exact_resume": (
        "a model with dropout trained, saved and resumed; test_checkpoint's restores with the optimizer stay"
    ),
    "tests/test_training.py::test_sharded_training_equals_single_device_on_8_simulated_devices": (
        "a subprocess with 8 simulated devices; test_train_dispatch's data-parallel mesh test stays"
    ),
    "tests/test_bench.py::test_a_finished_cell_leaves_no_checkpoints_unless_asked": (
        "two benchmark runs; test_bench's resume tests stay"
    ),
    "tests/test_queue.py::test_a_unit_killed_after_its_first_row_leaves_a_folder_the_report_reads": (
        "a unit interrupted and read; test_the_queue_runs_each_cell_seed_once_and_resumes stays"
    ),
    "tests/test_queue.py::test_a_cells_seeds_run_together_when_they_fit": (
        "the tiny queue run again; test_chunks_keep_the_seeds_order_within_the_limit stays"
    ),
    "tests/test_hosts.py::test_processes_train_their_share_of_the_cells_and_merge": (
        "two child processes; test_two_hosts_write_their_own_folders_and_merge_into_one_report stays"
    ),
    (
        "tests/test_train_dispatch.py::"
        "test_device_batches_train_as_a_plain_loop_of_them_and_a_resumed_run_as_an_uninterrupted_one"
    ): ("three training runs; test_host_batches_one_step_a_call_train_exactly_as_a_plain_loop_of_host_batches stays"),
    "tests/test_bench.py::test_hybrids_with_randomized_positions_run_and_are_sized_from_the_sampler": (
        "a benchmark run of the hybrids; test_nn's randomized positions in training and evaluation stay"
    ),
    "tests/test_caches.py::test_a_half_precision_cache_decodes_close_to_the_full_forward": (
        "a prefill and decode per dtype; test_nn's test_prefill_then_decode_equals_full_forward stays (float32)"
    ),
    (
        "tests/test_checkpoint.py::"
        "test_ones_own_model_is_refused_a_checkpoint_of_other_encodings_or_heads_of_the_same_shapes"
    ): ("several models saved; test_another_encoding_of_the_same_shapes_is_refused_naming_both stays"),
    "tests/test_checkpoint.py::test_flipped_bytes_are_found_and_the_previous_intact_step_restored": (
        "two steps saved and one damaged; test_every_step_damaged_is_an_error_naming_them stays"
    ),
    "tests/test_bench_method.py::test_to_criterion_stops_once_every_seed_held_the_criterion_at_two_checks": (
        "the older protocol's training run; test_held_reads_two_checks_in_a_row and the fixed-budget run stay"
    ),
    "tests/test_encoding_names.py::test_sequence_parallel_attention_takes_every_form": (
        "every form on a simulated mesh; test_sharded's sequence-parallel tests stay"
    ),
    "tests/test_materialized_benchmark.py::test_materialized_benchmark_writes_its_three_tables": (
        "a benchmark end to end; the budgets it reports are pinned by test_materialized_memory and test_sizes"
    ),
    "tests/test_project.py::test_relative_memory_benchmark_small_run": (
        "a benchmark end to end; test_relative's compiled-memory checks (term_checks) stay"
    ),
    "tests/test_nn.py::test_attention_and_model_shapes_with_and_without_jit": (
        "a model run eagerly, op by op; every test_nn test checks the jitted model's shapes, and test_attention runs"
        " its cases eagerly too (maybe_jit)"
    ),
    "tests/test_nn.py::test_cache_overflow_is_an_error": (
        "a model decoding eagerly and jitted; test_caches' test_decoding_past_the_cache_names_its_slots_and_the_"
        "position_in_and_out_of_jit stays"
    ),
    "tests/test_bench_method.py::test_another_text_corpus_is_refused_where_results_of_one_are": (
        "two benchmark runs; test_bench's test_the_ledger_repairs_a_cut_last_row_and_refuses_other_settings stays"
    ),
    "tests/test_bench.py::test_the_text_task_takes_its_lengths_from_text_lengths": (
        "a benchmark run; test_bench's refusal of --text-lengths that are not multiples of the context stays, and"
        " CI's main job runs the smoke preset's text lengths"
    ),
    "tests/test_attention_fusion.py::test_vmapped_attention_agrees_per_example": (
        "every example's values and gradients compared; test_attention's test_vmap_over_batch_equals_batched stays"
    ),
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom_in_a_fresh_kernel": (
        "a wheel, a fresh environment and kernel per notebook; the install cell in a fresh kernel stays, and CI's"
        " own steps run the quickstart from a clone and from an uploaded wheel"
    ),
}

# The end-to-end paths run for every encoding in the slow tier; the main suite runs them for one encoding of
# each mechanism (a rotation, a distance bias, a bucketed bias, a contextual one, a four-term relative one),
# and checks every encoding's hooks and tile forms against their references (test_contract).
REPRESENTATIVES = ("rope", "alibi", "t5", "cope", "transformer-xl")
# Parametrized tests: the node id and the cases the main suite keeps; the other cases are slow.
SLOW_BUT = {
    # Paired causal blocks: an even count stays; the odd counts (padded or not) and the one-block shapes are slow.
    "tests/test_blockwise_compile.py::test_paired_blocks_agree_with_the_materialised_attention": ("64-16",),
    "tests/test_blockwise.py::test_every_encoding_blockwise_equals_materialising": REPRESENTATIVES,
    "tests/test_blockwise.py::test_tile_forms_equal_materialising_on_runs_and_gaps": ("cope",),
    "tests/test_blockwise.py::test_tile_forms_forward_mode_equals_materialising": ("rope", "cope"),
    "tests/test_nn.py::test_prefill_then_decode_equals_full_forward": REPRESENTATIVES,
    "tests/test_nn.py::test_every_encoding_trains_a_step_with_finite_gradients": REPRESENTATIVES,
    "tests/test_nn.py::test_packed_rows_equal_separate_sequences": REPRESENTATIVES,
    "tests/test_nn.py::test_causality_through_gradients": REPRESENTATIVES,
    "tests/test_nn.py::test_split_state_decode_step_equals_the_forward_and_compiles_once_per_shape": REPRESENTATIVES,
    "tests/test_nn.py::test_blockwise_attention_over_a_cache_reads_each_key_tiles_stored_terms": REPRESENTATIVES,
    "tests/test_properties.py::test_fully_masked_rows_stay_finite_with_every_encoding": tuple(
        f"{name}-{dtype}" for name in REPRESENTATIVES for dtype in ("f32", "bf16", "f16")
    ),
    "tests/test_nn.py::test_caches_hold_per_key_terms_and_work_without_them": ("transformer-xl-shapes1-tables1",),
    "tests/test_contract.py::test_built_hooks_pass_through_jit_vmap_both_autodiff_modes_and_bfloat16": REPRESENTATIVES,
    "tests/test_blockwise.py::test_every_normalizer_blockwise_equals_materialising": (
        "softmax",
        "l2",
        "relu2 (per row)",
        "urpe",
    ),
    "tests/test_relative.py::test_functional_relative_joined_to_the_content_product_equals_its_term_added": (
        "2-None",
        "2-0.3",
    ),
    "tests/test_contract.py::test_plain_forms_of_the_other_backends_equal_the_cpu_forms": ("cope", "shaw", "deberta"),
    "tests/test_beyond_seeds.py::test_cope_in_attention_by_blocks_equals_its_term_added": ("increasing",),
    "tests/test_beyond_seeds.py::test_cope_self_attention_by_causal_prefixes_equals_the_whole_term": ("increasing",),
    # A grid (no mask, a key mask, a pair mask) x (shared, per head) x (clipped, more than keys): each value kept.
    "tests/test_beyond_seeds.py::test_cope_term_added_by_blocks_equals_the_term_added": (
        "None-shared-clipped",
        "keys-per-head-more-than-keys",
        "pairs-per-head-clipped",
    ),
    # Sandwich against its float64 reference: dims 2, 8 and 64 at every position set stay (dim 128 only adds terms
    # to the same sum; test_zero_on_the_diagonal_and_non_positive[128] keeps that dim in the main suite).
    "tests/test_sandwich.py::test_bias_matches_the_float64_reference": tuple(
        f"{dim}-{positions}"
        for dim in (2, 8, 64)
        for positions in (
            "causal-self",
            "causal-chunk",
            "causal-decode",
            "bidirectional-self",
            "bidirectional-gaps",
            "cross",
        )
    ),
    # Eager and jitted: the jitted case stays; eager attention stays in test_attention's other maybe_jit tests.
    "tests/test_attention.py::test_packed_segments_equal_separate_sequences": ("jit",),
    "tests/test_attention.py::test_grouped_query_heads_equal_repeated_kv_heads": ("jit",),
    # Eager and jitted: every case jitted, and eagerly the first.
    "tests/test_relative.py::test_table_gradient_equals_plain_autodiff": (
        "eager-self",
        *(f"jit-{case}" for case in ("self", "offsets", "batched-runs", "int32-limits", "gaps", "repeat")),
    ),
    "tests/test_reliability.py::test_a_masked_keys_value_never_reaches_the_output": (
        "key_mask-nan",
        "causal-nan",
        "segments-nan",
        "general-nan",
    ),
    "tests/test_generation.py::test_greedy_generation_equals_repeated_full_forwards": ("rope",),
    "tests/test_task_formats.py::test_teacher_forced_exact_match_is_greedy_exact_match": REPRESENTATIVES,
    # Training runs of the benchmark: one of the two resumptions stays.
    "tests/test_bench.py::test_seeds_left_at_different_steps_resume_together": ("common step",),
}


def _case(item):
    return item.callspec.id if hasattr(item, "callspec") else None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: these marks count for it
def pytest_collection_modifyitems(config, items):
    found, kept = set(), set()
    for item in items:
        name = item.nodeid.split("[", 1)[0]
        if name in SLOW:
            found.add(name)
            item.add_marker(pytest.mark.slow)
        elif name in SLOW_BUT:
            found.add(name)
            if _case(item) in SLOW_BUT[name]:
                kept.add(name)
            else:
                item.add_marker(pytest.mark.slow)
    # A listed test that a whole file's collection no longer has (renamed or removed), or a split test none of
    # whose kept cases is there, would move tests between the tiers unseen: refused, unless the run names
    # tests (``file::test``) rather than whole files.
    if any("::" in arg for arg in config.args):
        return
    collected = {item.nodeid.split("::", 1)[0] for item in items}
    for name in [*SLOW, *SLOW_BUT]:
        if name.split("::", 1)[0] not in collected:
            continue
        if name not in found:
            raise pytest.UsageError(
                f"tests/conftest.py names {name} for the slow tier, and its file has no such test: "
                "rename or remove it in SLOW or SLOW_BUT"
            )
        if name in SLOW_BUT and name not in kept:
            raise pytest.UsageError(
                f"tests/conftest.py keeps the cases {list(SLOW_BUT[name])} of {name} in the main suite, and it has "
                "none of them: name at least one of its cases in SLOW_BUT"
            )


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test once as written and once with the function under ``jax.jit``."""

    def wrap(fn, **jit_kwargs):
        return jax.jit(fn, **jit_kwargs) if request.param else fn

    return wrap


@pytest.fixture
def rng():
    return np.random.default_rng(0)
