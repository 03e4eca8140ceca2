//! What the sample agent observed, read back from its log: its PID and every
//! progress report its owner accepted (value, time, and — when the sidecar
//! says — the answering owner's term). Pure parsing and arithmetic.

/// One accepted progress report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub value: u64,
    pub at_ms: u64,
    /// The ownership term that answered, when the answer named it.
    pub term: Option<u64>,
    /// The member that answered, when the answer named it.
    pub member: Option<String>,
}

/// An agent's log, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    pub pid: Option<u32>,
    pub accepted: Vec<Accepted>,
    /// Answers that were not `ok` (held requests refused while the sidecar stops, …).
    pub refused: Vec<(u64, String)>,
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
}

pub fn parse(log: &str) -> Observed {
    let mut observed = Observed::default();
    for line in log.lines() {
        observed.feed(line);
    }
    observed
}

/// An agent's log read as it grows: each `poll` parses only the lines added since the last.
#[derive(Debug)]
pub struct Follower {
    path: std::path::PathBuf,
    offset: u64,
    partial: String,
    pub observed: Observed,
}

impl Follower {
    pub fn new(path: std::path::PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            partial: String::new(),
            observed: Observed::default(),
        }
    }

    /// Parse what was appended since the last poll (a missing file is an empty log).
    pub async fn poll(&mut self) -> &Observed {
        use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
        let Ok(mut file) = tokio::fs::File::open(&self.path).await else {
            return &self.observed;
        };
        let mut added = Vec::new();
        if file.seek(std::io::SeekFrom::Start(self.offset)).await.is_ok() && file.read_to_end(&mut added).await.is_ok()
        {
            self.offset += added.len() as u64;
            self.partial.push_str(&String::from_utf8_lossy(&added));
            if let Some(end) = self.partial.rfind('\n') {
                let complete: String = self.partial.drain(..=end).collect();
                for line in complete.lines() {
                    self.observed.feed(line);
                }
            }
        }
        &self.observed
    }
}

impl Observed {
    /// One line of the agent's output.
    pub fn feed(&mut self, line: &str) {
        if line.starts_with("agent ") {
            self.pid = field(line, "pid").and_then(|p| p.parse().ok());
        } else if line.starts_with("accepted ") {
            let value = field(line, "value").and_then(|v| v.parse().ok());
            let at_ms = field(line, "at_ms").and_then(|v| v.parse().ok());
            if let (Some(value), Some(at_ms)) = (value, at_ms) {
                let term = field(line, "term").and_then(|v| v.parse().ok());
                let member = field(line, "member").map(str::to_owned);
                self.accepted.push(Accepted {
                    value,
                    at_ms,
                    term,
                    member,
                });
            }
        } else if line.starts_with("refused ") {
            let at_ms = field(line, "at_ms").and_then(|v| v.parse().ok()).unwrap_or(0);
            let answer = line.split_once("answer=").map_or("", |(_, a)| a);
            self.refused.push((at_ms, answer.to_owned()));
        }
    }

    /// The longest time between two consecutive accepted reports whose
    /// interval overlaps `[from_ms, to_ms]`.
    pub fn max_gap_ms(&self, from_ms: u64, to_ms: u64) -> u64 {
        self.accepted
            .windows(2)
            .filter(|w| w[1].at_ms >= from_ms && w[0].at_ms <= to_ms)
            .map(|w| w[1].at_ms.saturating_sub(w[0].at_ms))
            .max()
            .unwrap_or(0)
    }

    /// Answers that were not `ok` in `[from_ms, to_ms]`.
    pub fn refused_between(&self, from_ms: u64, to_ms: u64) -> u64 {
        self.refused
            .iter()
            .filter(|(at, _)| (from_ms..=to_ms).contains(at))
            .count() as u64
    }

    /// The counter never went backwards (it lives in the agent's memory, so
    /// a restarted agent would start again from zero).
    pub fn continuous(&self) -> bool {
        self.accepted.windows(2).all(|w| w[1].value >= w[0].value)
    }

    /// Answers from a term lower than one that already answered: a second
    /// owner speaking after the first was fenced.
    pub fn dual_owner_violations(&self) -> u64 {
        let mut highest = 0;
        let mut violations = 0;
        for term in self.accepted.iter().filter_map(|a| a.term) {
            if term < highest {
                violations += 1;
            }
            highest = highest.max(term);
        }
        violations
    }

    /// Terms answered by more than one member: `(term, members)`. A term names one
    /// grant to one member; two members answering under it would be two owners.
    pub fn terms_with_two_members(&self) -> Vec<(u64, Vec<String>)> {
        let mut by_term: std::collections::BTreeMap<u64, std::collections::BTreeSet<&str>> =
            std::collections::BTreeMap::new();
        for a in &self.accepted {
            if let (Some(term), Some(member)) = (a.term, a.member.as_deref()) {
                by_term.entry(term).or_default().insert(member);
            }
        }
        by_term
            .into_iter()
            .filter(|(_, members)| members.len() > 1)
            .map(|(term, members)| (term, members.into_iter().map(str::to_owned).collect()))
            .collect()
    }

    /// The first accepted report at or after `from_ms`.
    pub fn first_at_or_after(&self, from_ms: u64) -> Option<u64> {
        self.accepted.iter().map(|a| a.at_ms).find(|at| *at >= from_ms)
    }

    pub fn last_at_ms(&self) -> u64 {
        self.accepted.last().map_or(0, |a| a.at_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "agent pid=4242 socket=/tmp/s\n\
        accepted value=1 at_ms=1000 term=1\n\
        accepted value=2 at_ms=1050 term=1\n\
        refused value=3 at_ms=1100 answer={}\n\
        accepted value=40 at_ms=3000 term=2 member=b\n\
        accepted value=41 at_ms=3050 term=1\n\
        accepted value=42 at_ms=3100 term=2 member=c\n";

    #[test]
    fn reads_pid_gaps_continuity_and_owners() {
        let observed = parse(LOG);
        assert_eq!(observed.pid, Some(4242));
        assert_eq!(observed.accepted.len(), 5);
        assert_eq!(observed.refused.len(), 1);
        assert_eq!(observed.max_gap_ms(0, 10_000), 1950);
        assert_eq!(
            observed.max_gap_ms(3040, 10_000),
            50,
            "only gaps overlapping the window"
        );
        assert!(observed.continuous());
        assert_eq!(observed.dual_owner_violations(), 1, "term 1 answered after term 2");
        assert_eq!(
            observed.terms_with_two_members(),
            vec![(2, vec!["b".to_owned(), "c".to_owned()])],
            "term 2 answered by b and by c"
        );
        assert_eq!(observed.first_at_or_after(1051), Some(3000));
        let reset = parse("accepted value=5 at_ms=1\naccepted value=1 at_ms=2\n");
        assert!(!reset.continuous());
    }

    #[tokio::test]
    async fn a_follower_parses_only_complete_new_lines() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.log");
        let mut follower = Follower::new(path.clone());
        assert_eq!(follower.poll().await.accepted.len(), 0, "no file yet");
        let mut file = std::fs::File::create(&path).unwrap();
        write!(
            file,
            "agent pid=7 socket=s\naccepted value=1 at_ms=10 term=1 member=a\naccepted val"
        )
        .unwrap();
        assert_eq!(follower.poll().await.accepted.len(), 1, "the half line waits");
        writeln!(file, "ue=2 at_ms=20 term=1 member=a").unwrap();
        let observed = follower.poll().await;
        assert_eq!(observed.pid, Some(7));
        assert_eq!(observed.accepted.len(), 2);
        assert_eq!(observed.accepted[1].value, 2);
        assert_eq!(follower.poll().await.accepted.len(), 2, "nothing parsed twice");
    }
}
