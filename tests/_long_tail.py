"""The quick subset's long tail: tests the quick subset (``python -m pytest -m "not slow"``) leaves out, each with why.

Each entry is a test id (``path::name``, a class's ``path::Class::name``) or one parametrization of it
(``...[id]``); :func:`mark` (``tests/conftest.py``) gives every collected test it names the ``slow`` marker, and
every 3- and 4-rank case whose 2-rank twin is collected (:data:`LARGER_WORLDS`). Each
takes several seconds on 2 cores and shares its code paths with a cheaper test that stays quick (named in the
reason). The full suite runs them all. An entry that names no collected test fails the run once its file is
collected whole (a renamed test must not rejoin the quick subset unnoticed, nor an entry outlive its test).
"""

from __future__ import annotations

import pytest

LONG_TAIL: dict[str, str] = {
    "tests/test_demo.py::test_demo_loads_a_checkpoint_directory": "a checkpoint saved, then a 2-rank demo of it (subprocess); test_integration_transformers_load covers loading in-process",
    "tests/test_demo.py::test_demo_pd_into_a_sharded_decode_group_of_another_size": "prefill ranks, a decode group of 3 and Mooncake (subprocess); test_runtime_pd covers N -> M in-process",
    "tests/test_demo.py::test_demo_table_rows_add_up_and_progress_goes_to_stderr": "a second full 2-rank demo (subprocess); the default run's JSON rows are checked in the quick subset",
    "tests/test_demo.py::test_demo_refuses_an_attention_backend_or_device_this_machine_cannot_run": "a demo process importing torch (the other refusals run in-process)",
    "tests/test_prefix_cache_capacity.py::test_cli_shared_prefix_scenario_prints_one_json_object": "the capacity CLI in a subprocess; test_shared_pages_count_once_in_the_replicated_and_the_sharded_pools checks its numbers in-process",
    "tests/test_transfer_nixl.py::test_a_verbose_nixl_log_level_shows_nixls_log_again": "a NIXL engine in a subprocess at another log level; test_a_successful_start_and_transfer_print_nothing[default] stays quick",
    "tests/test_bench_logits_topk.py::test_smoke_rows": "the benchmark's smoke under the interpreter (subprocess); its kernel is tested in tests/test_ops_logits_topk.py",
    "tests/test_ops_compile.py::test_the_offline_compiler_reports_a_kernel_that_does_not_compile": "two kernels compiled offline in a subprocess; the build step (-m build) runs the compiler on every kernel",
    "tests/test_runtime_graphs.py::test_full_view_buckets_score_the_batch_in_one_indexer_launch": "the interpreted indexer inside a graph bucket; tests/test_ops_indexer_logits.py checks key tables per query in the quick subset, test_graph_path_equals_the_eager_path the bucket",
    "tests/test_demo.py::test_torchrun_demo_runs_one_job_on_torchruns_group_and_prints_one_json_object": "torchrun with 2 ranks (subprocess)",
    "tests/test_demo_single_process.py::test_demo_cli_at_cp_1_reports_parity": "the CLI at cp=1 (subprocess); test_one_process_runs_every_model_in_every_mode covers the run in-process",
    "tests/test_demo_single_process.py::test_one_process_runs_every_model_in_every_mode[glm5-triton]": "the transformers models on the interpreted kernels; [reference-triton] stays quick",
    "tests/test_demo_single_process.py::test_one_process_runs_every_model_in_every_mode[deepseek-v32-triton]": "as above",
    "tests/test_decode_demo.py::test_demo_decode_sharded_json_reports_parity_with_full_view_decode": "a 2-rank demo (subprocess); test_decode_model covers sharded decode in-process",
    "tests/test_examples.py::test_engine_paged_pool_runs_the_main_path_from_a_req_to_token_map[2-4]": "the example at more sizes (subprocess each); [2-1] stays quick",
    "tests/test_examples.py::test_engine_paged_pool_runs_the_main_path_from_a_req_to_token_map[3-5]": "as above",
    "tests/test_examples.py::test_multi_rank_flow_views_hold_every_computed_row[3-1]": "the example at 3 ranks (subprocess); [2-4] stays quick",
    "tests/test_integration_transformers.py::test_cp_prefill_and_decode_match_the_models_own_forward[deepseek-v32-round_robin-fp8-64-4]": "the largest parity runs (4 ranks, page 64); the small cases of the same test stay quick",
    "tests/test_integration_transformers.py::test_cp_prefill_and_decode_match_the_models_own_forward[glm5-round_robin-fp8-1-3]": "as above (page size 1: one page per token)",
    "tests/test_integration_transformers.py::test_cp_prefill_and_decode_match_the_models_own_forward[deepseek-v32-zigzag-bf16-16-2]": "as above",
    "tests/test_integration_transformers.py::test_bfloat16_model_matches_its_own_forward_within_an_ulp[glm5]": "bfloat16 forward of both models; [deepseek-v32] stays quick",
    "tests/test_integration_transformers_indexer.py::test_fp8_kernel_selects_what_the_torch_fp8_math_selects[glm5-exact]": "the interpreted indexer kernel at GLM-5's sizes; [deepseek-v32] stays quick",
    "tests/test_integration_transformers_indexer.py::test_fp8_kernel_selects_what_the_torch_fp8_math_selects[glm5-grouped]": "the interpreted indexer kernel at GLM-5's sizes; [deepseek-v32] stays quick",
    "tests/test_integration_transformers_pd.py::test_pd_decode_continues_the_cp_prefill": "prefill ranks, a decode group and Mooncake for a transformers model; test_runtime_pd covers the handoff",
    "tests/test_attention_models.py::test_transformers_absorbed_triton_vs_expanded_torch[deepseek-v32-fp8]": "interpreted sparse MLA over fp8 pages; the bf16 cases stay quick",
    "tests/test_attention_models.py::test_transformers_absorbed_triton_vs_expanded_torch[glm5-fp8]": "as above",
    "tests/test_bench_runtime.py::test_two_gloo_ranks_run_every_case": "the benchmark's smoke on 2 ranks (subprocess); its pieces are tested in-process",
    "tests/test_decode_bench.py::test_bench_decode_smoke_on_two_gloo_ranks": "the benchmark's smoke on 2 ranks (torchrun)",
    "tests/test_ops_bounds.py::test_default_window_and_flat_configurations_stay_in_bounds[write_owned]": "the owner filter's every path under the address check; the other ops stay quick",
    "tests/test_repo.py::test_the_mooncake_check_can_be_turned_off_explicitly": "pytest in a subprocess, twice",
    "tests/test_repo.py::test_an_installed_mooncake_whose_engine_does_not_load_fails_the_run_saying_how_to_fix_it": "pytest in a subprocess",
    "tests/test_runtime_pd.py::test_n_to_m_handoff_writes_each_page_once_on_its_decode_owner[prefill2-decode4]": "6 ranks and Mooncake; [prefill1-decode3] stays quick",
    "tests/test_runtime_pd.py::test_n_to_m_handoff_writes_each_page_once_on_its_decode_owner[prefill4-decode1]": "5 ranks and Mooncake; as above",
    "tests/test_runtime_pd.py::test_a_fault_mid_handoff_fails_every_decode_rank_and_reports_nothing_ok[one-decode-rank-fails-alone]": "waits out a transfer deadline; the other faults stay quick",
    "tests/test_transfer_faults.py::TestStoreStalls::test_stalled_store_fails_every_wait_within_timeout_plus_1s": "waits out every timeout of a stopped store",
    "tests/test_transfer_faults.py::TestConstruction::test_failed_construction_closes_the_engine_it_created[mooncake]": "Mooncake engines started and failed in turn; the local engine's case stays quick",
    "tests/test_transfer_faults.py::TestConstruction::test_failed_construction_unwinds_its_registration[mooncake]": "as above",
    "tests/test_transfer_mooncake.py::test_cp_prefill_to_decode_bitwise[world4-full-direct]": "4 prefill ranks over Mooncake; the 2-rank cases stay quick",
    "tests/test_transfer_mooncake.py::test_decode_killed_mid_transfer": "kills a decode process and waits out the deadline",
    "tests/test_transfer_mooncake_log.py::test_a_successful_start_prints_no_mooncake_error_line[ERROR]": "a Mooncake engine in a subprocess; [None] stays quick",
    "tests/test_transfer_mooncake_log.py::test_a_verbose_mc_log_level_shows_mooncakes_log_again": "as above",
    "tests/test_transfer_pd.py::test_pd_decode_matches_baseline_and_reference[world4-bf16]": "4 prefill ranks over Mooncake; [world2-direct-fp8] stays quick",
    "tests/test_transfer_exit.py::test_a_process_exits_cleanly_while_threads_keep_calling_the_store": "a subprocess that exits under load; test_calls_queued_before_exit_still_run stays quick",
    "tests/test_transfer_security.py::TestFreshness::test_replayed_attempt_never_makes_prefill_send[1-claimed-and-answered]": "waits out a claim; the never-claimed cases stay quick",
    "tests/test_transfer_security.py::TestFreshness::test_replayed_attempt_never_makes_prefill_send[2-never-claimed]": "as above",
    "tests/test_runtime_inputs_multirank.py::test_every_rank_refuses_a_bad_step_together_and_nothing_changes[transformers-3]": "the transformers model on 3 ranks; the reference model's cases stay quick",
    "tests/test_runtime_transformers.py::test_sharded_decode_matches_full_view_decode_and_the_models_own_forward[deepseek-v32-4-fp8-round_robin-interleave]": "4 ranks; the 2- and 3-rank cases stay quick",
    "tests/test_multirank_harness.py::test_a_rank_that_dies_is_named_with_its_exit_code_and_the_group_respawns": "kills a rank and respawns the group",
    "tests/test_transfer_prefilled.py::test_a_first_token_outside_the_vocabulary_is_a_transfer_error[-1-transformers]": "the transformers adapter's cases; the reference model's stay quick",
    "tests/test_transfer_prefilled.py::test_a_first_token_outside_the_vocabulary_is_a_transfer_error[1000000-transformers]": "as above",
    "tests/test_transfer_prefilled.py::test_a_prompt_that_is_not_the_prefilled_one_is_a_transfer_error[another_order-transformers]": "as above",
    "tests/test_transfer_prefilled.py::test_a_prompt_that_is_not_the_prefilled_one_is_a_transfer_error[same_length-transformers]": "as above",
    "tests/test_agree.py::test_agreeing_ranks_all_return[world4]": "4 ranks; [world2] stays quick",
    "tests/test_transfer_faults.py::TestConstruction::test_failed_construction_unwinds_its_registration[nixl]": "NIXL agents started and failed in turn; the local engine's case stays quick",
    "tests/test_attention_flashmla_fake.py::test_sharded_decode_on_one_rank_hands_the_model_its_compute_dtype[transformers-bf16]": "a bfloat16 transformers model on the CPU; [transformers-fp32] and the reference model's case stay quick",
    "tests/test_integration_transformers_indexer.py::test_fp8_kernel_selects_what_the_torch_fp8_math_selects[deepseek-v32-exact]": "the interpreted indexer kernel at the model's sizes; tests/test_ops_indexer_logits.py checks the kernel against its reference at awkward sizes in the quick subset",
    "tests/test_integration_transformers_indexer.py::test_fp8_kernel_selects_what_the_torch_fp8_math_selects[deepseek-v32-grouped]": "the interpreted indexer kernel at the model's sizes; tests/test_ops_indexer_logits.py checks the kernel against its reference at awkward sizes in the quick subset",
    "tests/test_bench_indexer_logits.py::test_smoke_kernel_sweep_and_table": "the benchmark's sweep under the interpreter; its pieces are tested in tests/test_ops_indexer_logits.py",
    "tests/test_repo.py::test_the_nixl_check_can_be_turned_off_explicitly[env]": "pytest in a subprocess; [marker] stays quick",
    "tests/test_integration_transformers.py::test_cp_prefill_and_decode_match_the_models_own_forward[glm5-zigzag-fp8-1-4-scheme]": "4 ranks at page size 1; [glm5-zigzag-bf16-64-3-prefetch] keeps GLM-5 quick",
    "tests/test_attention_models.py::test_transformers_absorbed_triton_vs_expanded_torch[glm5-bf16]": "interpreted sparse MLA for GLM-5; [deepseek-v32-bf16] stays quick",
    "tests/test_transfer_nixl.py::test_a_successful_start_and_transfer_print_nothing[WARN]": "a NIXL engine in a subprocess at another log level; [default] stays quick",
    **{
        f"tests/test_ops_logits_topk.py::test_triton_vs_reference_sizes[tiles16-{size}-{path}]": (
            "the interpreted kernel at more sizes; [default-*] and the small sizes stay quick"
        )
        for size in ("3-300-31", "2-1031-64", "3-4099-5")
        for path in ("exact", "grouped")
    },
}
LONG_TAIL.update(
    {
        f"tests/test_ops_logits_topk.py::test_triton_vs_reference[{launch}-{kind}-{path}]": (
            "another launch of the interpreted kernel on another input kind; every kind stays quick on the "
            "default launch and on 16 columns a step, and every launch on ties and specials (both paths each)"
        )
        for launch in ("tiles32_warps4", "tiles128")
        for kind in ("normal", "constant", "sparse", "spread", "very_negative", "near_threshold")
        for path in ("exact", "grouped")
    }
)
LONG_TAIL.update(
    {
        f"tests/test_ops_keys_topk.py::test_triton_vs_reference[{launch}-{kind}]": (
            "another launch of the interpreted kernels on another input kind; every kind stays quick on the default "
            "launch, on 32 keys a program and on 11-bit digits, and every launch on exact ties and one-ulp gaps"
        )
        for launch in ("chunk128_warps2", "digits5")
        for kind in ("normal", "constant", "sparse", "specials", "spread", "none")
    }
)
LONG_TAIL["tests/test_ops_keys_topk.py::test_triton_vs_reference_sizes[2-1031-61]"] = (
    "the interpreted kernels over 17 programs a row; the smaller sizes and every kind on 32 keys a program stay quick"
)


ENGINE_IDS = ("mooncake", "nixl")
LARGER_WORLDS = ("world3", "world4")
"""A multi-rank case at 3 or 4 ranks is slow when the same test's case at 2 ranks (the id with ``world2`` in its
place) is collected: that one stays quick, and the full suite runs every world size."""


def _two_rank_twin(nodeid: str) -> str | None:
    base, sep, params = nodeid.partition("[")
    ids = params.rstrip("]").split("-") if sep else []
    if not any(i in LARGER_WORLDS for i in ids):
        return None
    return f"{base}[{'-'.join('world2' if i in LARGER_WORLDS else i for i in ids)}]"


def _without_engine(nodeid: str) -> str:
    """``nodeid`` less the ``transfer_engine`` parameter's id (``[mooncake-a-b]`` -> ``[a-b]``): an entry of a test
    that runs once per engine names every engine's case."""
    base, sep, params = nodeid.partition("[")
    if not sep:
        return nodeid
    ids = [i for i in params.rstrip("]").split("-") if i not in ENGINE_IDS]
    return f"{base}[{'-'.join(ids)}]" if ids else base


def mark(items: list[pytest.Item], args: list[str]) -> None:
    """Mark every item :data:`LONG_TAIL` names ``slow``; raise ``pytest.UsageError`` for an entry that names no
    collected test of a collected file (when ``args``, the command line's paths, name whole files or folders)."""
    files = {item.nodeid.split("::", 1)[0] for item in items}
    ids = {item.nodeid for item in items}
    used = set()
    for item in items:
        base = item.nodeid.split("[", 1)[0]
        key = next((k for k in (item.nodeid, _without_engine(item.nodeid), base) if k in LONG_TAIL), None)
        if key is not None:
            item.add_marker(pytest.mark.slow)
            used.add(key)
        elif _two_rank_twin(item.nodeid) in ids:
            item.add_marker(pytest.mark.slow)
    stale = [k for k in LONG_TAIL if k not in used and k.split("::", 1)[0] in files]
    if stale and not any("::" in a for a in args):  # a run of chosen tests names only some
        raise pytest.UsageError(f"tests/_long_tail.py names tests that were not collected: {stale}")
