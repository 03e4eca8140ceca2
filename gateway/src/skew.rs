//! The compatibility policy, applied to the builds the pool runs (`docs/operate.md`, "Versions
//! and skew"). Pure.
//!
//! A *release line* is what a breaking change moves: the minor version before 1.0 (`0.2`,
//! `0.3`), the major version after. With `N` the newest line among the gateways (the members',
//! when no gateway reported):
//!
//! - gateways and members of lines `N` and `N−1` run side by side (a rolling upgrade or a
//!   rollback); older ones are outside the policy;
//! - sidecars of lines `N−2` to `N` are served (they live as long as their Pods); older ones,
//!   and sidecars newer than the pool (the webhook upgraded before the pool), are outside.
//!
//! The step from the last 0.x line to 1.0 is outside any window (`Line::behind` is `None`
//! across it): 1.0's changelog says what that upgrade takes.
//!
//! Every build outside the policy is named in one sentence per line and component; so are
//! parts that report no build (they predate reporting one).

use std::collections::BTreeMap;

use semver::Version;

use crate::store::builds::{Build, Component};

/// How many lines back gateways and members may be from the newest.
pub const CONTROL_PLANE_LINES_BACK: u64 = 1;
/// How many lines back sidecars may be from the newest gateway line.
pub const SIDECAR_LINES_BACK: u64 = 2;

/// A release line: `(major, minor)` before 1.0, `(major, 0)` after.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Line(u64, u64);

impl Line {
    pub fn of(version: &str) -> Option<Line> {
        let version = Version::parse(version).ok()?;
        Some(if version.major == 0 {
            Line(0, version.minor)
        } else {
            Line(version.major, 0)
        })
    }

    /// How many lines `self` is behind `newest` (`None`: across the 0.x/1.x boundary or
    /// another major, which no policy spans).
    fn behind(self, newest: Line) -> Option<u64> {
        match (self, newest) {
            (Line(0, a), Line(0, b)) => b.checked_sub(a),
            (Line(a, _), Line(b, _)) if a > 0 && b > 0 => b.checked_sub(a),
            _ => None,
        }
    }
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Line(0, minor) => write!(f, "0.{minor}"),
            Line(major, _) => write!(f, "{major}.x"),
        }
    }
}

/// What runs outside the policy, one sentence per component and line (sorted).
pub fn warnings(builds: &[Build]) -> Vec<String> {
    let newest_of = |component| {
        builds
            .iter()
            .filter(|b| b.component == component)
            .filter_map(|b| Line::of(&b.version))
            .max()
    };
    let Some(newest) = newest_of(Component::Gateway).or_else(|| newest_of(Component::Member)) else {
        return Vec::new();
    };
    // (component, line or None for "no build") → count
    let mut outside: BTreeMap<(Component, Option<Line>), usize> = BTreeMap::new();
    for build in builds {
        let line = Line::of(&build.version);
        let back = match build.component {
            Component::Gateway | Component::Member => CONTROL_PLANE_LINES_BACK,
            Component::Sidecar => SIDECAR_LINES_BACK,
        };
        let fits = line.is_some_and(|line| line.behind(newest).is_some_and(|behind| behind <= back));
        if !fits {
            *outside.entry((build.component, line)).or_default() += 1;
        }
    }
    outside
        .into_iter()
        .map(|((component, line), count)| {
            let what = match (component, count) {
                (Component::Gateway, 1) => "1 gateway replica".to_owned(),
                (Component::Member, 1) => "1 member".to_owned(),
                (Component::Sidecar, 1) => "1 sidecar".to_owned(),
                (Component::Gateway, n) => format!("{n} gateway replicas"),
                (Component::Member, n) => format!("{n} members"),
                (Component::Sidecar, n) => format!("{n} sidecars"),
            };
            let (is, reports) = if count == 1 { ("is", "reports") } else { ("are", "report") };
            match line {
                None => format!("{what} {reports} no release version (none, or one that is not a version)"),
                Some(line) if line > newest => {
                    format!("{what} of {line} {is} newer than the pool ({newest}): upgrade the pool first")
                }
                Some(line) => {
                    let back = if component == Component::Sidecar {
                        SIDECAR_LINES_BACK
                    } else {
                        CONTROL_PLANE_LINES_BACK
                    };
                    format!("{what} of {line} {is} more than {back} release line(s) behind {newest}: outside the compatibility policy")
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(component: Component, name: &str, version: &str) -> Build {
        Build {
            component,
            name: name.into(),
            version: version.into(),
        }
    }

    #[test]
    fn lines_are_minor_before_one_and_major_after() {
        assert_eq!(Line::of("0.2.1+3f1c2ab"), Some(Line(0, 2)));
        assert_eq!(Line::of("1.4.0"), Some(Line(1, 0)));
        assert_eq!(Line::of(""), None);
        assert_eq!(Line::of("dev"), None);
        assert_eq!(Line(0, 1).behind(Line(0, 3)), Some(2));
        assert_eq!(Line(0, 9).behind(Line(1, 0)), None);
    }

    #[test]
    fn a_rolling_upgrade_and_old_sidecars_within_the_policy_say_nothing() {
        let builds = [
            build(Component::Gateway, "gw-0", "0.3.0+aa"),
            build(Component::Gateway, "gw-1", "0.2.4"),
            build(Component::Member, "m-0", "0.2.4"),
            build(Component::Sidecar, "team-a/p", "0.1.0"),
            build(Component::Sidecar, "team-a/q", "0.3.0+aa"),
        ];
        assert_eq!(warnings(&builds), Vec::<String>::new());
    }

    #[test]
    fn what_is_too_old_too_new_or_unknown_is_named_once_per_line() {
        let builds = [
            build(Component::Gateway, "gw-0", "0.4.0"),
            build(Component::Member, "m-0", "0.2.0"),
            build(Component::Sidecar, "team-a/p", "0.1.0"),
            build(Component::Sidecar, "team-a/q", "0.1.3"),
            build(Component::Sidecar, "team-a/r", "0.5.0"),
            build(Component::Sidecar, "team-a/s", ""),
        ];
        assert_eq!(
            warnings(&builds),
            vec![
                "1 member of 0.2 is more than 1 release line(s) behind 0.4: outside the compatibility policy",
                "1 sidecar reports no release version (none, or one that is not a version)",
                "2 sidecars of 0.1 are more than 2 release line(s) behind 0.4: outside the compatibility policy",
                "1 sidecar of 0.5 is newer than the pool (0.4): upgrade the pool first",
            ]
        );
    }

    #[test]
    fn without_gateways_the_members_set_the_line_and_without_either_nothing_is_said() {
        let builds = [
            build(Component::Member, "m-0", "0.3.0"),
            build(Component::Sidecar, "team-a/p", "0.0.9"),
        ];
        assert_eq!(warnings(&builds).len(), 1);
        assert!(warnings(&[build(Component::Sidecar, "team-a/p", "0.0.9")]).is_empty());
    }
}
