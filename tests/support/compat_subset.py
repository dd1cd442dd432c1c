"""The compatibility subset: the tests marked ``compat`` (``pytest -m compat``), which ``.ci/run``
runs on the oldest and the newest supported Python and torch (CONTRIBUTING.md, "Tests").

Each part of opwatch (a module of ``checks/``, ``modes/``, ``runners/``, ``runners/guarded/``,
and the public modes) names the tests that exercise it: a test file under ``tests/``, or one
test of it as ``file::name`` (every parametrization of it). ``tests/unit/test_compat_subset.py``
fails on a part with no entry or an entry that names nothing, so a new check, mode or runner
comes with its compat test."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
PACKAGE = TESTS.parent / "opwatch"

# The folders whose every module is a check, a mode or a runner (infrastructure modules too:
# they run in every test of their folder, and an entry says which).
PARTS_FOLDERS = ("checks", "modes", "runners", "runners/guarded")

COMPILED, DIFF, DISTRIBUTED = "runners/test_compiled.py", "runners/test_diff.py", "runners/test_distributed.py"
GUARD, INTEGRATIONS, LEAVE_ON = "runners/test_guard.py", "runners/test_integrations.py", "runners/test_leave_on.py"

COMPAT: dict[str, tuple[str, ...]] = {
    # the public modes
    "watch": ("e2e/test_checks_e2e.py", "e2e/test_options.py", "e2e/test_exceptions.py"),
    "strict": ("e2e/test_checks_e2e.py",),
    "guard": (f"{GUARD}::test_a_healthy_step_runs_with_no_dispatch_mode_and_returns_what_the_step_returns",
              f"{GUARD}::test_backward_nan_is_named_at_its_forward_line"),
    "leave_on": (f"{LEAVE_ON}::test_strict_raises_before_the_optimizer_writes_a_backward_nan_into_the_weights",
                 f"{LEAVE_ON}::test_guard_cli_names_the_step_the_parameters_and_the_origin_of_a_nan_first_made_at_step_k"),
    # checks/
    "checks/accumulation": ("e2e/test_accumulation_dtypes.py",),
    "checks/broadcast": ("e2e/test_broadcast_use.py",),
    "checks/collectives": (f"{DISTRIBUTED}::test_collective_mismatch_check", f"{DISTRIBUTED}::test_collective_mismatch_compares_plain_data",
                           f"{DISTRIBUTED}::test_functional_collectives_raise_no_false_alarm"),
    "checks/device": ("e2e/test_cpu_scalars.py", "e2e/test_dtype_device_rules.py"),
    "checks/dtype": ("e2e/test_dtype_device_rules.py",),
    "checks/finding": ("unit/test_checks_unit.py",),
    "checks/fingerprints": (f"{DIFF}::test_fingerprints_survive_the_jsonl_round_trip", f"{DIFF}::test_the_hash_tells_simple_changes_apart"),
    "checks/module_calls": ("e2e/test_dtype_device_rules.py",),
    "checks/owners": ("e2e/test_finding_path.py",),
    "checks/provenance": ("e2e/test_finding_path.py", "e2e/test_attribution.py"),
    "checks/nonfinite": ("e2e/test_nonfinite_inplace.py", "unit/test_nonfinite_replay.py", "e2e/test_mask_windows.py",
                         "e2e/test_training_numerics.py::test_gradscaler_overflow_that_reaches_the_parameters_is_an_anomaly"),
    "checks/pipeline": ("e2e/test_checks_e2e.py",),
    "checks/pre_dispatch": ("e2e/test_pre_dispatch.py",),
    "checks/promotions": ("e2e/test_promotions.py",),
    # modes/
    "modes/compiled": (f"{COMPILED}::test_a_compiled_module_runs_its_compiled_code_again_after_a_watch_without_recompiling",
                       f"{COMPILED}::test_inductor_code_comes_back_after_a_watch_and_guard_audits",
                       f"{COMPILED}::test_a_plain_dispatch_mode_drops_the_compiled_code_for_good_and_a_watch_does_not"),
    "modes/compiled_returns": (f"{COMPILED}::test_leave_on_over_a_compiled_optimizer_step_audits_it_and_leaves_the_rest_compiled",
                               f"{COMPILED}::test_leave_on_over_a_compiled_optimizer_step_names_the_bad_batch_and_skips_its_step",
                               f"{COMPILED}::test_a_watch_ended_inside_a_compiled_call_keeps_the_programs_profile_function"),
    "modes/compiled_graphs": ("runners/test_diff_compiled.py::test_a_miscompiled_node_is_named_at_its_line",),
    "modes/functions": ("e2e/test_pre_dispatch.py",),
    "modes/interceptor": ("e2e/test_tensor_kinds.py", "e2e/test_neighbouring_modes.py", "e2e/test_autograd_features.py"),
    "modes/modules": ("e2e/test_attribution.py",),
    "modes/module_calls": ("e2e/test_dtype_device_rules.py",),
    "modes/ranks": (f"{DISTRIBUTED}::test_collective_mismatch_check",),
    "modes/torch_warnings": ("e2e/test_torch_warnings.py",),
    "modes/reducer": (f"{DISTRIBUTED}::test_ddp_reducer_ops_are_backward_and_named",),
    # runners/
    "runners/batches": ("e2e/test_kept_batches.py::test_left_on_a_bad_micro_batch_is_named_with_its_call_in_the_step",),
    "runners/cli": ("runners/test_cli.py::test_an_op_error_keeps_the_traceback_and_gets_opwatchs_note",
                    "runners/test_cli.py::test_sys_exit_status_and_message"),
    "runners/cli_diff": (f"{DIFF}::test_the_cli_dispatches_diff",),
    "runners/cli_report": ("runners/test_report_html.py::test_the_command_line_writes_the_report_and_names_it",
                           "runners/test_report_html.py::test_the_report_in_chromium_offline"),
    "runners/cli_trace": ("runners/test_export.py",),
    "runners/divergence": (f"{DIFF}::test_unseeded_dropout_is_named_at_its_line",),
    "runners/divergence_align": (f"{DIFF}::test_an_op_inserted_in_one_run_is_reported_and_the_alignment_goes_on",),
    "runners/divergence_compiled": ("runners/test_diff_compiled.py::test_after_the_watch_compiled_code_and_plain_watches_are_as_before",),
    "runners/divergence_layouts": ("runners/test_diff_layouts.py::test_shards_combine_by_their_placement",),
    "runners/ledger": ("runners/test_run_ledger.py::test_cli_guard_a_one_batch_glitch_is_not_a_stuck_run_and_its_batch_is_named",
                       "runners/test_run_ledger.py::test_max_failed_steps_needs_guard_and_the_keyword_is_checked"),
    "runners/leave_on": (f"{LEAVE_ON}::test_watch_reports_at_the_optimizer_step_and_the_step_runs",),
    "runners/lightning": (f"{INTEGRATIONS}::test_lightning_fit", f"{LEAVE_ON}::test_lightning_guard_replays_the_failing_batch_names_its_origin_and_skips_its_step"),
    "runners/pytest_plugin": ("runners/test_pytest_plugin.py::test_a_test_that_leaves_anomalies_fails_with_the_summary",),
    "modes/saved_tensors": ("e2e/test_overwritten_saves.py::test_a_gan_that_reuses_the_discriminator_s_output_after_its_step_names_the_step",),
    "runners/policy": ("runners/test_step_policy.py::test_the_verdict_seam_answers_finite_and_which_parameters_are_bad",
                       "runners/test_step_policy.py::test_the_policy_stops_a_stuck_run_and_names_its_first_failure",
                       "runners/test_step_policy.py::test_guard_names_weights_the_program_wrote",
                       "runners/test_step_policy.py::test_an_inf_the_optimizer_step_makes_is_labelled_optimizer_not_forward",
                       "runners/test_step_policy.py::test_guards_that_come_and_go_leave_torchs_optimizer_hooks_as_the_first_one_left_them"),
    "runners/step_verdict": ("runners/test_step_verdict.py::test_leave_on_over_a_clipping_loop_touches_at_most_one_percent_of_the_gradients",
                             "runners/test_step_verdict.py::test_a_fused_optimizer_gets_the_verdict_as_found_inf_and_skips_the_failing_step_on_the_device"),
    "runners/tensorboard": ("runners/test_tensorboard.py::test_log_counts_into_a_summary_writer",
                            "runners/test_tensorboard.py::test_cli_guard_writes_steps_audits_and_failures"),
    "runners/trainers": (f"{INTEGRATIONS}::test_frameworks_are_imported_only_when_used",),
    "runners/transformers": (f"{INTEGRATIONS}::test_transformers_train", f"{LEAVE_ON}::test_transformers_guard_audit_reports_the_broadcast_once"),
    # runners/guarded/
    "runners/guarded/audit": ("runners/test_guard_audits.py::test_a_broadcast_in_the_loss_is_reported_by_the_first_calls_audit_and_warned_once",),
    "runners/guarded/check": (f"{GUARD}::test_the_only_ops_added_on_a_healthy_step_are_the_finiteness_check",),
    "runners/guarded/compiled": (f"{COMPILED}::test_a_miscompiled_step_whose_eager_replay_is_finite_is_blamed_on_the_compiler_and_its_stage",),
    "runners/guarded/graph_repro": ("runners/test_compiled_narrowing.py::test_a_miscompiled_softmax_is_narrowed_to_its_node_and_line_with_a_repro_that_reproduces",),
    "runners/guarded/narrow": ("runners/test_compiled_narrowing.py::test_the_message_names_the_node_its_line_and_both_values",),
    "runners/guarded/ranks": ("runners/test_guard_distributed.py::test_the_ranks_line_names_the_origin_and_the_ranks_that_did_not_report",),
    "runners/written_buffers": ("runners/test_leave_on_buffers.py::test_a_skipped_bad_batch_leaves_batchnorm_as_a_run_that_never_saw_it",),
    "runners/evaluations": ("runners/test_leave_on_evaluations.py::test_a_bad_validation_batch_is_not_the_failing_training_step_s_batch",),
    "runners/guarded/scaler": ("runners/test_guard_grad_scaler.py",),
    "runners/guarded/replay": (f"{GUARD}::test_forward_inf_is_replayed_and_named_with_the_model_as_one_run_left_it",),
    "runners/guarded/repro": (f"{GUARD}::test_the_repro_reruns_the_origin_op_alone_in_a_subprocess",),
    "runners/guarded/snapshot": (f"{GUARD}::test_skip_undoes_the_step_warns_once_and_goes_on", f"{GUARD}::test_a_failing_step_drops_the_gradients_it_accumulated_onto_and_its_replay_starts_from_zero"),
    # what every part leans on: the written rules, rendering, records
    "rules": ("unit/test_rules.py", "unit/test_rendering.py", "unit/test_records.py", "unit/test_compat_subset.py"),
}


def parts() -> list[str]:
    """Every check, mode and runner: the modules (and packages) of ``PARTS_FOLDERS``, as
    ``folder/name``."""
    found = []
    for folder in PARTS_FOLDERS:
        for path in sorted((PACKAGE / folder).iterdir()):
            name = path.stem if path.suffix == ".py" else path.name if (path / "__init__.py").exists() else None
            if name is None or name.startswith("_") or f"{folder}/{name}" in PARTS_FOLDERS:
                continue
            found.append(f"{folder}/{name}")
    return found


def selectors() -> set[str]:
    """The node-id prefixes of the compat tests: ``tests/<file>`` or ``tests/<file>::<name>``."""
    return {f"tests/{entry}" for entries in COMPAT.values() for entry in entries}


def is_compat(nodeid: str, chosen: set[str]) -> bool:
    """Whether the test ``nodeid`` (relative to the repository) is in the subset ``chosen``."""
    path, _, rest = nodeid.partition("::")
    name = rest.partition("[")[0]
    return path in chosen or f"{path}::{name}" in chosen
