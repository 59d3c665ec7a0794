//! Network faults between two engines, through a userspace fault proxy on the data path (the
//! server advertises the proxy): delays and throttling slow transfers down but they complete with
//! the right bytes; a partition fails a transfer within the stall bound with a peer error; a
//! reset fails what is in flight at once; and after either heals, new transfers on the same
//! session succeed without restarting anything (the engine replaces a broken connection).

use std::time::{Duration, Instant};

use tensorwire_core::{Engine, Permissions, Region, Session, TransferOp};
use tensorwire_tcp::{TcpBackend, TcpConfig};
use tensorwire_testkit::faults::{Fault, FaultProxy};

const LEN: u64 = 1 << 20;
const STALL: Duration = Duration::from_millis(800);

struct Setup {
    a: Engine,
    _b: Engine,
    proxy: FaultProxy,
    session: Session,
    src: Region,
    dst: Region,
}

async fn setup() -> Setup {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let proxy = FaultProxy::start(port).await.unwrap();
    let b_cfg = TcpConfig { listen: port, advertise: Some(proxy.addr()), ..TcpConfig::default() };
    let b = Engine::builder().backend(TcpBackend::new(b_cfg).unwrap()).start().await.unwrap();
    let a_cfg = TcpConfig { stall_timeout: STALL, streams: 2, ..TcpConfig::default() };
    let a = Engine::builder().backend(TcpBackend::new(a_cfg).unwrap()).start().await.unwrap();
    let src = a.alloc(LEN, Permissions::NONE).await.unwrap();
    let dst = b.alloc(LEN, Permissions::READ_WRITE).await.unwrap();
    let session = a.connect(b.local_addr()).await.unwrap();
    Setup { a, _b: b, proxy, session, src, dst }
}

impl Setup {
    /// Writes a fresh pattern; on success checks it landed.
    async fn write(&self, seed: u8) -> tensorwire_core::Result<()> {
        let data: Vec<u8> = (0..LEN as usize).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
        self.src.write_bytes(0, &data).unwrap();
        let op = TransferOp::write(&self.src, 0, &self.dst.remote(), 0, LEN);
        let r = tokio::time::timeout(Duration::from_secs(30), self.session.transfer(op))
            .await
            .expect("a transfer outlived every bound");
        if r.is_ok() {
            assert!(self.dst.to_vec(0, LEN).unwrap() == data, "bytes differ");
        }
        r.map(|_| ())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_and_throttle_slow_transfers_but_they_complete() {
    let s = setup().await;
    s.write(1).await.unwrap();
    s.proxy.set(Fault::Delay(Duration::from_millis(20)));
    s.write(2).await.unwrap();
    s.proxy.set(Fault::Throttle(8 << 20));
    s.write(3).await.unwrap();
    s.proxy.set(Fault::None);
    s.write(4).await.unwrap();
    assert!(s.proxy.forwarded() >= 4 * LEN, "the data went through the proxy");
    let _ = &s.a;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_fails_within_the_stall_bound_and_healing_needs_no_restart() {
    let s = setup().await;
    s.write(1).await.unwrap();
    s.proxy.set(Fault::Partition);
    let t = Instant::now();
    let e = s.write(2).await.unwrap_err();
    let took = t.elapsed();
    assert!(e.is_peer_failure(), "a partition is a peer failure: {e}");
    assert!(took < STALL * 10, "failed after {took:?}, stall bound {STALL:?}");
    s.proxy.set(Fault::None);
    // The same session, the same engines: the broken connection is replaced.
    s.write(3).await.unwrap();
    s.write(4).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_fails_what_is_in_flight_and_the_next_transfer_reconnects() {
    let s = setup().await;
    s.write(1).await.unwrap();
    // In flight: a throttled transfer is cut by the reset.
    s.proxy.set(Fault::Throttle(256 << 10));
    let t = Instant::now();
    let (r, ()) = tokio::join!(s.write(2), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.proxy.reset_all();
    });
    let e = r.unwrap_err();
    assert!(e.is_peer_failure(), "a reset is a peer failure: {e}");
    assert!(t.elapsed() < Duration::from_secs(5), "the reset surfaced after {:?}", t.elapsed());
    s.proxy.set(Fault::None);
    s.write(3).await.unwrap();
    // Idle connections reset: the next transfer may find its connection dead (a peer error)
    // but the one after it goes through on a new one.
    s.proxy.reset_all();
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Err(e) = s.write(4).await {
        assert!(e.is_peer_failure(), "{e}");
    }
    s.write(5).await.unwrap();
}
