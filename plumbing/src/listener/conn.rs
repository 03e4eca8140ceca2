//! One accepted connection: its TLS handshake (bounded) and its idle clock. The clock is checked
//! whenever the server waits to read, so it needs no task of its own: a connection that sends
//! no byte within `first_request_timeout` of the handshake, or has no traffic either way for
//! `idle_timeout` later, reads as timed out and the server closes it.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::{Counters, Limits, Slot};

/// The byte stream under a [`Conn`].
#[derive(Debug)]
enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// A connection accepted by a [`Listener`](super::Listener), holding its slot until dropped.
#[derive(Debug)]
pub struct Conn {
    io: Io,
    info: TcpConnectInfo,
    idle: Pin<Box<Sleep>>,
    last_activity: Instant,
    requested: bool,
    first_request_timeout: Duration,
    idle_timeout: Duration,
    counters: Counters,
    _slot: Slot,
}

impl Conn {
    /// Does the TLS handshake (if any) within the limits; `None` (counted) when it fails.
    pub(super) async fn establish(
        stream: TcpStream,
        peer: SocketAddr,
        tls: Option<TlsAcceptor>,
        limits: &Limits,
        slot: Slot,
    ) -> Option<Self> {
        let counters = slot.slots.counters.clone();
        let info = TcpConnectInfo {
            local_addr: stream.local_addr().ok(),
            remote_addr: Some(peer),
        };
        let io = match tls {
            None => Io::Plain(stream),
            Some(acceptor) => match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => Io::Tls(Box::new(stream)),
                Ok(Err(err)) => {
                    counters.handshake_failed();
                    tracing::debug!(%peer, error = %err, "TLS handshake failed");
                    return None;
                }
                Err(_) => {
                    counters.handshake_timed_out();
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return None;
                }
            },
        };
        let now = Instant::now();
        Some(Self {
            io,
            info,
            idle: Box::pin(tokio::time::sleep_until(now + limits.first_request_timeout)),
            last_activity: now,
            requested: false,
            first_request_timeout: limits.first_request_timeout,
            idle_timeout: limits.idle_timeout,
            counters,
            _slot: slot,
        })
    }

    /// The peer's address.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.info.remote_addr
    }

    /// True once the connection has been silent past its time-out (registers the waker).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.idle.as_mut().poll(cx).is_pending() {
                return false;
            }
            let limit = if self.requested {
                self.idle_timeout
            } else {
                self.first_request_timeout
            };
            let deadline = self.last_activity + limit;
            if Instant::now() >= deadline {
                return true;
            }
            self.idle.as_mut().reset(deadline);
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let polled = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        match polled {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.requested = true;
                    this.last_activity = Instant::now();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if this.expired(cx) => {
                this.counters.idle_closed();
                tracing::debug!(peer = ?this.info.remote_addr, requested = this.requested, "idle connection closed");
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "connection idle")))
            }
            other => other,
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, data),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, data),
        };
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.last_activity = Instant::now();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        };
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.last_activity = Instant::now();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.info.clone()
    }
}
