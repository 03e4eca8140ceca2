//! The proxy's most recent denials, kept for the workload to read (`{"op":"policy"}`).

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;

/// Denials kept.
pub const KEPT: usize = 32;

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Denial {
    pub at_ms: i64,
    pub destination: String,
    /// Plain HTTP only (empty for a tunnel).
    pub method: String,
    pub path: String,
    pub reason: String,
    /// The policy revision in force (empty name: none installed).
    pub policy: String,
    pub revision: u64,
}

/// The last [`KEPT`] denials, oldest first.
#[derive(Debug, Default)]
pub struct Recent {
    denials: Mutex<VecDeque<Denial>>,
}

impl Recent {
    pub fn record(&self, denial: Denial) {
        if let Ok(mut denials) = self.denials.lock() {
            if denials.len() == KEPT {
                denials.pop_front();
            }
            denials.push_back(denial);
        }
    }

    pub fn list(&self) -> Vec<Denial> {
        self.denials
            .lock()
            .map(|d| d.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_ones_oldest_first() {
        let recent = Recent::default();
        for at_ms in 0..(KEPT as i64 + 5) {
            recent.record(Denial {
                at_ms,
                destination: "a:1".into(),
                method: String::new(),
                path: String::new(),
                reason: "no rule".into(),
                policy: "p".into(),
                revision: 1,
            });
        }
        let kept: Vec<i64> = recent.list().iter().map(|d| d.at_ms).collect();
        assert_eq!(kept, (5..(KEPT as i64 + 5)).collect::<Vec<_>>());
    }
}
