//! A throwaway etcd for tests: Debian's `etcd` binary on two free loopback ports with a temporary
//! data directory, killed and cleaned up on drop. [`EtcdServer::start`] says why when it cannot
//! (no binary), so a test can report itself skipped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    /// Its client URL.
    pub url: String,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    /// Starts one and waits (up to 20 s) until it answers; `Err` says why it could not.
    pub fn start() -> Result<EtcdServer, String> {
        let bin = std::env::var("ETCD_BIN").unwrap_or_else(|_| "etcd".into());
        if Command::new(&bin).arg("--version").output().is_err() {
            return Err(format!("no `{bin}` binary (Debian: apt-get install etcd-server)"));
        }
        let (client, peer) =
            (free_port().map_err(|e| e.to_string())?, free_port().map_err(|e| e.to_string())?);
        let dir = std::env::temp_dir().join(format!("tw-etcd-{}-{client}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new(&bin)
            .arg("--data-dir")
            .arg(&dir)
            .args(["--name", "tw", "--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("tw={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {bin}: {e}"))?;
        let s = EtcdServer { child, dir, url };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
            if Instant::now() > deadline {
                return Err("etcd did not start within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(s)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
