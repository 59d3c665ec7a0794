//! The raw-UCX baseline: `ucx_perftest` (from Debian's `ucx-utils`), run by the harness as a
//! server and a client process on loopback, `ucp_put_bw` for WRITE and `ucp_get` for READ, same
//! size, and the same UCX environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...) as the tensorwire side,
//! since both inherit this process's. The figure is the client's overall bandwidth from its
//! `Final:` line. For `xfer --latency`: `ucp_put_lat` (a put ping-pong; its figure is half the
//! round trip, doubled here) for WRITE and `ucp_get` with one get outstanding for READ, at a
//! percentile rank (`-R`), from the same line.

use crate::Result;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tensorwire_core::Error;

use crate::measure::Budget;

/// The program.
pub const PROGRAM: &str = "ucx_perftest";
/// ucx_perftest's MB is 2^20 bytes.
const MB: f64 = 1048576.0;

/// Runs ucx_perftest pairs.
#[derive(Debug)]
pub struct Perftest {
    tls: String,
}

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn unsupported(what: String) -> Error {
    Error::Unsupported { backend: "ucx", what }
}

impl Perftest {
    /// Checks that the program runs.
    pub fn new() -> Result<Perftest> {
        let ok = Command::new(PROGRAM)
            .arg("-h")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !ok {
            return Err(unsupported(format!(
                "baseline `{PROGRAM}` not found: apt-get install ucx-utils"
            ))
            .into());
        }
        let tls = std::env::var("UCX_TLS").unwrap_or_else(|_| "UCX default".into());
        Ok(Perftest { tls })
    }

    /// The baseline's name in report lines.
    pub fn name(&self) -> String {
        format!("ucx_perftest(UCX_TLS={})", self.tls)
    }

    /// Iterations for one sample of about `budget.min_time`, assuming ~10 GB/s.
    fn iters(size: u64, budget: Budget) -> u64 {
        let n = budget.min_time.as_secs_f64() * 10e9 / size.max(1) as f64;
        (n as u64).clamp(10, budget.max_iters.max(10))
    }

    /// One sample in GB/s: a server and a client process, `ucp_put_bw` or `ucp_get`.
    pub async fn sample(&self, write: bool, size: u64, budget: Budget) -> Result<f64> {
        let iters = Self::iters(size, budget);
        let test = if write { "ucp_put_bw" } else { "ucp_get" };
        let warmup = (iters / 10).max(2);
        let args =
            [test, &size.to_string(), &iters.to_string(), &warmup.to_string()].map(String::from);
        let mb = spawn(move || run_pair(&args, &[], parse_final)).await?;
        Ok(mb * MB / 1e9)
    }

    /// The round trip of one op in microseconds at percentile `rank` (50, 99) over `iters` ops:
    /// `ucp_put_lat` doubled for WRITE (it reports half a ping-pong), `ucp_get` with one get
    /// outstanding for READ.
    pub async fn latency(&self, write: bool, size: u64, iters: u64, rank: f64) -> Result<f64> {
        let test = if write { "ucp_put_lat" } else { "ucp_get" };
        let warmup = (iters / 10).max(2);
        let args =
            [test, &size.to_string(), &iters.to_string(), &warmup.to_string()].map(String::from);
        let mut extra = vec!["-R".to_string(), rank.to_string()];
        if !write {
            extra.extend(["-O".to_string(), "1".to_string()]);
        }
        let us = spawn(move || run_pair(&args, &extra, parse_final_percentile)).await?;
        Ok(if write { 2.0 * us } else { us })
    }

    /// What [`Perftest::latency`] measures, for a report line.
    pub fn latency_name(write: bool) -> &'static str {
        if write {
            "ucx_perftest ucp_put_lat (x2: a round trip)"
        } else {
            "ucx_perftest ucp_get, one outstanding"
        }
    }
}

async fn spawn<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::protocol(format!("{PROGRAM} runner: {e}")))?
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs a server and a client with `[test, size, iters, warmup]` and `extra` arguments; the
/// figure `parse` finds in the client's output.
fn run_pair(
    [test, size, iters, warmup]: &[String; 4],
    extra: &[String],
    parse: fn(&str) -> Option<f64>,
) -> Result<f64> {
    let common = |c: &mut Command| {
        c.args(["-t", test, "-s", size, "-n", iters, "-w", warmup]);
        c.args(extra);
    };
    let mut last = String::new();
    for _ in 0..5 {
        let port = free_port()?.to_string();
        let mut server = Command::new(PROGRAM);
        common(&mut server);
        server.args(["-p", &port]).stdout(Stdio::null()).stderr(Stdio::null());
        let _server = Reaped(server.spawn()?);
        std::thread::sleep(Duration::from_millis(300));
        let mut client = Command::new(PROGRAM);
        client.arg("127.0.0.1");
        common(&mut client);
        client.args(["-p", &port]).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = Reaped(client.spawn()?);
        let out = wait_output(&mut child.0, Duration::from_secs(120))?;
        match parse(&out) {
            Some(v) => return Ok(v),
            None => last = out,
        }
    }
    Err(unsupported(format!("{PROGRAM} {test} -s {size} gave no result: {}", tail(&last))).into())
}

fn wait_output(child: &mut Child, bound: Duration) -> Result<String> {
    let deadline = Instant::now() + bound;
    while child.try_wait()?.is_none() {
        if Instant::now() >= deadline {
            return Err(Error::timeout(format!("{PROGRAM} client"), bound).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut out = String::new();
    if let Some(mut s) = child.stdout.take() {
        s.read_to_string(&mut out)?;
    }
    if let Some(mut s) = child.stderr.take() {
        s.read_to_string(&mut out)?;
    }
    Ok(out)
}

fn tail(s: &str) -> &str {
    let at = s.len().saturating_sub(400);
    s.get(at..).unwrap_or(s)
}

/// Field `i` of the client's `Final:` line:
/// `Final: iters percentile avg overall bw_avg bw_overall rate_avg rate_overall`.
fn final_field(out: &str, i: usize) -> Option<f64> {
    let line = out.lines().rev().find(|l| l.trim_start().starts_with("Final:"))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    f.get(i)?.parse::<f64>().ok().filter(|v| v.is_finite() && *v > 0.0)
}

/// The overall bandwidth (MB/s) from the client's `Final:` line.
pub fn parse_final(out: &str) -> Option<f64> {
    final_field(out, 6)
}

/// The latency at the run's percentile rank (microseconds) from the client's `Final:` line.
pub fn parse_final_percentile(out: &str) -> Option<f64> {
    final_field(out, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_final_line() {
        let out = "+------+\n| Stage |\nFinal:                    50   7873.729  8003.521  \
                   8003.521     7996.48    7996.48         125         125\n";
        assert_eq!(parse_final(out), Some(7996.48));
        assert_eq!(parse_final_percentile(out), Some(7873.729));
        assert_eq!(parse_final("no result\n"), None);
        assert_eq!(parse_final("Final: 1 2 3\n"), None);
        assert_eq!(parse_final("Final: 1 2 3 4 5 nan 7 8\n"), None);
    }
}
