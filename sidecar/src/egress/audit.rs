//! The audit trail of egress decisions. Every decision is a [`Record`] with a sequence number
//! in a bounded spool in the sidecar's state directory (`audit.jsonl`), so a restarted sidecar
//! has what it had not delivered. The proxy reports through a [`Recorder`], which never waits:
//! what the spool has no room for is counted (`dropped`), never silent: as soon as there is
//! room again, the trail itself gets a record with the decision [`DROPPED`] that says how many
//! decisions are missing before it (a room of [`GAP_ROOM`] bytes is kept for those). The engine delivers
//! the spool through the activated owner, batch by batch, and the spool drops records only
//! when the owner acknowledges that the gateway stored them (runtime.proto, Audit).
//!
//! The file: a header line `{"next":N}` (the next sequence, so sequences never repeat, even
//! when everything was delivered), then one record per line. Records are appended as they
//! come; an acknowledgement rewrites the file with what is left (a temporary file renamed
//! over it). A torn last line (a crash while appending) is skipped when the file is read.

use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use proto::runtime::v1::AuditRecord;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::warn;

/// The spool's file in the state directory.
pub const FILE: &str = "audit.jsonl";
/// Most bytes the spool keeps: with the copy an acknowledgement writes beside it, half the
/// injected state volume (1 MiB, which the kubelet enforces by evicting the Pod).
pub const MAX_BYTES: usize = 256 * 1024;
/// Most records in one delivery.
pub const BATCH: usize = 256;
/// The decision of a record that stands for decisions the spool had no room for.
pub const DROPPED: &str = "dropped";
/// Bytes of the spool only records of [`DROPPED`] may use.
pub const GAP_ROOM: usize = 4 * 1024;
/// Records waiting for the spool's task.
const QUEUE: usize = 4096;

/// One decision as the proxy reports it; the spool gives it its sequence.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", default)]
pub struct Record {
    pub sequence: u64,
    pub at_ms: i64,
    pub decision: String,
    pub destination: String,
    pub method: String,
    pub path: String,
    pub rule: String,
    pub policy: String,
    pub revision: u64,
    pub reason: String,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub duration_ms: u64,
}

impl From<&Record> for AuditRecord {
    fn from(r: &Record) -> Self {
        AuditRecord {
            sequence: r.sequence,
            at_ms: r.at_ms,
            decision: r.decision.clone(),
            destination: r.destination.clone(),
            method: r.method.clone(),
            path: r.path.clone(),
            rule: r.rule.clone(),
            policy: r.policy.clone(),
            revision: r.revision,
            reason: r.reason.clone(),
            bytes_sent: r.bytes_sent,
            bytes_received: r.bytes_received,
            duration_ms: r.duration_ms,
        }
    }
}

/// Where decisions are reported. Never waits.
#[derive(Clone, Debug, Default)]
pub struct Recorder {
    queue: Option<mpsc::Sender<Record>>,
    dropped: Arc<AtomicU64>,
}

impl Recorder {
    pub fn record(&self, record: Record) {
        if let Some(queue) = &self.queue
            && queue.try_send(record).is_err()
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

enum Ask {
    Batch {
        after: u64,
        reply: oneshot::Sender<(Vec<AuditRecord>, u64)>,
    },
    Ack(u64),
}

/// The engine's side of the spool.
#[derive(Debug)]
pub struct Spool {
    asks: mpsc::Sender<Ask>,
    /// The highest sequence given so far (0: none).
    pub last: watch::Receiver<u64>,
}

impl Spool {
    /// The records after `after` not acknowledged yet, oldest first, at most [`BATCH`], and
    /// how many records were dropped since the sidecar started.
    pub async fn batch(&self, after: u64) -> (Vec<AuditRecord>, u64) {
        let (reply, answer) = oneshot::channel();
        if self.asks.send(Ask::Batch { after, reply }).await.is_err() {
            return (Vec::new(), 0);
        }
        answer.await.unwrap_or_default()
    }

    /// The gateway stored every record up to `through`.
    pub async fn ack(&self, through: u64) {
        let _ = self.asks.send(Ask::Ack(through)).await;
    }
}

/// Opens (or creates) the spool in `dir` and starts its task.
pub async fn open(dir: &Path) -> io::Result<(Recorder, Spool)> {
    let path = dir.join(FILE);
    let dropped = Arc::new(AtomicU64::new(0));
    let mut store = Store::load(path, dropped.clone()).await?;
    store.rewrite().await?;
    let (queue, records) = mpsc::channel(QUEUE);
    let (asks, asked) = mpsc::channel(16);
    let (last_tx, last) = watch::channel(store.next - 1);
    tokio::spawn(store.run(records, asked, last_tx));
    let recorder = Recorder {
        queue: Some(queue),
        dropped,
    };
    Ok((recorder, Spool { asks, last }))
}

#[derive(Serialize, Deserialize)]
struct Header {
    next: u64,
}

struct Store {
    path: PathBuf,
    /// Not acknowledged, oldest first, with the length of each one's line.
    pending: VecDeque<(Record, usize)>,
    bytes: usize,
    next: u64,
    dropped: Arc<AtomicU64>,
    /// Of `dropped`, how many a record of [`DROPPED`] already stands for.
    told: u64,
    file: Option<tokio::fs::File>,
}

impl Store {
    async fn load(path: PathBuf, dropped: Arc<AtomicU64>) -> io::Result<Self> {
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => String::new(),
            Err(err) => return Err(err),
        };
        let mut store = Self {
            path,
            pending: VecDeque::new(),
            bytes: 0,
            next: 1,
            dropped,
            told: 0,
            file: None,
        };
        for line in text.lines() {
            if let Ok(header) = serde_json::from_str::<Header>(line) {
                store.next = store.next.max(header.next);
            } else if let Ok(record) = serde_json::from_str::<Record>(line)
                && record.sequence >= 1
                && store
                    .pending
                    .back()
                    .is_none_or(|(last, _)| last.sequence < record.sequence)
            {
                store.next = store.next.max(record.sequence + 1);
                store.bytes += line.len() + 1;
                store.pending.push_back((record, line.len() + 1));
            }
        }
        Ok(store)
    }

    async fn run(
        mut self,
        mut records: mpsc::Receiver<Record>,
        mut asks: mpsc::Receiver<Ask>,
        last: watch::Sender<u64>,
    ) {
        loop {
            tokio::select! {
                first = records.recv() => {
                    let Some(first) = first else { return };
                    let mut batch = vec![first];
                    while batch.len() < BATCH {
                        match records.try_recv() {
                            Ok(record) => batch.push(record),
                            Err(_) => break,
                        }
                    }
                    if let Err(err) = self.append(batch).await {
                        warn!(error = %err, "cannot write the audit spool");
                    }
                    self.tell_gap().await;
                    last.send_replace(self.next - 1);
                }
                ask = asks.recv() => match ask {
                    None => return,
                    Some(Ask::Batch { after, reply }) => {
                        let _ = reply.send((self.batch(after), self.dropped.load(Ordering::Relaxed)));
                    }
                    Some(Ask::Ack(through)) => {
                        if let Err(err) = self.ack(through).await {
                            warn!(error = %err, "cannot rewrite the audit spool");
                        }
                        self.tell_gap().await;
                        last.send_replace(self.next - 1);
                    }
                },
            }
        }
    }

    /// When decisions were dropped since the last record of [`DROPPED`], records how many
    /// (not right after another: while the spool stays full, one record tells, and the next
    /// one, after room came back, tells the rest).
    async fn tell_gap(&mut self) {
        let missing = self.dropped.load(Ordering::Relaxed).saturating_sub(self.told);
        if missing == 0 || self.pending.back().is_some_and(|(last, _)| last.decision == DROPPED) {
            return;
        }
        let gap = Record {
            at_ms: proto::trust::unix_ms(std::time::SystemTime::now()),
            decision: DROPPED.to_owned(),
            reason: format!("{missing} decisions were not recorded: the audit spool was full"),
            ..Record::default()
        };
        match self.append(vec![gap]).await {
            Ok(true) => self.told += missing,
            Ok(false) => {}
            Err(err) => warn!(error = %err, "cannot write the audit spool"),
        }
    }

    /// Gives each record its sequence and appends what fits; whether any did.
    async fn append(&mut self, batch: Vec<Record>) -> io::Result<bool> {
        let mut out = Vec::new();
        for mut record in batch {
            record.sequence = self.next;
            let Ok(mut line) = serde_json::to_vec(&record) else {
                continue;
            };
            line.push(b'\n');
            let gap = record.decision == DROPPED;
            let room = if gap { MAX_BYTES } else { MAX_BYTES - GAP_ROOM };
            if self.bytes + line.len() > room {
                // A record of the gap that does not fit yet is tried again, not counted.
                if !gap {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            self.next += 1;
            self.bytes += line.len();
            self.pending.push_back((record, line.len()));
            out.extend_from_slice(&line);
        }
        if out.is_empty() {
            return Ok(false);
        }
        if self.file.is_none() {
            self.file = Some(tokio::fs::OpenOptions::new().append(true).open(&self.path).await?);
        }
        let file = self.file.as_mut().ok_or_else(|| io::Error::other("no spool file"))?;
        file.write_all(&out).await?;
        file.flush().await?;
        Ok(true)
    }

    fn batch(&self, after: u64) -> Vec<AuditRecord> {
        self.pending
            .iter()
            .filter(|(r, _)| r.sequence > after)
            .take(BATCH)
            .map(|(r, _)| AuditRecord::from(r))
            .collect()
    }

    async fn ack(&mut self, through: u64) -> io::Result<()> {
        let before = self.pending.len();
        while self.pending.front().is_some_and(|(r, _)| r.sequence <= through) {
            if let Some((_, len)) = self.pending.pop_front() {
                self.bytes -= len;
            }
        }
        if self.pending.len() == before {
            return Ok(());
        }
        self.rewrite().await
    }

    /// The header and what is pending, replacing the file at once.
    async fn rewrite(&mut self) -> io::Result<()> {
        let mut out = serde_json::to_vec(&Header { next: self.next }).map_err(io::Error::other)?;
        out.push(b'\n');
        for (record, _) in &self.pending {
            out.extend_from_slice(&serde_json::to_vec(record).map_err(io::Error::other)?);
            out.push(b'\n');
        }
        let temporary = self.path.with_extension("jsonl.tmp");
        tokio::fs::write(&temporary, &out).await?;
        tokio::fs::rename(&temporary, &self.path).await?;
        self.file = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(destination: &str) -> Record {
        Record {
            decision: "deny".into(),
            destination: destination.into(),
            ..Record::default()
        }
    }

    async fn wait_last(spool: &mut Spool, at_least: u64) {
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            spool.last.wait_for(|l| *l >= at_least),
        )
        .await
        .expect("the spool took the records")
        .expect("open");
    }

    #[tokio::test]
    async fn records_get_sequences_survive_a_restart_and_go_only_once_acknowledged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (recorder, mut spool) = open(dir.path()).await.expect("open");
        for n in 0..3 {
            recorder.record(decision(&format!("a{n}.example:443")));
        }
        wait_last(&mut spool, 3).await;
        let (batch, dropped) = spool.batch(0).await;
        assert_eq!(batch.iter().map(|r| r.sequence).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(dropped, 0);
        assert_eq!(spool.batch(2).await.0.len(), 1, "only what comes after");
        spool.ack(2).await;
        // The spool's task takes asks in order: this answer comes after the rewrite.
        assert_eq!(spool.batch(0).await.0.len(), 1);
        drop((recorder, spool));

        // A restarted sidecar: what was not acknowledged is still there, and sequences go on.
        let (recorder, spool) = open(dir.path()).await.expect("reopen");
        let (batch, _) = spool.batch(0).await;
        assert_eq!(batch.iter().map(|r| r.sequence).collect::<Vec<_>>(), [3]);
        spool.ack(3).await;
        assert!(spool.batch(0).await.0.is_empty());
        drop((recorder, spool));
        let (recorder, mut spool) = open(dir.path()).await.expect("reopen");
        assert!(spool.batch(0).await.0.is_empty(), "everything acknowledged");
        recorder.record(decision("b.example:443"));
        wait_last(&mut spool, 4).await;
        assert_eq!(spool.batch(0).await.0[0].sequence, 4, "a sequence is never given twice");
    }

    #[tokio::test]
    async fn a_torn_last_line_is_skipped_and_a_full_spool_counts_what_it_drops() {
        let dir = tempfile::tempdir().expect("tempdir");
        let line = serde_json::to_string(&Record {
            sequence: 7,
            ..decision("a.example:80")
        })
        .expect("json");
        std::fs::write(
            dir.path().join(FILE),
            format!("{{\"next\":7}}\n{line}\n{{\"sequence\":8,\"deci"),
        )
        .expect("write");
        let (recorder, mut spool) = open(dir.path()).await.expect("open");
        assert_eq!(*spool.last.borrow(), 7);
        let big = "x".repeat(8 * 1024);
        let many = MAX_BYTES / big.len() + 8;
        for _ in 0..many {
            recorder.record(Record {
                reason: big.clone(),
                ..decision("b.example:80")
            });
        }
        wait_last(&mut spool, 8).await;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let (_, dropped) = spool.batch(0).await;
            if dropped > 0 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "nothing counted as dropped");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let size = std::fs::metadata(dir.path().join(FILE)).expect("file").len();
        assert!(size as usize <= MAX_BYTES, "the spool stays bounded: {size}");

        // The trail itself says what is missing: once the spool has room again, the records
        // of DROPPED account for every dropped decision.
        let told = |batch: &[AuditRecord]| -> u64 {
            batch
                .iter()
                .filter(|r| r.decision == DROPPED)
                .map(|r| {
                    r.reason
                        .split(' ')
                        .next()
                        .and_then(|n| n.parse::<u64>().ok())
                        .expect("a count")
                })
                .sum()
        };
        let mut counted = 0;
        let mut after = 0;
        for round in 0.. {
            assert!(round < 100, "the trail never accounted for the dropped decisions");
            let (batch, dropped) = spool.batch(after).await;
            counted += told(&batch);
            if let Some(last) = batch.last() {
                after = last.sequence;
                spool.ack(after).await;
                continue;
            }
            if counted == dropped {
                break;
            }
            // Room came back with the acknowledgement; a new decision lets the rest be told.
            recorder.record(decision("c.example:80"));
            wait_last(&mut spool, after + 1).await;
        }
        assert!(counted > 0);
    }
}
