//! The persisted state: the fence, the receipt key, the instance's generation and the pinned
//! workload identity, as one JSON file in the state directory. Written atomically (temporary
//! file, fsync, rename, fsync of the directory) BEFORE anything that depends on it is sent,
//! so a restarted sidecar never accepts what it already fenced. Contains the receipt key:
//! mode 0600, never logged (`Debug` redacts the key).

use std::fs;
use std::io::Read;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::codec::Identity;
use crate::fence::Fence;
use crate::receipt::ReceiptKey;

pub const STATE_FILE: &str = "fence.json";
/// Largest state file read.
pub const MAX_STATE_BYTES: u64 = 64 * 1024;
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot {action} the fence state {path}: {source}")]
    Io {
        action: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the fence state {0} is corrupt or of another version; refusing to start without it")]
    Corrupt(String),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub v: u32,
    pub route: String,
    pub uid: String,
    /// Registry-assigned generation, 0 until the first registration.
    pub generation: u64,
    pub receipt_key: ReceiptKey,
    pub fence: Fence,
    /// The workload process the sidecar is pinned to.
    pub workload: Option<Identity>,
    /// Wall-clock deadline (Unix ms) of the running recovery episode: a restart does not
    /// extend it.
    pub recovery_deadline_at_ms: Option<i64>,
    /// Set once the instance ended (released, exited, recovery failed): nothing more to do
    /// for this generation.
    pub ended: Option<String>,
    /// With `ended`: the workload's container runs again, and the next run supervises its next
    /// process. Without: that next generation is being registered (`generation + 1` is asked
    /// for until the registry has assigned it).
    #[serde(default)]
    pub next_generation: bool,
    /// When it ended, in clock ticks since boot (the unit of `/proc/<pid>/stat`): a process
    /// started after it is the workload's next one.
    #[serde(default)]
    pub ended_at_ticks: u64,
    /// The egress policy revision the activated owner installed last (none: every destination
    /// is denied). Kept across owners and generations: decisions never wait for an owner.
    #[serde(default)]
    pub policy: Option<crate::egress::Policy>,
}

impl State {
    /// Fresh state with a new receipt key.
    pub fn new(route: &str, uid: &str) -> Self {
        Self {
            v: VERSION,
            route: route.to_owned(),
            uid: uid.to_owned(),
            generation: 0,
            receipt_key: ReceiptKey::generate(),
            fence: Fence::default(),
            workload: None,
            recovery_deadline_at_ms: None,
            ended: None,
            next_generation: false,
            ended_at_ticks: 0,
            policy: None,
        }
    }

    /// The state for the next generation of the same Pod, after this one ended (its workload
    /// container restarts): a new receipt key, no pinned workload, no recovery in progress.
    /// The fence starts over once the registry assigns the generation, as for any new one.
    pub fn next_generation(self) -> Self {
        Self {
            receipt_key: ReceiptKey::generate(),
            workload: None,
            recovery_deadline_at_ms: None,
            ended: None,
            next_generation: true,
            ..self
        }
    }

    /// The generation to register: the persisted one, or the next once this one ended.
    pub fn registering(&self) -> u64 {
        if self.next_generation {
            self.generation + 1
        } else {
            self.generation
        }
    }
}

#[derive(Debug, Clone)]
pub struct StateFile {
    dir: PathBuf,
    path: PathBuf,
}

impl StateFile {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            path: dir.join(STATE_FILE),
        }
    }

    pub fn load(&self) -> Result<Option<State>, Error> {
        let file = match fs::File::open(&self.path) {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(self.io("read", source)),
        };
        let mut bytes = Vec::new();
        file.take(MAX_STATE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| self.io("read", source))?;
        match serde_json::from_slice::<State>(&bytes) {
            Ok(state) if state.v == VERSION && bytes.len() as u64 <= MAX_STATE_BYTES => Ok(Some(state)),
            _ => Err(Error::Corrupt(self.path.display().to_string())),
        }
    }

    pub fn save(&self, state: &State) -> Result<(), Error> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|source| self.io("create the directory of", source))?;
        let bytes = serde_json::to_vec(state).map_err(|e| self.io("encode", std::io::Error::other(e)))?;
        plumbing::file::write_atomic(&self.dir, STATE_FILE, &bytes, 0o600).map_err(|source| self.io("replace", source))
    }

    fn io(&self, action: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            action,
            path: self.path.display().to_string(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn round_trips_atomically_with_private_permissions() {
        let dir = tempfile::tempdir().unwrap();
        let file = StateFile::new(&dir.path().join("state"));
        assert_eq!(file.load().unwrap(), None);
        let mut state = State::new("team-a/agent", "u-1");
        state.fence.activated = 4;
        state.fence.floor = 5;
        state.generation = 9;
        file.save(&state).unwrap();
        assert_eq!(file.load().unwrap(), Some(state.clone()));
        let mode = fs::metadata(dir.path().join("state").join(STATE_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(!dir.path().join("state").join("fence.json.tmp").exists());
        let shown = format!("{state:?}");
        let key = serde_json::to_string(&state.receipt_key).unwrap();
        assert!(!shown.contains(key.trim_matches('"')), "Debug must not show the key");
    }

    #[test]
    fn the_next_generation_keeps_the_identity_and_forgets_the_workload() {
        let mut state = State::new("team-a/agent", "u-1");
        state.generation = 3;
        state.fence.activated = 7;
        state.ended = Some("workload exited".into());
        state.recovery_deadline_at_ms = Some(1);
        let key = state.receipt_key.clone();
        assert_eq!(state.registering(), 3);
        let next = state.clone().next_generation();
        assert_eq!((next.route.as_str(), next.uid.as_str()), ("team-a/agent", "u-1"));
        assert_eq!(
            (
                next.ended.as_ref(),
                next.workload.as_ref(),
                next.recovery_deadline_at_ms
            ),
            (None, None, None)
        );
        assert!(next.receipt_key != key, "a new receipt key");
        assert_eq!(next.registering(), 4);
        // A state written before the field existed still loads.
        let mut json = serde_json::to_value(&state).unwrap();
        json.as_object_mut().unwrap().remove("next_generation");
        let old: State = serde_json::from_value(json).unwrap();
        assert!(!old.next_generation);
    }

    #[test]
    fn a_corrupt_state_refuses_to_load() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(STATE_FILE), b"{\"v\":1,").unwrap();
        assert!(matches!(StateFile::new(dir.path()).load(), Err(Error::Corrupt(_))));
    }
}
