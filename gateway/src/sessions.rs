//! One session per member: which hello may open a stream, and which stream it
//! supersedes. Pure bookkeeping of one replica, after the store admitted the hello
//! (`Store::record_member`: another process of a member only once the record of its live
//! one is gone); across replicas a stream also ends when the membership record names a
//! newer process or epoch ([`check_record`]).

use std::collections::HashMap;

use crate::store::MemberRecord;

/// The stream a member currently has on this replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Current {
    pub process_id: String,
    pub epoch: u64,
    pub stream: u64,
}

/// Why a stream was superseded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Superseded {
    /// A newer connection epoch of the same process.
    NewerEpoch,
    /// A new process of the same member, admitted once the old one's record was gone.
    NewerProcess,
}

/// What a stream concludes from its member's record (as read from the store).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordCheck {
    /// Nothing: the record is this stream's, or the read may predate its admission.
    Current,
    /// A newer stream of the member was admitted after this one.
    Superseded(Superseded),
    /// This stream's record was expired or removed after its admission: the member must
    /// attach again to count as live (it is not told another process took its name).
    Lapsed,
}

/// Judge the member's `record`, read at database time `now_ms`, for the stream of
/// `process_id` at `epoch`. Only a read made after this stream's own record was written
/// (`read_after_admission`) says anything: an earlier read still shows whatever the
/// admission replaced, typically the record of a dead predecessor that nobody removed
/// (its replica paused or cut off), which is older, never newer. Every admission writes
/// the record, and a stream only refreshes its own, so in a later read a record of
/// another process, or of a newer epoch, can only come from a newer admission — and one of
/// an older epoch of this process only from a store that lost this stream's record.
pub fn check_record(
    process_id: &str,
    epoch: i64,
    record: Option<&MemberRecord>,
    now_ms: i64,
    read_after_admission: bool,
) -> RecordCheck {
    if !read_after_admission {
        return RecordCheck::Current;
    }
    match record {
        None => RecordCheck::Lapsed,
        Some(r) if r.process_id != process_id => RecordCheck::Superseded(Superseded::NewerProcess),
        Some(r) if r.epoch > epoch => RecordCheck::Superseded(Superseded::NewerEpoch),
        Some(r) if r.epoch == epoch && !r.is_live(now_ms) => RecordCheck::Lapsed,
        // An older epoch of this process after the admission: the store rolled back and lost
        // this stream's record (lost commits, an older backup), and nothing would refresh it.
        Some(r) if r.epoch < epoch => RecordCheck::Lapsed,
        Some(_) => RecordCheck::Current,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Open stream `stream`; `supersedes` is the stream it replaces, if any.
    Admitted {
        stream: u64,
        supersedes: Option<(u64, Superseded)>,
    },
    /// A delayed older hello: refuse it (FAILED_PRECONDITION).
    Refused(String),
}

#[derive(Debug, Default)]
pub struct Sessions {
    current: HashMap<String, Current>,
    next_stream: u64,
}

impl Sessions {
    /// Open a stream for a hello the store admitted: it supersedes the member's current
    /// stream on this replica (a stream of another process: its record was gone), unless it
    /// is a delayed older hello of the current process.
    pub fn admit(&mut self, member: &str, process_id: &str, epoch: u64) -> Admission {
        let supersedes = match self.current.get(member) {
            Some(c) if c.process_id == process_id && epoch <= c.epoch => {
                return Admission::Refused(format!(
                    "connection epoch {epoch} of member {member} is not newer than the current epoch {}",
                    c.epoch
                ));
            }
            Some(c) if c.process_id == process_id => Some((c.stream, Superseded::NewerEpoch)),
            Some(c) => Some((c.stream, Superseded::NewerProcess)),
            None => None,
        };
        self.next_stream += 1;
        let stream = self.next_stream;
        let current = Current {
            process_id: process_id.to_owned(),
            epoch,
            stream,
        };
        self.current.insert(member.to_owned(), current);
        Admission::Admitted { stream, supersedes }
    }

    /// A stream ended: forget it if it is still the member's current one.
    pub fn end(&mut self, member: &str, stream: u64) -> bool {
        if self.current.get(member).is_some_and(|c| c.stream == stream) {
            self.current.remove(member);
            return true;
        }
        false
    }

    pub fn current(&self, member: &str) -> Option<&Current> {
        self.current.get(member)
    }

    pub fn len(&self) -> usize {
        self.current.len()
    }

    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(a: Admission) -> (u64, Option<(u64, Superseded)>) {
        match a {
            Admission::Admitted { stream, supersedes } => (stream, supersedes),
            Admission::Refused(why) => panic!("refused: {why}"),
        }
    }

    #[test]
    fn newer_epoch_supersedes_and_older_is_refused() {
        let mut s = Sessions::default();
        let (first, none) = admitted(s.admit("m", "p1", 1));
        assert_eq!(none, None);
        let (second, superseded) = admitted(s.admit("m", "p1", 2));
        assert_eq!(superseded, Some((first, Superseded::NewerEpoch)));
        assert!(
            matches!(s.admit("m", "p1", 2), Admission::Refused(_)),
            "same epoch again"
        );
        assert!(matches!(s.admit("m", "p1", 1), Admission::Refused(why) if why.contains("not newer")));
        assert_eq!(s.current("m").map(|c| c.stream), Some(second));
    }

    #[test]
    fn a_new_process_the_store_admitted_supersedes_and_nothing_is_kept_of_the_old_one() {
        let mut s = Sessions::default();
        let (first, _) = admitted(s.admit("m", "p1", 5));
        let (second, superseded) = admitted(s.admit("m", "p2", 1));
        assert_eq!(superseded, Some((first, Superseded::NewerProcess)));
        // Whether p1 may come back is the store's decision (p2's record gone), not a set
        // of retired processes that grows with every restart.
        assert_eq!(
            admitted(s.admit("m", "p1", 6)).1,
            Some((second, Superseded::NewerProcess))
        );
        assert_eq!(s.len(), 1);
        // Other members are independent.
        assert_eq!(admitted(s.admit("n", "p1", 1)).1, None);
    }

    fn record(process_id: &str, epoch: i64, expires_at_ms: i64) -> MemberRecord {
        MemberRecord {
            member: "m".into(),
            process_id: process_id.into(),
            epoch,
            runtime_address: String::new(),
            capacity: 1,
            served_by: "gw".into(),
            leaving: false,
            expires_at_ms,
            updated_at_ms: 0,
        }
    }

    #[test]
    fn a_read_from_before_the_admission_never_supersedes() {
        // The live record of a dead predecessor, still in a view read before this stream's
        // own record was written: nothing to conclude.
        let predecessor = record("p1", 7, 20_000);
        assert_eq!(
            check_record("p2", 1, Some(&predecessor), 10_000, false),
            RecordCheck::Current
        );
        // Read after the admission, another process's record is a newer admission.
        assert_eq!(
            check_record("p2", 1, Some(&predecessor), 10_000, true),
            RecordCheck::Superseded(Superseded::NewerProcess)
        );
    }

    #[test]
    fn records_read_after_the_admission() {
        let check = |r: Option<&MemberRecord>| check_record("p1", 2, r, 10_000, true);
        assert_eq!(check(Some(&record("p1", 2, 20_000))), RecordCheck::Current);
        assert_eq!(
            check(Some(&record("p1", 3, 20_000))),
            RecordCheck::Superseded(Superseded::NewerEpoch)
        );
        assert_eq!(check(Some(&record("p1", 2, 10_000))), RecordCheck::Lapsed, "expired");
        assert_eq!(check(None), RecordCheck::Lapsed, "removed");
        assert_eq!(
            check(Some(&record("p1", 1, 20_000))),
            RecordCheck::Lapsed,
            "the store rolled back to an older stream's record"
        );
        // A newer process's record supersedes even once it expired.
        assert_eq!(
            check(Some(&record("p9", 1, 0))),
            RecordCheck::Superseded(Superseded::NewerProcess)
        );
    }

    #[test]
    fn ending_a_superseded_stream_keeps_the_current_one() {
        let mut s = Sessions::default();
        let (old, _) = admitted(s.admit("m", "p1", 1));
        let (new, _) = admitted(s.admit("m", "p1", 2));
        assert!(!s.end("m", old));
        assert_eq!(s.len(), 1);
        assert!(s.end("m", new));
        assert!(s.is_empty());
        // After a clean end, the next epoch is admitted normally.
        assert_eq!(admitted(s.admit("m", "p1", 3)).1, None);
    }
}
