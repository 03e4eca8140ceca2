//! The store suite: every test runs on PostgreSQL and on SQLite.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../common/db.rs"]
#[macro_use]
mod support;

mod cancellation;
mod corrupt;
mod errors;
mod postgres_locks;
mod retention;
mod suite;

on_both_backends!(suite;
    first_acquire_is_term_one_and_logged,
    concurrent_contenders_never_share_a_term,
    live_lease_is_refused_to_others,
    a_dead_holders_live_lease_is_taken_over_at_once,
    renew_extends_the_same_term,
    renew_by_another_holder_is_refused,
    release_expires_at_once_and_keeps_the_term,
    expiry_without_takeover_fences_the_old_holder,
    stale_term_write_is_rejected_and_changes_nothing,
    rollback_leaves_nothing_behind,
    invalid_writes_are_refused_before_io,
    assignment_compare_and_set,
    grants_are_single_use_and_activation_is_a_compare_and_set,
    a_workload_replaced_under_its_route_starts_fresh,
    terms_never_repeat_on_a_route,
    operations_are_adopted_unchanged,
    only_ended_operations_can_be_forgotten,
    every_write_to_a_table_the_pool_view_reads_is_counted,
    pool_writes_are_notified_to_listening_replicas,
    another_replicas_write_wakes_the_pool_read,
    signing_key_rotation_is_fenced,
    members_expire_by_ttl,
    member_removal_needs_the_same_process,
    another_process_takes_a_member_name_only_once_its_live_record_is_gone,
    a_member_naming_another_members_process_gets_no_grant_nor_activates_its_term,
    a_member_that_left_keeps_an_expired_leaving_record,
    a_superseded_stream_cannot_refresh_over_the_newer_record,
    members_of_a_silent_replica_expire_unless_it_runs_or_they_moved,
    a_gateways_build_counts_while_its_replica_runs,
    operation_requests_are_idempotent_and_cancels_wait_for_the_coordinator,
    registration_assigns_generations_and_withdrawal_sticks,
    a_withdrawn_workload_revives_as_the_next_generation_only,
    a_missed_recovery_deadline_withdraws_with_the_reason_and_last_owner,
    reports_never_regress_in_term,
    a_moves_first_report_keeps_the_workloads_progress,
    migrations_are_idempotent_across_replicas,
    a_newer_builds_migrations_are_run_against_within_the_compatibility_marker,
    audit_records_are_stored_once_and_only_for_the_active_owner,
    a_store_that_lost_an_instance_takes_it_back_above_the_sidecars_fence,
    a_store_whose_schema_is_gone_says_so_and_migrates_again,
);

mod retained {
    on_both_backends!(retention;
        retired_workloads_and_withdrawn_instances_are_forgotten_after_their_retention,
        a_dump_of_the_material_holds_no_receipt_key,
    );
}

mod cancelled {
    on_both_backends!(cancellation;
        a_campaign_cancelled_inside_its_transaction_leaves_the_store_usable,
    );
}

mod corrupted {
    on_both_backends!(corrupt;
        an_unknown_value_is_a_corrupt_record_and_changes_nothing,
        a_negative_term_is_a_corrupt_record,
    );
}
