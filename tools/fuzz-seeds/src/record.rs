//! A recording TCP forwarder: clients dial [`Recorder::addr`], every connection is relayed to a
//! target, and the bytes of both directions are kept. Put one in front of a listener (an engine's
//! control endpoint, a tcp backend's data port through `advertise`, a store node, the
//! orchestrator service) and the traffic of a real session becomes seeds.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tensorwire_core::backend::kit::lock;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// The bytes of one relayed connection.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// What the client sent.
    pub to_server: Vec<u8>,
    /// What the server sent.
    pub to_client: Vec<u8>,
}

type Shared = Arc<Mutex<Vec<Arc<Mutex<Conversation>>>>>;

/// A bound forwarder whose target is not known yet (bind first, to advertise its address).
#[derive(Debug)]
pub struct Recorder {
    listener: Option<TcpListener>,
    addr: SocketAddr,
    conversations: Shared,
    tasks: JoinSet<()>,
}

impl Recorder {
    /// Binds on loopback.
    pub async fn bind() -> std::io::Result<Recorder> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        Ok(Recorder {
            listener: Some(listener),
            addr,
            conversations: Shared::default(),
            tasks: JoinSet::new(),
        })
    }

    /// The address clients dial.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts relaying every connection to `target`.
    pub fn forward_to(&mut self, target: SocketAddr) {
        let Some(listener) = self.listener.take() else { return };
        let conversations = self.conversations.clone();
        self.tasks.spawn(async move {
            let mut relays = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else { continue };
                let conv = Arc::new(Mutex::new(Conversation::default()));
                lock(&conversations).push(conv.clone());
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                relays.spawn(relay(cr, sw, conv.clone(), true));
                relays.spawn(relay(sr, cw, conv, false));
            }
        });
    }

    /// What was relayed so far, one entry per connection in accept order.
    pub fn conversations(&self) -> Vec<Conversation> {
        lock(&self.conversations).iter().map(|c| lock(c).clone()).collect()
    }
}

/// Copies one direction, recording before forwarding (so whatever the receiver has seen is
/// recorded), until either side closes.
async fn relay(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    conv: Arc<Mutex<Conversation>>,
    up: bool,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        {
            let mut c = lock(&conv);
            let log = if up { &mut c.to_server } else { &mut c.to_client };
            log.extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
