//! Small ops send their requests from the submitting task when a stream is idle, while the
//! stream's writer and other submitters wait their turn for the socket. Four tasks move 256 KiB
//! and 4 KiB ops through a proxy that holds each read 1 ms: every byte lands where its op said,
//! and every op completes. (What the socket does not take at once is finished by a task; loopback
//! buffers here take a 256 KiB request whole, so that path is covered by the unit test of
//! `Frame::parts`, which it shares with the writer.)

use std::sync::Arc;
use std::time::Duration;

use tensorwire_core::{Engine, Permissions, TransferOp};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::faults::{Fault, FaultProxy};

const SLOT: u64 = 256 << 10;
const TASKS: u64 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_ops_from_many_tasks_land_whole_through_a_slow_receiver() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let proxy = FaultProxy::start(port).await.unwrap();
    proxy.set(Fault::Delay(Duration::from_millis(1)));
    let b_cfg = TcpConfig { listen: port, advertise: Some(proxy.addr()), ..TcpConfig::default() };
    let b = Engine::builder().backend(TcpBackend::new(b_cfg).unwrap()).start().await.unwrap();
    let a_cfg = TcpConfig { streams: 2, ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(a_cfg).unwrap()).start().await.unwrap();
    // Per task: a source slot and a destination slot here, one slot there.
    let local = Arc::new(a.alloc(2 * TASKS * SLOT, Permissions::NONE).await.unwrap());
    let there = b.alloc(TASKS * SLOT, Permissions::READ_WRITE).await.unwrap();
    let remote = there.remote();
    let s = a.connect(b.local_addr()).await.unwrap();
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (local, remote, s) = (local.clone(), remote.clone(), s.clone());
        tasks.push(tokio::spawn(async move {
            let (src, dst, there) = (2 * t * SLOT, (2 * t + 1) * SLOT, t * SLOT);
            for round in 0..12u64 {
                let len = if round % 3 == 2 { 4096 } else { SLOT };
                let data: Vec<u8> = (0..len).map(|i| (i * 31 + t * 7 + round * 13) as u8).collect();
                local.write_bytes(src, &data).unwrap();
                s.transfer(TransferOp::write(&local, src, &remote, there, len)).await.unwrap();
                s.transfer(TransferOp::read(&local, dst, &remote, there, len)).await.unwrap();
                assert!(
                    local.to_vec(dst, len).unwrap() == data,
                    "task {t} round {round}: the bytes read back differ"
                );
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t).await.expect("a task hung").unwrap();
    }
    drop(proxy);
}

/// A one-piece op the socket does not take at once: 16 MiB WRITEs, one piece each (one stream,
/// 16 MiB pieces), sent by the submitting task into a partition (the proxy holds what it read
/// and reads no more), so the socket takes part of the request; once the partition heals, the
/// task that finishes the request resumes it where the socket stopped. Every byte lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_socket_takes_in_part_is_finished_where_it_stopped() {
    const LEN: u64 = 16 << 20;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let proxy = FaultProxy::start(port).await.unwrap();
    let b_cfg = TcpConfig { listen: port, advertise: Some(proxy.addr()), ..TcpConfig::default() };
    let b = Engine::builder().backend(TcpBackend::new(b_cfg).unwrap()).start().await.unwrap();
    let a_cfg = TcpConfig { streams: 1, piece_bytes: LEN, ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(a_cfg).unwrap()).start().await.unwrap();
    let local = a.alloc(LEN, Permissions::NONE).await.unwrap();
    let there = b.alloc(LEN, Permissions::READ_WRITE).await.unwrap();
    let s = a.connect(b.local_addr()).await.unwrap();
    for round in 0..2u64 {
        let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + round * 31 + i / 4099) as u8).collect();
        local.write_bytes(0, &data).unwrap();
        // The stream open and idle first (the first op opens it).
        s.transfer(TransferOp::write(&local, 0, &there.remote(), 0, 4096)).await.unwrap();
        proxy.set(Fault::Partition);
        let op = TransferOp::write(&local, 0, &there.remote(), 0, LEN);
        let handle = s.submit(vec![op]).await.pop().unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        proxy.set(Fault::None);
        tokio::time::timeout(Duration::from_secs(20), handle)
            .await
            .expect("the WRITE hung")
            .unwrap();
        assert!(there.to_vec(0, LEN).unwrap() == data, "round {round}: the bytes differ");
    }
    drop(proxy);
}
