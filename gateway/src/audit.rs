//! The egress audit trail at the gateway, over plain data: the checks a delivery of sidecar
//! records passes before it is stored (`host.v1.RecordAudit`: bounded, well formed) and the
//! mapping between the wire's `runtime.v1.AuditRecord` and the store's rows, both ways.

use proto::pool::v1::AuditEntry as WireEntry;
use proto::runtime::v1::AuditRecord;

use crate::store::AuditEntry;

/// Most records in one delivery.
pub const MAX_RECORDS: usize = 256;
/// Most records one listing answers.
pub const MAX_LIST: u32 = 1000;

/// The rows to store for a delivery, or why it is refused (nothing is stored then).
pub fn rows(records: &[AuditRecord]) -> Result<Vec<AuditEntry>, String> {
    if records.is_empty() || records.len() > MAX_RECORDS {
        return Err(format!("1..{MAX_RECORDS} records per delivery"));
    }
    records
        .iter()
        .map(|r| {
            let number = |value: u64, what: &str| i64::try_from(value).map_err(|_| format!("{what} out of range"));
            let text = |value: &str, max: usize, what: &str| {
                if value.len() > max {
                    Err(format!("{what} longer than {max} bytes"))
                } else {
                    Ok(value.to_owned())
                }
            };
            if r.sequence == 0 {
                return Err("a record without a sequence".into());
            }
            Ok(AuditEntry {
                sequence: number(r.sequence, "sequence")?,
                at_ms: r.at_ms,
                decision: text(&r.decision, 32, "decision")?,
                destination: text(&r.destination, 300, "destination")?,
                method: text(&r.method, 32, "method")?,
                path: text(&r.path, 256, "path")?,
                rule: text(&r.rule, 63, "rule")?,
                policy: text(&r.policy, 253, "policy")?,
                revision: number(r.revision, "revision")?,
                reason: text(&r.reason, 256, "reason")?,
                bytes_sent: number(r.bytes_sent, "bytes_sent")?,
                bytes_received: number(r.bytes_received, "bytes_received")?,
                duration_ms: number(r.duration_ms, "duration_ms")?,
                ..AuditEntry::default()
            })
        })
        .collect()
}

/// A stored row as the operator API answers it.
pub fn entry(row: AuditEntry) -> WireEntry {
    let unsigned = |value: i64| u64::try_from(value).unwrap_or(0);
    WireEntry {
        uid: row.uid,
        member: row.member,
        term: row.term.get(),
        recorded_at_ms: row.recorded_at_ms,
        record: Some(AuditRecord {
            sequence: unsigned(row.sequence),
            at_ms: row.at_ms,
            decision: row.decision,
            destination: row.destination,
            method: row.method,
            path: row.path,
            rule: row.rule,
            policy: row.policy,
            revision: unsigned(row.revision),
            reason: row.reason,
            bytes_sent: unsigned(row.bytes_sent),
            bytes_received: unsigned(row.bytes_received),
            duration_ms: unsigned(row.duration_ms),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delivery_is_bounded_and_every_record_well_formed() {
        let record = |sequence: u64| AuditRecord {
            sequence,
            decision: "deny".into(),
            destination: "a.example:443".into(),
            ..AuditRecord::default()
        };
        assert_eq!(rows(&[record(1), record(2)]).map(|r| r.len()), Ok(2));
        assert!(rows(&[]).is_err());
        assert!(rows(&vec![record(1); MAX_RECORDS + 1]).is_err());
        assert!(rows(&[record(0)]).is_err(), "a sequence starts at 1");
        let long = AuditRecord {
            path: "/".repeat(257),
            ..record(3)
        };
        assert!(rows(&[long]).is_err());
        let huge = AuditRecord {
            bytes_sent: u64::MAX,
            ..record(4)
        };
        assert!(rows(&[huge]).is_err());
        let back = entry(rows(&[record(5)]).expect("valid").remove(0));
        assert_eq!(
            back.record.map(|r| (r.sequence, r.destination)),
            Some((5, "a.example:443".into()))
        );
    }
}
