//! Tracing set-up, the same in every binary: one `--log-format` option (`text` or `json`),
//! the level from `RUST_LOG` (else the binary's default), lines to stderr. Errors go in the
//! field `error` (`tracing::warn!(error = %err, "…")`) everywhere.

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line: the event's fields, its innermost span (`span`) and the list
    /// of spans it is in (`spans`), each with its fields (`route`, `member`, `term`, …).
    Json,
}

/// The `--log-format` flag (`OPENSHELL_LOG_FORMAT`) of the gateway, the supervisor and the
/// sidecar.
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct LogArgs {
    /// Log format.
    #[arg(long, env = "OPENSHELL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Installs the global subscriber. `default_filter` applies when `RUST_LOG` is unset or
/// invalid (e.g. `"info"` or `"info,sqlx=warn"`). A second call changes nothing.
pub fn init(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Only the first global subscriber counts (tests may install one earlier).
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
