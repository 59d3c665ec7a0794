//! The control channel as both sides use it: core's backend channel ([`channel`]) over this
//! backend's messages ([`Msg`]).

use tensorwire_core::Result;
use tensorwire_core::backend::channel::{self, Message};
use tensorwire_core::backend::kit::Framing;

pub(crate) use channel::{accept, ask, read, write};

use crate::wire::{FRAMING, Msg};

/// The sending side of the control channel.
pub(crate) type Sender = channel::Sender<Msg>;
/// Requests awaiting their answer.
pub(crate) type Requests = channel::Requests<Msg>;

impl Message for Msg {
    const FRAMING: Framing = FRAMING;

    fn kind(&self) -> u8 {
        Msg::kind(self)
    }

    fn encode(&self) -> Vec<u8> {
        Msg::encode(self)
    }

    fn decode(kind: u8, payload: &[u8]) -> Result<Self> {
        Msg::decode(kind, payload)
    }

    fn is_bye(&self) -> bool {
        matches!(self, Msg::Bye)
    }
}

/// Dials a peer's control channel and runs the client side of the handshake.
pub(crate) async fn dial(
    addr: std::net::SocketAddr,
    secret: Option<&tensorwire_core::ClusterSecret>,
    limit: std::time::Duration,
) -> Result<tokio::net::TcpStream> {
    channel::dial(addr, &FRAMING, secret, limit).await
}
