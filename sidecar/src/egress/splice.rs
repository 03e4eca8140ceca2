//! A tunnel's bytes moved in the kernel: socket to pipe to socket with splice(2), so nothing
//! is copied through the sidecar and no tunnel holds a buffer in its memory. Each direction
//! ends at its end of stream by shutting down the other side's writing half, as
//! `tokio::io::copy_bidirectional` does; the tunnel is over when both have.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use nix::fcntl::{OFlag, SpliceFFlags, splice};
use nix::sys::socket::{Shutdown, shutdown};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Bytes asked of one splice, and the pipe's capacity (the default is 64 KiB; a larger one
/// costs no memory until bytes are in flight, and halves the system calls of a bulk transfer).
const CHUNK: usize = 256 * 1024;

/// Both directions at once, until both ended (or one failed), counting the bytes moved from
/// `a` to `b` and back as they go (so a tunnel cut short still knows what it carried).
pub async fn both_ways(a: &TcpStream, b: &TcpStream, a_to_b: &AtomicU64, b_to_a: &AtomicU64) -> io::Result<()> {
    tokio::try_join!(one_way(a, b, a_to_b), one_way(b, a, b_to_a)).map(|_| ())
}

async fn one_way(from: &TcpStream, to: &TcpStream, moved: &AtomicU64) -> io::Result<()> {
    let (pipe_out, pipe_in) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
    // Best effort: an unprivileged process may be held to a lower maximum.
    let capacity = i32::try_from(CHUNK).unwrap_or(i32::MAX);
    let _ = nix::fcntl::fcntl(&pipe_in, nix::fcntl::FcntlArg::F_SETPIPE_SZ(capacity));
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        let read = from
            .async_io(Interest::READABLE, || {
                splice(from, None, &pipe_in, None, CHUNK, flags).map_err(io::Error::from)
            })
            .await?;
        if read == 0 {
            // Already gone is as good as shut down.
            let _ = shutdown(to.as_raw_fd(), Shutdown::Write);
            return Ok(());
        }
        let mut left = read;
        while left > 0 {
            let written = to
                .async_io(Interest::WRITABLE, || {
                    splice(&pipe_out, None, to, None, left, flags).map_err(io::Error::from)
                })
                .await?;
            if written == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            left -= written;
            moved.fetch_add(written as u64, Ordering::Relaxed);
        }
    }
}
