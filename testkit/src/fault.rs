//! Network faults: a [`Path`] is a
//! TCP proxy on loopback in front of one port. Cut, it fails the way a broken route, a stale
//! conntrack entry or a NetworkPolicy fails a link — no reset, nothing delivered: established
//! connections go silent (what arrives meanwhile is held and delivered at the heal) and new
//! ones are accepted but never answered. Cut one way ([`Way`]), only what flows in that
//! direction is held (an asymmetric route, a one-way firewall rule). Slowed, every chunk
//! arrives that much later in each direction (a long or congested link).

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
    /// Client to upstream held.
    up_cut: bool,
    /// Upstream to client held.
    down_cut: bool,
    delay: Duration,
}

impl State {
    fn is_cut(&self, way: Way) -> bool {
        match way {
            Way::Up => self.up_cut,
            Way::Down => self.down_cut,
        }
    }
}

/// A direction through a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// From the client to the upstream.
    Up,
    /// From the upstream back to the client.
    Down,
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
                        forward(client_read, server_write, is_cut.clone(), Way::Up),
                        forward(server_read, client_write, is_cut, Way::Down),
                    );
                });
            }
        });
        Ok(Self { address, state, task })
    }

    /// Nothing goes through until [`Path::heal`].
    pub fn cut(&self) {
        self.state.send_modify(|s| (s.up_cut, s.down_cut) = (true, true));
    }

    /// Nothing goes through `way` until [`Path::heal`]; the other way stays open.
    pub fn cut_one_way(&self, way: Way) {
        self.state.send_modify(|s| match way {
            Way::Up => s.up_cut = true,
            Way::Down => s.down_cut = true,
        });
    }

    /// Open both ways again.
    pub fn heal(&self) {
        self.state.send_modify(|s| (s.up_cut, s.down_cut) = (false, false));
    }

    /// Every chunk read from now on is forwarded `delay` after it was read (zero: at once).
    pub fn slow(&self, delay: Duration) {
        self.state.send_modify(|s| s.delay = delay);
    }
}

impl Drop for Path {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copy `from` to `to`, holding whatever arrives while the path is cut, and each chunk until
/// the path's delay after it was read: latency, not a slower pipe — chunks read meanwhile are
/// on their way too.
async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut state: watch::Receiver<State>, way: Way) {
    let (chunks, mut in_flight) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let delay = state.clone();
    let reading = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let due = tokio::time::Instant::now() + delay.borrow().delay;
            if chunks.send((due, buffer[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let writing = async move {
        while let Some((due, chunk)) = in_flight.recv().await {
            tokio::time::sleep_until(due).await;
            if state.wait_for(|s| !s.is_cut(way)).await.is_err() || to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(reading, writing);
}
