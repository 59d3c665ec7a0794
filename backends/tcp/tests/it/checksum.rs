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

/// Striped over several streams in many pieces, the op's last piece is the one corrupted: a
/// proxy that reads the data protocol frame by frame flips a byte in the piece that ends the
/// op (a WriteReq, or the ReadResp answering the ReadReq that ends it). A check of only some
/// pieces (the first, one per stream) would let it through.
const OP: u64 = 1 << 20;
const PIECE: u64 = 64 << 10;

/// Copies one stream's frames (after its `opening` bytes: the preamble, and from the client the
/// ticket too), flipping a byte in the payload of the frame that carries the op's last piece. `reads` maps the ids of ReadReqs (seen going to the server) to the end of
/// the range they ask for.
async fn frames(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    flip: bool,
    opening: usize,
    reads: Arc<std::sync::Mutex<std::collections::HashMap<u64, u64>>>,
) {
    use tensorwire_tcp::wire::{DataHeader, HEADER_LEN, Kind};
    let mut pre = vec![0u8; opening];
    if from.read_exact(&mut pre).await.is_err() || to.write_all(&pre).await.is_err() {
        return;
    }
    let mut head = [0u8; HEADER_LEN];
    while from.read_exact(&mut head).await.is_ok() {
        let Ok(h) = DataHeader::decode(&head) else { return };
        let mut payload = vec![0u8; h.payload_len() as usize];
        if from.read_exact(&mut payload).await.is_err() {
            return;
        }
        let last = match h.kind {
            Kind::ReadReq => {
                reads.lock().unwrap().insert(h.id, h.offset + h.len);
                false
            }
            Kind::WriteReq => h.offset + h.len == OP,
            Kind::ReadResp => reads.lock().unwrap().get(&h.id) == Some(&OP),
            _ => false,
        };
        if flip && last && !payload.is_empty() {
            let mid = payload.len() / 2;
            payload[mid] ^= 0x5a;
        }
        if to.write_all(&head).await.is_err() || to.write_all(&payload).await.is_err() {
            return;
        }
    }
}

async fn striped(flip: Flip, checksum: bool) -> (Result<(), Error>, Vec<u8>, Vec<u8>) {
    let cfg = TcpConfig { checksum, streams: 3, piece_bytes: PIECE, ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(cfg.clone()).unwrap()).start().await.unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let via = l.local_addr().unwrap();
    let b_tcp = TcpBackend::new(TcpConfig { advertise: Some(via), ..cfg }).unwrap();
    let target = b_tcp.local_addr();
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let server = TcpStream::connect(target).await.unwrap();
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            let reads = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
            use tensorwire_tcp::wire::{PREAMBLE, TICKET_LEN};
            let (to_server, to_client) = (PREAMBLE.len() + TICKET_LEN, PREAMBLE.len());
            tokio::spawn(frames(cr, sw, matches!(flip, Flip::ToServer), to_server, reads.clone()));
            tokio::spawn(frames(sr, cw, matches!(flip, Flip::ToClient), to_client, reads));
        }
    });
    let b = Engine::builder().backend(b_tcp).start().await.unwrap();
    let data: Vec<u8> =
        (0..OP as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let local = a.alloc(OP, Permissions::NONE).await.unwrap();
    let remote = b.alloc(OP, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    let op = match flip {
        Flip::ToServer => {
            local.write_bytes(0, &data).unwrap();
            TransferOp::write(&local, 0, &remote.remote(), 0, OP)
        }
        Flip::ToClient => {
            remote.write_bytes(0, &data).unwrap();
            TransferOp::read(&local, 0, &remote.remote(), 0, OP)
        }
    };
    let r = tokio::time::timeout(Duration::from_secs(20), s.transfer(op)).await.unwrap();
    let landed = match flip {
        Flip::ToServer => remote.to_vec(0, OP).unwrap(),
        Flip::ToClient => local.to_vec(0, OP).unwrap(),
    };
    (r.map(|_| ()), landed, data)
}

async fn last_piece_flip_is_caught(flip: Flip) {
    let (r, _, _) = striped(flip, true).await;
    assert!(matches!(r, Err(Error::Checksum { .. })), "{r:?}");
    // Without checksums the same flip lands, in the last piece and nowhere else.
    let (r, landed, data) = striped(flip, false).await;
    assert!(r.is_ok(), "{r:?}");
    let differ: Vec<usize> = (0..data.len()).filter(|&i| landed[i] != data[i]).collect();
    assert_eq!(differ.len(), 1, "one flipped byte");
    assert!(differ[0] as u64 >= OP - PIECE, "the flip is in the last piece: byte {}", differ[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_last_piece_of_a_striped_write_is_reported() {
    last_piece_flip_is_caught(Flip::ToServer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_last_piece_of_a_striped_read_is_reported() {
    last_piece_flip_is_caught(Flip::ToClient).await;
}
