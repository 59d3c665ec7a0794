//! Corruption in flight: a proxy between the engines flips one payload byte. With checksums on,
//! the op fails with `Error::Checksum`; with them off the same flip goes through unnoticed (which
//! shows the proxy really corrupts).

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tensorwire_core::{Engine, Error, Permissions, TransferOp};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Which direction the proxy corrupts.
#[derive(Clone, Copy)]
enum Flip {
    ToServer,
    ToClient,
}

/// Byte index to flip in the corrupted direction: after the 8-byte preamble and the first 64-byte
/// header, 100 bytes into the first payload.
const AT: usize = 8 + 64 + 100;

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    flip: bool,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut seen = 0usize;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if flip && (seen..seen + n).contains(&AT) {
            buf[AT - seen] ^= 0x5a;
        }
        seen += n;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
}

/// A proxy whose target is set once the server exists (the server must advertise the proxy).
async fn proxy(flip: Flip) -> (SocketAddr, Arc<OnceLock<SocketAddr>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let target = Arc::new(OnceLock::new());
    let t = target.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let server = TcpStream::connect(*t.get().unwrap()).await.unwrap();
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pipe(cr, sw, matches!(flip, Flip::ToServer)));
            tokio::spawn(pipe(sr, cw, matches!(flip, Flip::ToClient)));
        }
    });
    (addr, target)
}

async fn run(flip: Flip, checksum: bool) -> (Result<(), Error>, bool) {
    let client_cfg = TcpConfig { checksum, streams: 1, ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(client_cfg).unwrap()).start().await.unwrap();
    // The server advertises the proxy, so the client's data stream goes through it.
    let (via, target) = proxy(flip).await;
    let b_tcp =
        TcpBackend::new(TcpConfig { advertise: Some(via), ..TcpConfig::default() }).unwrap();
    target.set(b_tcp.local_addr()).unwrap();
    let b = Engine::builder().backend(b_tcp).start().await.unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let (local, remote_region) = (
        a.alloc(4096, Permissions::NONE).await.unwrap(),
        b.alloc(4096, Permissions::READ_WRITE).await.unwrap(),
    );
    let s = a.connect(b.local_addr()).await.unwrap();
    let op = match flip {
        Flip::ToServer => {
            local.write_bytes(0, &data).unwrap();
            TransferOp::write(&local, 0, &remote_region.remote(), 0, 4096)
        }
        Flip::ToClient => {
            remote_region.write_bytes(0, &data).unwrap();
            TransferOp::read(&local, 0, &remote_region.remote(), 0, 4096)
        }
    };
    let r = tokio::time::timeout(Duration::from_secs(20), s.transfer(op)).await.unwrap();
    let landed = match flip {
        Flip::ToServer => remote_region.to_vec(0, 4096).unwrap(),
        Flip::ToClient => local.to_vec(0, 4096).unwrap(),
    };
    (r.map(|_| ()), landed == data)
}

/// With checksums a flipped byte is an error; without, it lands silently.
async fn flip_is_caught(flip: Flip) {
    let (r, _) = run(flip, true).await;
    assert!(matches!(r, Err(Error::Checksum { .. })), "{r:?}");
    let (r, intact) = run(flip, false).await;
    assert!(r.is_ok() && !intact, "without checksums the flip lands silently: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_write_is_reported() {
    flip_is_caught(Flip::ToServer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_read_is_reported() {
    flip_is_caught(Flip::ToClient).await;
}
