//! poolctl's errors and the exit code of each (documented in `--help` and the README).

use tonic::Code;

/// Done.
pub const OK: u8 = 0;
/// An unexpected error.
pub const UNEXPECTED: u8 = 1;
/// Bad arguments or local configuration (clap exits with it too).
pub const USAGE: u8 = 2;
/// No gateway answered, or the operator token was refused.
pub const UNREACHABLE: u8 = 3;
/// The operation failed, or a dry run says it would not finish.
pub const OPERATION_FAILED: u8 = 4;
/// The operation was cancelled.
pub const OPERATION_CANCELLED: u8 = 5;
/// The gateway refused the request itself.
pub const REFUSED: u8 = 6;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    #[error("the operator token: {0}")]
    Token(#[from] plumbing::token::TokenError),
    #[error("the operator token is not valid gRPC metadata")]
    TokenFormat,
    #[error("no gateway answered: {0}")]
    Connect(String),
    #[error("{} ({:?})", .0.message(), .0.code())]
    Call(#[from] tonic::Status),
    #[error("operation {id} failed: {message}")]
    Failed { id: String, message: String },
    #[error("operation {id} was cancelled: {message}")]
    Cancelled { id: String, message: String },
    #[error("the operation would not finish: {0}")]
    WouldNotFinish(String),
    #[error("operation {0} is not in the pool status")]
    Vanished(String),
    #[error("the watch stream broke and no gateway took it over: {0}")]
    StreamLost(String),
    #[error("cannot print: {0}")]
    Output(String),
    /// Whoever read stdout stopped reading (`poolctl status | head`): the command ends
    /// quietly with [`OK`].
    #[error("stdout was closed")]
    Closed,
}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Self {
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            Self::Closed
        } else {
            Self::Output(err.to_string())
        }
    }
}

impl Error {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Usage(_) | Self::Token(_) | Self::TokenFormat => USAGE,
            Self::Connect(_) | Self::StreamLost(_) => UNREACHABLE,
            Self::Call(status) => code_of(status.code()),
            Self::Failed { .. } | Self::WouldNotFinish(_) => OPERATION_FAILED,
            Self::Cancelled { .. } => OPERATION_CANCELLED,
            Self::Vanished(_) | Self::Output(_) => UNEXPECTED,
            Self::Closed => OK,
        }
    }
}

/// The exit code of a gateway's refusal.
pub fn code_of(code: Code) -> u8 {
    match code {
        Code::Unauthenticated | Code::PermissionDenied | Code::Unavailable | Code::DeadlineExceeded => UNREACHABLE,
        Code::InvalidArgument
        | Code::NotFound
        | Code::FailedPrecondition
        | Code::AlreadyExists
        | Code::OutOfRange
        | Code::ResourceExhausted => REFUSED,
        _ => UNEXPECTED,
    }
}

/// Whether a watch that ended with `code` may be taken up again on another gateway.
pub fn worth_reconnecting(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
            | Code::Aborted
            | Code::ResourceExhausted
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_has_its_documented_code() {
        let status = |code| Error::Call(tonic::Status::new(code, "x"));
        let cases = [
            (Error::Usage("no --gateway".into()), 2),
            (Error::TokenFormat, 2),
            (Error::Connect("a: refused".into()), 3),
            (status(Code::Unauthenticated), 3),
            (status(Code::PermissionDenied), 3),
            (status(Code::Unavailable), 3),
            (Error::StreamLost("a: reset".into()), 3),
            (
                Error::Failed {
                    id: "op".into(),
                    message: "deadline".into(),
                },
                4,
            ),
            (Error::WouldNotFinish("at capacity".into()), 4),
            (
                Error::Cancelled {
                    id: "op".into(),
                    message: "by an operator".into(),
                },
                5,
            ),
            (status(Code::InvalidArgument), 6),
            (status(Code::NotFound), 6),
            (status(Code::FailedPrecondition), 6),
            (status(Code::ResourceExhausted), 6),
            (status(Code::Internal), 1),
            (Error::Vanished("op".into()), 1),
        ];
        for (error, code) in cases {
            assert_eq!(error.exit_code(), code, "{error}");
        }
    }

    #[test]
    fn refusals_of_the_request_are_not_retried_elsewhere() {
        for code in [
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::InvalidArgument,
            Code::Unimplemented,
        ] {
            assert!(!worth_reconnecting(code), "{code:?}");
        }
        assert!(worth_reconnecting(Code::Unavailable) && worth_reconnecting(Code::ResourceExhausted));
    }
}
