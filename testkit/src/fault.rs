//! Network faults: a [`Path`] is a
//! TCP proxy on loopback in front of one port. Cut, it fails the way a broken route, a stale
//! conntrack entry or a NetworkPolicy fails a link — no reset, nothing delivered: established
//! connections go silent (what arrives meanwhile is held and delivered at the heal) and new
//! ones are accepted but never answered. Slowed, every chunk arrives that much later in each
//! direction (a long or congested link).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;

/// A cuttable, slowable path to one upstream port; dropping it stops accepting.
#[derive(Debug)]
pub struct Path {
    /// Where clients connect instead of the upstream.
    pub address: SocketAddr,
    state: watch::Sender<State>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct State {
    cut: bool,
    delay: Duration,
}

impl Path {
    /// A path to `upstream` (`host:port`), open.
    pub async fn start(upstream: String) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let (state, watched) = watch::channel(State::default());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, is_cut) = (upstream.clone(), watched.clone());
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        forward(client_read, server_write, is_cut.clone()),
                        forward(server_read, client_write, is_cut),
                    );
                });
            }
        });
        Ok(Self { address, state, task })
    }

    /// Nothing goes through until [`Path::heal`].
    pub fn cut(&self) {
        self.state.send_modify(|s| s.cut = true);
    }

    pub fn heal(&self) {
        self.state.send_modify(|s| s.cut = false);
    }

    /// Every chunk read from now on is forwarded `delay` later (zero: at once).
    pub fn slow(&self, delay: Duration) {
        self.state.send_modify(|s| s.delay = delay);
    }
}

impl Drop for Path {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copy `from` to `to`, holding whatever arrives while the path is cut and delaying each
/// chunk by the path's delay.
async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut state: watch::Receiver<State>) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = state.borrow().delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if state.wait_for(|s| !s.cut).await.is_err() || to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
