//! Pool control over real sockets: two gateway replicas sharing one database,
//! scripted members speaking the host protocol. Every test runs on PostgreSQL
//! and on SQLite, except the paused-replica scenarios (PostgreSQL only, see `on_postgres!`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../common/db.rs"]
#[macro_use]
mod support;

mod authorization;
mod cluster;
mod declared;
mod doubles;
mod kubernetes;
mod operations;
mod scenarios;
mod startup;
mod tenancy;
mod watch;

on_both_backends!(scenarios;
    placement_spreads_and_is_stable,
    a_killed_member_stream_moves_its_instances_at_term_plus_one,
    a_stream_ended_by_its_member_removes_the_membership_at_once,
    a_member_silent_to_its_replica_keeps_its_instances_by_attaching_elsewhere,
    a_member_silent_past_the_grace_is_gone_and_its_instances_move,
    a_member_cut_off_from_every_replica_gets_its_instance_back_when_it_returns,
    a_term_the_store_forgot_is_kept_from_the_first_snapshot_of_a_stream,
    a_lost_reservation_goes_back_to_the_member_the_sidecar_names_not_to_a_claimant,
    a_stream_whose_membership_record_the_store_lost_ends_and_the_member_attaches_again,
    statuses_the_store_lost_are_written_again_with_the_next_report,
    newer_epochs_supersede_and_another_process_waits_for_the_live_one_to_end,
    a_stranger_with_a_members_token_cannot_end_its_live_stream,
    a_member_naming_another_members_process_gets_no_grant,
    reports_count_only_after_the_installing_revision_is_acked,
    only_the_coordinator_writes_assignments,
    coordinator_failover_adopts_a_recovery_without_extending_its_deadline,
    a_member_at_capacity_is_refused_with_the_reason,
    a_pod_recreated_under_its_name_is_placed_anew_and_the_old_uid_changes_nothing,
    a_withdrawn_instance_leaves_its_live_owner_at_once,
    streams_without_a_valid_token_or_identity_are_refused,
    grants_are_single_use_and_activation_checks_receipt_and_process,
    an_oversized_report_ends_the_stream_with_an_error,
    a_local_delivery_overwritten_on_disk_is_delivered_again,
);

/// A replica frozen as by SIGSTOP (see `cluster::Pausable`): PostgreSQL only.
mod paused_replica {
    on_postgres!(scenarios;
        a_restarted_member_supersedes_its_dead_predecessor_behind_a_paused_replica,
        a_member_that_dies_behind_a_paused_replica_is_recovered_by_the_others,
    );
}

/// A replica whose path to the database is cut (`testkit::fault::Path`): PostgreSQL only (SQLite
/// is a file every replica opens).
mod cut_off_replica {
    on_postgres!(scenarios;
        a_replica_cut_off_from_the_store_lets_its_members_attach_elsewhere,
    );
}

mod with_kubernetes {
    on_both_backends!(kubernetes;
        secrets_follow_labels_and_pods_decide_desired_instances,
        terminating_namespaces_get_no_writes_and_are_not_retried,
        deleted_and_relabelled_namespace_secrets_are_rewritten_at_once,
        a_member_that_leaves_gracefully_is_reported_left_on_its_pod,
        a_workload_stopped_at_its_recovery_deadline_is_reported_on_its_pod,
        an_instance_registered_without_members_is_reported_unplaceable,
        a_pod_acts_only_for_itself_within_its_namespace_quota,
        the_pool_status_is_kept_by_the_coordinator_alone,
        finished_and_unsupervised_pods_are_told_apart_from_supervised_ones,
        the_supervised_condition_follows_each_pod,
        each_owned_pod_carries_its_sandbox_policy_in_the_snapshots,
        egress_denials_become_warning_events_on_the_pod,
    );
}

mod with_declared_operations {
    on_both_backends!(declared;
        a_declared_drain_runs_once_and_deleting_its_object_cancels_it,
    );
}

mod with_authorization {
    on_both_backends!(authorization;
        every_rpc_refuses_every_caller_but_the_right_one,
    );
}

mod with_tenancy {
    on_both_backends!(tenancy;
        instance_credentials_act_only_on_their_own_route_and_workload,
        claims_of_where_an_instance_stands_are_bounded,
        a_namespace_quota_refuses_beyond_its_limit_and_stores_nothing,
    );
}

mod with_operations {
    on_both_backends!(operations;
        drain_and_rebalance_move_instances_at_term_plus_one,
        a_dry_run_lists_the_moves_a_drain_then_makes_and_writes_nothing,
        the_status_names_every_live_build_and_what_is_outside_the_policy,
    );
}

mod with_watch {
    on_both_backends!(watch;
        a_watch_streams_changes_and_wait_follows_an_operation_to_its_end,
    );
}
