//! The HTTP listener of `/metrics`, `/healthz` and `/readyz`.
//!
//! What a client can hold: a connection must send its first byte within [`Limits::first_byte`]
//! and its whole head (at most [`MAX_HEAD`] bytes) within [`Limits::head`]; until its answer is
//! written, it is one of at most [`Limits::pending`] connections, and a new connection when that
//! many are held closes the *oldest* (`tensorwire_proto::admission`), so a client that keeps
//! re-opening idle connections cannot crowd out a scrape, which sends its head at once. The
//! accept loop backs off when the process runs out of descriptors.

use std::net::SocketAddr;
use std::time::Duration;

use tensorwire_proto::admission::{self, Admission};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::health::{Health, Target};

/// Longest request head read; a longer one is answered 400.
pub const MAX_HEAD: usize = 8 << 10;
/// Bound on writing an answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The bounds on connections whose head is not in yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections reading their head at once (the oldest goes when more arrive).
    pub pending: usize,
    /// Bound on the first byte of a head.
    pub first_byte: Duration,
    /// Bound on the whole head.
    pub head: Duration,
}

impl Default for Limits {
    /// 64 pending, 1 s to the first byte, 5 s to the whole head.
    fn default() -> Self {
        Limits { pending: 64, first_byte: Duration::from_secs(1), head: Duration::from_secs(5) }
    }
}

/// A running listener; dropping it stops it.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Endpoint {
    /// Listens on `listen` (port 0: any free port) and answers `/metrics` (what [`crate::render`]
    /// gives), `/healthz` and `/readyz` (from `health`). An address other hosts can reach is
    /// refused unless `expose` is set (what it reveals: see the crate's docs).
    pub async fn serve(
        listen: SocketAddr,
        health: Health,
        expose: bool,
    ) -> Result<Endpoint, String> {
        Endpoint::serve_with(listen, health, expose, Limits::default()).await
    }

    /// [`Endpoint::serve`] with other bounds on clients.
    pub async fn serve_with(
        listen: SocketAddr,
        health: Health,
        expose: bool,
        limits: Limits,
    ) -> Result<Endpoint, String> {
        if !listen.ip().is_loopback() {
            if !expose {
                return Err(format!(
                    "metrics endpoint {listen}: other hosts can reach this address and read the \
                     cluster's load (counts, rates, queue depths, store occupancy; no keys or \
                     payloads); pass --metrics-expose to serve it there, or listen on 127.0.0.1"
                ));
            }
            tracing::warn!(%listen, "metrics endpoint reachable from other hosts (--metrics-expose)");
        }
        let l = TcpListener::bind(listen)
            .await
            .map_err(|e| format!("metrics endpoint: cannot listen on {listen}: {e}"))?;
        let addr = l.local_addr().map_err(|e| format!("metrics endpoint: {e}"))?;
        let task = tokio::spawn(accept(l, health, limits));
        Ok(Endpoint { addr, task })
    }

    /// This process's endpoint: installs the recorder (as `process`, see [`crate::install`])
    /// and serves on `listen` (see [`Endpoint::serve`]).
    pub async fn start(
        process: &str,
        listen: SocketAddr,
        health: Health,
        expose: bool,
    ) -> Result<Endpoint, String> {
        crate::install(process)?;
        Endpoint::serve(listen, health, expose).await
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

async fn accept(l: TcpListener, health: Health, limits: Limits) {
    // One bound for all sources: a scraper and an attacker on the same host share an address.
    // A connection holds its place until its answer is written (a client that sends a head and
    // never reads the answer holds no more than one that sends nothing).
    let room = Admission::new(
        "metrics endpoint",
        admission::Limits {
            pending: limits.pending,
            per_source: limits.pending,
            deadline: limits.head + WRITE_TIMEOUT + LINGER,
        },
    );
    loop {
        let (s, peer) = tensorwire_proto::accept::accept(&l, "metrics endpoint").await;
        let mut place = room.admit(peer.ip());
        let health = health.clone();
        tokio::spawn(async move {
            let _ = place.prove(serve_one(s, &health, limits)).await;
        });
        // Let the connections just accepted read their heads before more are accepted.
        tokio::task::yield_now().await;
    }
}

/// How long a connection answered 400 is read from before it is closed.
const LINGER: Duration = Duration::from_millis(500);

/// Reads one request head (within `limits`) and answers it; nothing when the client closed,
/// failed or was too slow.
async fn serve_one(s: TcpStream, health: &Health, limits: Limits) {
    let head = tokio::time::timeout(limits.head, read_head(s, limits.first_byte)).await;
    let Ok(Some((mut s, head))) = head else { return };
    let answer = match parse_request(&head) {
        Ok((method, path)) => route(method, path, health),
        Err(status) => Answer::text(status, "bad request\n"),
    };
    let _ = tokio::time::timeout(WRITE_TIMEOUT, answer.write(&mut s)).await;
    if answer.status == 400 {
        // A lingering close: what the client still sends is read (a little, for a short while)
        // so that closing does not reset the connection before the client read the answer.
        let mut sink = [0u8; 4096];
        let drain = async {
            for _ in 0..256 {
                if !matches!(s.read(&mut sink).await, Ok(n) if n > 0) {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }
}

/// Reads up to the end of the head (`\r\n\r\n`), at most [`MAX_HEAD`] bytes, the first byte
/// within `first_byte`; `None` when the client closed, failed or was too slow to start.
async fn read_head(mut s: TcpStream, first_byte: Duration) -> Option<(TcpStream, Vec<u8>)> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            break; // parse_request refuses a head without its end
        }
        let n = if head.is_empty() {
            tokio::time::timeout(first_byte, s.read(&mut buf)).await.ok()?.ok()?
        } else {
            s.read(&mut buf).await.ok()?
        };
        if n == 0 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Some((s, head))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Get,
    Head,
    Other,
}

/// The method and path (without its query) of a request head; total: anything malformed is
/// an error status.
fn parse_request(head: &[u8]) -> Result<(Method, &str), u16> {
    let end = head.windows(4).position(|w| w == b"\r\n\r\n").ok_or(400u16)?;
    let line_end = head[..end].windows(2).position(|w| w == b"\r\n").unwrap_or(end);
    let line = std::str::from_utf8(&head[..line_end]).map_err(|_| 400u16)?;
    let mut parts = line.split(' ');
    let (Some(m), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(400);
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err(400);
    }
    let method = match m {
        "GET" => Method::Get,
        "HEAD" => Method::Head,
        _ => Method::Other,
    };
    let path = target.split('?').next().unwrap_or(target);
    Ok((method, path))
}

struct Answer {
    status: u16,
    content_type: &'static str,
    body: String,
    head_only: bool,
}

impl Answer {
    fn text(status: u16, body: impl Into<String>) -> Answer {
        let content_type = "text/plain; charset=utf-8";
        Answer { status, content_type, body: body.into(), head_only: false }
    }

    async fn write(&self, s: &mut TcpStream) -> std::io::Result<()> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            _ => "Service Unavailable",
        };
        let head = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: \
             close\r\n\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        s.write_all(head.as_bytes()).await?;
        if !self.head_only {
            s.write_all(self.body.as_bytes()).await?;
        }
        s.shutdown().await
    }
}

fn route(method: Method, path: &str, health: &Health) -> Answer {
    if method == Method::Other {
        return Answer::text(405, "only GET and HEAD\n");
    }
    let mut a = match path {
        "/metrics" => match crate::render() {
            Some(body) => Answer {
                status: 200,
                content_type: "text/plain; version=0.0.4; charset=utf-8",
                body,
                head_only: false,
            },
            None => Answer::text(503, "no metrics recorder installed in this process\n"),
        },
        "/healthz" => Answer::text(200, "ok\n"),
        "/sd" => Answer {
            status: 200,
            content_type: "application/json",
            body: sd_json(&health.known_targets()),
            head_only: false,
        },
        "/readyz" => {
            let failing = health.failing();
            if failing.is_empty() {
                Answer::text(200, "ready\n")
            } else {
                Answer::text(503, format!("not ready: {}\n", failing.join(", ")))
            }
        }
        _ => Answer::text(404, "not found: /metrics, /healthz, /readyz, /sd\n"),
    };
    a.head_only = method == Method::Head;
    a
}

/// Prometheus' HTTP service discovery format: one group per target.
fn sd_json(targets: &[Target]) -> String {
    let groups: Vec<String> = targets
        .iter()
        .map(|t| {
            let labels: Vec<String> =
                t.labels.iter().map(|(k, v)| format!("{}:{}", json_str(k), json_str(v))).collect();
            format!("{{\"targets\":[{}],\"labels\":{{{}}}}}", json_str(&t.addr), labels.join(","))
        })
        .collect();
    format!("[{}]\n", groups.join(","))
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_garbage_is_refused() {
        let ok = parse_request(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n");
        assert_eq!(ok, Ok((Method::Get, "/metrics")));
        assert_eq!(parse_request(b"HEAD /readyz HTTP/1.0\r\n\r\n"), Ok((Method::Head, "/readyz")));
        assert_eq!(parse_request(b"POST / HTTP/1.1\r\n\r\n"), Ok((Method::Other, "/")));
        for bad in [
            &b"GET /metrics HTTP/1.1\r\n"[..], // no end of head
            b"GET /metrics\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /a b HTTP/1.1\r\n\r\n",
            b"GET /metrics SPDY/3\r\n\r\n",
            b"\xff\xfe / HTTP/1.1\r\n\r\n",
            b"\r\n\r\n",
            b"",
        ] {
            assert_eq!(parse_request(bad), Err(400), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn routes_answer_by_path_and_readiness() {
        let h = Health::new();
        assert_eq!(route(Method::Get, "/healthz", &h).status, 200);
        assert_eq!(route(Method::Get, "/readyz", &h).status, 200);
        h.check("joined", || false);
        let r = route(Method::Get, "/readyz", &h);
        assert_eq!((r.status, r.body.as_str()), (503, "not ready: joined\n"));
        assert_eq!(route(Method::Get, "/nope", &h).status, 404);
        assert_eq!(route(Method::Other, "/metrics", &h).status, 405);
        assert!(route(Method::Head, "/healthz", &h).head_only);
        assert_eq!(route(Method::Get, "/sd", &h).body, "[]\n");
        h.targets(|| {
            vec![Target {
                addr: "127.0.0.1:9465".into(),
                labels: vec![("stage".into(), "de\"code".into())],
            }]
        });
        assert_eq!(
            route(Method::Get, "/sd", &h).body,
            "[{\"targets\":[\"127.0.0.1:9465\"],\"labels\":{\"stage\":\"de\\\"code\"}}]\n"
        );
    }
}
