//! The sample workload (binary `agent`). Counts in memory every 50 ms and reports
//! each value through its sidecar's Unix socket (newline-delimited JSON, see
//! docs/workload.md). Logs `pid=…` once and `accepted value=… at_ms=…` for
//! every report its owner accepted, which the scenarios read to measure the
//! longest gap in the observed counter.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::Parser;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

#[derive(Debug, Parser)]
pub struct Args {
    /// The sidecar's workload socket.
    #[arg(long, env = "OPENSHELL_SIDECAR_SOCKET")]
    socket: std::path::PathBuf,
    /// Counting period (ms).
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    /// Exit 0 after this many seconds (a Job's workload); without it, run until killed.
    #[arg(long)]
    for_seconds: Option<u64>,
    /// Never talk to the socket (a workload that knows nothing of its supervision): only run.
    #[arg(long)]
    silent: bool,
}

/// Counts and reports through the sidecar's socket until killed (or for `--for-seconds`);
/// reconnects whenever the socket goes away.
pub async fn run(args: Args) -> anyhow::Result<()> {
    println!("agent pid={} socket={}", std::process::id(), args.socket.display());
    let work = async {
        match args.silent {
            true => std::future::pending().await,
            false => count(&args).await,
        }
    };
    match args.for_seconds {
        Some(seconds) => {
            let _ = tokio::time::timeout(Duration::from_secs(seconds), work).await;
            println!("agent finished after {seconds} s");
        }
        None => work.await,
    }
    Ok(())
}

async fn count(args: &Args) {
    let counter = Arc::new(AtomicU64::new(0));
    let period = Duration::from_millis(args.interval_ms);
    let counting = counter.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            counting.fetch_add(1, Ordering::SeqCst);
        }
    });
    let mut tick = tokio::time::interval(period);
    loop {
        let stream = match UnixStream::connect(&args.socket).await {
            Ok(stream) => stream,
            Err(_) => {
                tokio::time::sleep(period).await;
                continue;
            }
        };
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        loop {
            tick.tick().await;
            let value = counter.load(Ordering::SeqCst);
            let request = format!("{{\"op\":\"progress\",\"value\":{value}}}\n");
            if write.write_all(request.as_bytes()).await.is_err() {
                break;
            }
            // Held while the sidecar recovers; bounded by the recovery deadline.
            match tokio::time::timeout(Duration::from_secs(120), lines.next_line()).await {
                Ok(Ok(Some(answer))) => {
                    let ok = serde_json::from_str::<serde_json::Value>(&answer)
                        .ok()
                        .and_then(|v| v.get("ok").and_then(serde_json::Value::as_bool))
                        .unwrap_or(false);
                    if ok {
                        println!("accepted value={value} at_ms={}{}", now_ms(), owner(&answer));
                    } else {
                        println!("refused value={value} at_ms={} answer={answer}", now_ms());
                    }
                }
                _ => break,
            }
        }
    }
}

fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// ` term=T member=M` when the sidecar's answer names the owner that answered.
fn owner(answer: &str) -> String {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(answer) else {
        return String::new();
    };
    let mut out = String::new();
    if let Some(term) = value.get("term").and_then(serde_json::Value::as_u64) {
        out.push_str(&format!(" term={term}"));
    }
    if let Some(member) = value.get("member").and_then(serde_json::Value::as_str) {
        out.push_str(&format!(" member={member}"));
    }
    out
}
