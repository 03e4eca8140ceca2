//! Following an operation to its end on the status stream (`--wait`): a progress bar
//! (indicatif: moves done of the planned total, elapsed, ETA) when stdout is a terminal and
//! the output is a table; otherwise a plain line (or a JSON/YAML document) per change.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use proto::pool::v1::{Operation, OperationPhase};

use crate::cli::Output;
use crate::client::Statuses;
use crate::exit::Error;
use crate::render::{self, is_finished, phase_name};

/// How long an operation may be missing from the streamed status (the gateway's pool view
/// can be a refresh behind the record) before poolctl gives up on it.
pub const MISSING_GRACE: Duration = Duration::from_secs(10);

/// Where the progress of one operation goes.
pub struct Progress {
    total: u64,
    started: Instant,
    display: Display,
}

enum Display {
    Quiet,
    Bar(ProgressBar),
    Lines { output: Output, last: Option<String> },
}

impl Progress {
    /// A bar on a terminal for a table, lines otherwise; `total` moves planned (0: unknown).
    pub fn new(total: u64, output: Output) -> Self {
        if output == Output::Table && std::io::stdout().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(total.max(1)), ProgressDrawTarget::stdout());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} moves  ETA {eta}  {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.enable_steady_tick(Duration::from_millis(200));
            return Self {
                total,
                started: Instant::now(),
                display: Display::Bar(bar),
            };
        }
        Self::lines(total, output)
    }

    /// Plain lines (or documents) whatever stdout is.
    pub fn lines(total: u64, output: Output) -> Self {
        Self {
            total,
            started: Instant::now(),
            display: Display::Lines { output, last: None },
        }
    }

    /// Nothing shown (a program that only needs the outcome).
    pub fn quiet() -> Self {
        Self {
            total: 0,
            started: Instant::now(),
            display: Display::Quiet,
        }
    }

    fn show(&mut self, op: &Operation) -> Result<(), Error> {
        self.total = self.total.max(u64::from(op.moves));
        match &mut self.display {
            Display::Quiet => {}
            Display::Bar(bar) => {
                bar.set_length(self.total.max(1));
                bar.set_position(u64::from(op.moves));
                bar.set_message(format!("{} — {}", phase_name(op.phase), op.message));
                if is_finished(op) {
                    bar.finish();
                }
            }
            Display::Lines { output, last } => {
                let key = format!("{} {} {}", op.phase, op.moves, op.message);
                if last.as_deref() == Some(key.as_str()) {
                    return Ok(());
                }
                *last = Some(key);
                let elapsed = self.started.elapsed();
                let total = self.total;
                crate::print_line(&render::render(
                    *output,
                    || {
                        let mut value = render::operation_json(op);
                        value["totalMoves"] = total.into();
                        value["elapsedMs"] = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX).into();
                        value
                    },
                    || progress_line(op, total, elapsed),
                ))?;
            }
        }
        Ok(())
    }
}

/// The estimated time left: the mean time per move so far times the moves left.
pub fn eta(moves: u64, total: u64, elapsed: Duration) -> Option<Duration> {
    if moves == 0 || total < moves {
        return None;
    }
    let per_move = elapsed.checked_div(u32::try_from(moves).ok()?)?;
    per_move.checked_mul(u32::try_from(total - moves).ok()?)
}

/// One plain progress line.
pub fn progress_line(op: &Operation, total: u64, elapsed: Duration) -> String {
    let total_text = if total == 0 { "?".to_owned() } else { total.to_string() };
    let eta = if is_finished(op) {
        "-".to_owned()
    } else {
        eta(u64::from(op.moves), total, elapsed).map_or_else(|| "?".to_owned(), |d| format!("{:.1}s", d.as_secs_f64()))
    };
    format!(
        "{} {}: {}/{total_text} moves, elapsed {:.1}s, ETA {eta} — {}",
        op.id,
        phase_name(op.phase),
        op.moves,
        elapsed.as_secs_f64(),
        op.message
    )
}

/// Follow operation `id` on `statuses` until it ends: `Ok` when it succeeded.
pub async fn follow(statuses: &mut Statuses<'_>, id: &str, progress: &mut Progress) -> Result<Operation, Error> {
    let started = Instant::now();
    loop {
        let status = statuses.next().await?;
        let Some(op) = status.operations.into_iter().find(|o| o.id == id) else {
            if started.elapsed() > MISSING_GRACE {
                return Err(Error::Vanished(id.to_owned()));
            }
            continue;
        };
        progress.show(&op)?;
        if is_finished(&op) {
            return ended(op);
        }
    }
}

/// A finished operation as the command's outcome.
pub fn ended(op: Operation) -> Result<Operation, Error> {
    match OperationPhase::try_from(op.phase) {
        Ok(OperationPhase::Succeeded) => Ok(op),
        Ok(OperationPhase::Cancelled) => Err(Error::Cancelled {
            id: op.id,
            message: op.message,
        }),
        _ => Err(Error::Failed {
            id: op.id,
            message: op.message,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(phase: OperationPhase, moves: u32) -> Operation {
        Operation {
            id: "op-1".into(),
            phase: phase as i32,
            moves,
            message: "moving".into(),
            ..Operation::default()
        }
    }

    #[test]
    fn the_eta_follows_the_pace_so_far() {
        assert_eq!(eta(2, 6, Duration::from_secs(4)), Some(Duration::from_secs(8)));
        assert_eq!(eta(0, 6, Duration::from_secs(4)), None, "no pace yet");
        assert_eq!(eta(3, 0, Duration::from_secs(4)), None, "total unknown");
    }

    #[test]
    fn a_line_shows_moves_done_of_total_elapsed_and_eta() {
        let line = progress_line(&op(OperationPhase::Running, 1), 4, Duration::from_millis(1500));
        assert_eq!(line, "op-1 running: 1/4 moves, elapsed 1.5s, ETA 4.5s — moving");
        let done = progress_line(&op(OperationPhase::Succeeded, 4), 4, Duration::from_secs(6));
        assert!(
            done.contains("succeeded: 4/4 moves") && done.contains("ETA -"),
            "{done}"
        );
        assert!(progress_line(&op(OperationPhase::Pending, 0), 0, Duration::ZERO).contains("0/? moves"));
    }

    #[test]
    fn failed_and_cancelled_operations_end_with_their_exit_codes() {
        assert!(ended(op(OperationPhase::Succeeded, 2)).is_ok());
        let failed = ended(op(OperationPhase::Failed, 1)).unwrap_err();
        assert_eq!(failed.exit_code(), crate::exit::OPERATION_FAILED);
        let cancelled = ended(op(OperationPhase::Cancelled, 1)).unwrap_err();
        assert_eq!(cancelled.exit_code(), crate::exit::OPERATION_CANCELLED);
    }
}
