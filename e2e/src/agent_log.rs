//! What the sample agent observed, read back from its log: its PID and every
//! progress report its owner accepted (value, time, and — when the sidecar
//! says — the answering owner's term). Pure parsing and arithmetic.

/// One accepted progress report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub value: u64,
    pub at_ms: u64,
    /// The ownership term that answered, when the answer named it.
    pub term: Option<u64>,
}

/// An agent's log, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    pub pid: Option<u32>,
    pub accepted: Vec<Accepted>,
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
}

pub fn parse(log: &str) -> Observed {
    let mut observed = Observed::default();
    for line in log.lines() {
        if line.starts_with("agent ") {
            observed.pid = field(line, "pid").and_then(|p| p.parse().ok());
        } else if line.starts_with("accepted ") {
            let value = field(line, "value").and_then(|v| v.parse().ok());
            let at_ms = field(line, "at_ms").and_then(|v| v.parse().ok());
            if let (Some(value), Some(at_ms)) = (value, at_ms) {
                let term = field(line, "term").and_then(|v| v.parse().ok());
                observed.accepted.push(Accepted { value, at_ms, term });
            }
        }
    }
    observed
}

impl Observed {
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
        accepted value=40 at_ms=3000 term=2\n\
        accepted value=41 at_ms=3050 term=1\n";

    #[test]
    fn reads_pid_gaps_continuity_and_owners() {
        let observed = parse(LOG);
        assert_eq!(observed.pid, Some(4242));
        assert_eq!(observed.accepted.len(), 4);
        assert_eq!(observed.max_gap_ms(0, 10_000), 1950);
        assert_eq!(
            observed.max_gap_ms(3040, 10_000),
            50,
            "only gaps overlapping the window"
        );
        assert!(observed.continuous());
        assert_eq!(observed.dual_owner_violations(), 1, "term 1 answered after term 2");
        let reset = parse("accepted value=5 at_ms=1\naccepted value=1 at_ms=2\n");
        assert!(!reset.continuous());
    }
}
