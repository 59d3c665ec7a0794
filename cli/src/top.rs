//! `tensorwire top`: a live view of a running cluster, read from its metrics endpoints. It
//! scrapes the orchestrator's process (`--connect`, the address its `--metrics-listen` printed)
//! and every worker that process lists at `/sd`, once a second, and shows the pools and their
//! workers, queue depths, request throughput, TTFF, the store and each backend's GB/s. `q`
//! (or Esc, or Ctrl-C) quits. It needs no cluster secret: it only reads metrics.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph, Row, Table};
use tensorwire_observe::Samples;

/// `top` options.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct TopArgs {
    /// The metrics endpoint of the orchestrator's process (`serve --metrics-listen`, or
    /// `demo --processes --metrics-listen`): HOST:PORT.
    #[arg(long)]
    pub(crate) connect: SocketAddr,
    /// Refresh period, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub(crate) interval_ms: u64,
    /// Print one view as text (after two scrapes one interval apart) and exit: no terminal UI.
    #[arg(long)]
    pub(crate) once: bool,
}

const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);
const STAGES: [&str; 3] = ["encode", "denoise", "decode"];
/// Scrapes TTFF looks back over.
const WINDOW: usize = 10;

/// One scrape of the whole cluster.
struct Scrape {
    at: Instant,
    samples: Samples,
    endpoints: usize,
    failed: Vec<String>,
}

async fn scrape(connect: SocketAddr) -> anyhow::Result<Scrape> {
    let at = Instant::now();
    let mut samples = Samples::parse(
        &tensorwire_observe::get(connect, "/metrics", SCRAPE_TIMEOUT)
            .await
            .map_err(anyhow::Error::msg)?,
    )
    .map_err(anyhow::Error::msg)?;
    let sd = tensorwire_observe::get(connect, "/sd", SCRAPE_TIMEOUT).await.unwrap_or_default();
    let mut set = tokio::task::JoinSet::new();
    for t in targets(&sd) {
        set.spawn(async move {
            let addr: SocketAddr = tokio::net::lookup_host(&t)
                .await
                .map_err(|e| anyhow::anyhow!("{t}: {e}"))?
                .next()
                .ok_or_else(|| anyhow::anyhow!("{t}: no address"))?;
            let text = tensorwire_observe::get(addr, "/metrics", SCRAPE_TIMEOUT)
                .await
                .map_err(anyhow::Error::msg)?;
            Samples::parse(&text).map_err(|e| anyhow::anyhow!("{t}: {e}"))
        });
    }
    let (mut endpoints, mut failed) = (1, Vec::new());
    while let Some(r) = set.join_next().await {
        match r.map_err(anyhow::Error::msg).and_then(|r| r) {
            Ok(s) => {
                samples.extend(s);
                endpoints += 1;
            }
            Err(e) => failed.push(e.to_string()),
        }
    }
    Ok(Scrape { at, samples, endpoints, failed })
}

/// The target addresses of a `/sd` answer (`"targets":["a","b"]` groups).
fn targets(sd: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = sd;
    while let Some(i) = rest.find("\"targets\":[") {
        rest = &rest[i + "\"targets\":[".len()..];
        let end = rest.find(']').unwrap_or(rest.len());
        for t in rest[..end].split(',') {
            let t = t.trim().trim_matches('"');
            if !t.is_empty() {
                out.push(t.to_string());
            }
        }
    }
    out
}

/// What the screen shows, computed from two scrapes (rates over the time between them).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct View {
    /// Per stage: name, live workers, draining, queued interactive, queued batch, slots busy,
    /// slots in all.
    pub(crate) pools: Vec<(String, f64, f64, f64, f64, f64, f64)>,
    /// Completed requests per second over the last interval.
    pub(crate) completed_per_s: f64,
    pub(crate) completed: f64,
    pub(crate) failed: f64,
    /// TTFF p50 and p99, seconds, of the requests that ended in the window (about the last
    /// [`WINDOW`] scrapes), else since the orchestrator started; and which of the two.
    pub(crate) ttff: Option<(f64, f64)>,
    pub(crate) ttff_over: String,
    /// Store: objects, bytes, capacity, pinned, spilled.
    pub(crate) store: [f64; 5],
    /// Per backend: GB/s over the last interval (read + write, every process).
    pub(crate) backends: Vec<(String, f64)>,
    pub(crate) endpoints: usize,
    pub(crate) failed_endpoints: Vec<String>,
}

impl View {
    /// The view of `now`, with rates since `prev` and TTFF since `window` (older or equal).
    fn of(window: &Scrape, prev: &Scrape, now: &Scrape) -> View {
        let s = &now.samples;
        let secs = now.at.duration_since(prev.at).as_secs_f64().max(1e-3);
        let rate = |name: &str, filter: &[(&str, &str)]| {
            ((s.sum(name, filter) - prev.samples.sum(name, filter)) / secs).max(0.0)
        };
        let pools = STAGES
            .iter()
            .map(|&st| {
                let g = |name: &str, extra: &[(&str, &str)]| {
                    let mut f = vec![("stage", st)];
                    f.extend_from_slice(extra);
                    s.sum(name, &f)
                };
                let busy = g("tensorwire_credits_in_use", &[]);
                (
                    st.to_string(),
                    g("tensorwire_workers", &[("state", "live")]),
                    g("tensorwire_workers", &[("state", "draining")]),
                    g("tensorwire_queue_depth", &[("class", "interactive")]),
                    g("tensorwire_queue_depth", &[("class", "batch")]),
                    busy,
                    busy + g("tensorwire_free_slots", &[]),
                )
            })
            .collect();
        let done = [("outcome", "completed")];
        let name = "tensorwire_ttff_seconds";
        let recent = |q| s.quantile_since(&window.samples, name, q, &[]);
        let (ttff, ttff_over) = match recent(0.5).zip(recent(0.99)) {
            Some(t) => {
                let secs = now.at.duration_since(window.at).as_secs_f64();
                (Some(t), format!("last {secs:.0} s"))
            }
            None => {
                let all = |q| s.quantile(name, q, &[]);
                (all(0.5).zip(all(0.99)), "since start".to_string())
            }
        };
        let backends = s
            .label_values("tensorwire_transfer_bytes_total", "backend")
            .into_iter()
            .map(|b| {
                let r = rate("tensorwire_transfer_bytes_total", &[("backend", &b)]);
                (b, r / 1e9)
            })
            .collect();
        View {
            pools,
            completed_per_s: rate("tensorwire_requests_total", &done),
            completed: s.sum("tensorwire_requests_total", &done),
            failed: s.sum("tensorwire_requests_total", &[("outcome", "failed")]),
            ttff,
            ttff_over,
            store: [
                s.sum("tensorwire_store_objects", &[]),
                s.sum("tensorwire_store_bytes", &[]),
                s.sum("tensorwire_store_capacity_bytes", &[]),
                s.sum("tensorwire_store_pinned_objects", &[]),
                s.sum("tensorwire_store_spilled_objects", &[]),
            ],
            backends,
            endpoints: now.endpoints,
            failed_endpoints: now.failed.clone(),
        }
    }

    /// The header and summary lines (the pools are a table of their own).
    fn lines(&self, connect: SocketAddr) -> Vec<String> {
        let ttff = self.ttff.map_or("-".to_string(), |(p50, p99)| {
            format!("p50 {:.0} ms  p99 {:.0} ms", p50 * 1e3, p99 * 1e3)
        });
        let mib = |b: f64| b / f64::from(1u32 << 20);
        let [objects, bytes, capacity, pinned, spilled] = self.store;
        let backends: Vec<String> =
            self.backends.iter().map(|(b, g)| format!("{b} {g:.3} GB/s")).collect();
        let mut v = vec![
            format!(
                "tensorwire top: {connect} and {} more endpoints{}  (q quits)",
                self.endpoints.saturating_sub(1),
                if self.failed_endpoints.is_empty() {
                    String::new()
                } else {
                    format!(", {} not answering", self.failed_endpoints.len())
                }
            ),
            format!(
                "requests: {:.1}/s completed, {:.0} completed, {:.0} failed   TTFF ({}): {ttff}",
                self.completed_per_s, self.completed, self.failed, self.ttff_over
            ),
            format!(
                "store: {objects:.0} objects, {:.1} of {:.0} MiB, {pinned:.0} pinned, {spilled:.0} spilled",
                mib(bytes),
                mib(capacity)
            ),
            format!(
                "transfers: {}",
                if backends.is_empty() { "-".to_string() } else { backends.join(", ") }
            ),
        ];
        v.extend(self.failed_endpoints.iter().take(3).map(|e| format!("  not answering: {e}")));
        v
    }

    fn pool_rows(&self) -> Vec<[String; 5]> {
        self.pools
            .iter()
            .map(|(st, live, draining, qi, qb, busy, slots)| {
                [
                    st.clone(),
                    format!("{live:.0} live, {draining:.0} draining"),
                    format!("{qi:.0}"),
                    format!("{qb:.0}"),
                    format!("{busy:.0} / {slots:.0}"),
                ]
            })
            .collect()
    }

    /// The whole view as text (`--once`).
    fn text(&self, connect: SocketAddr) -> String {
        let mut s = self.lines(connect).join("\n");
        s.push_str(&format!(
            "\n{:<8} {:<24} {:>12} {:>8} {:>10}\n",
            "pool", "workers", "interactive", "batch", "slots busy"
        ));
        for [a, b, c, d, e] in self.pool_rows() {
            s.push_str(&format!("{a:<8} {b:<24} {c:>12} {d:>8} {e:>10}\n"));
        }
        s
    }
}

/// Runs `top`.
pub(crate) async fn run(a: TopArgs) -> anyhow::Result<()> {
    let every = Duration::from_millis(a.interval_ms.max(100));
    let mut past = std::collections::VecDeque::from([scrape(a.connect).await?]);
    if a.once {
        tokio::time::sleep(every).await;
        let now = scrape(a.connect).await?;
        print!("{}", View::of(&past[0], &past[0], &now).text(a.connect));
        return Ok(());
    }
    let mut term = ratatui::try_init().map_err(|e| anyhow::anyhow!("top: no terminal: {e}"))?;
    let res = async {
        let mut view: Option<View> = None;
        let mut error: Option<String> = None;
        loop {
            term.draw(|f| draw(f, a.connect, view.as_ref(), error.as_deref()))?;
            if quit_within(every).await? {
                return Ok(());
            }
            match scrape(a.connect).await {
                Ok(now) => {
                    let (window, prev) = (&past[0], &past[past.len() - 1]);
                    view = Some(View::of(window, prev, &now));
                    error = None;
                    if past.len() >= WINDOW {
                        past.pop_front();
                    }
                    past.push_back(now);
                }
                Err(e) => error = Some(e.to_string()),
            }
        }
    }
    .await;
    ratatui::restore();
    res
}

/// Waits up to `t` for a key; true for q, Esc or Ctrl-C.
async fn quit_within(t: Duration) -> anyhow::Result<bool> {
    tokio::task::spawn_blocking(move || {
        let until = Instant::now() + t;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || !event::poll(left)? {
                return Ok(false);
            }
            if let Event::Key(k) = event::read()? {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                    return Ok(true);
                }
            }
        }
    })
    .await?
}

fn draw(f: &mut ratatui::Frame<'_>, connect: SocketAddr, view: Option<&View>, error: Option<&str>) {
    let [head, pools] =
        Layout::vertical([Constraint::Length(8), Constraint::Min(6)]).areas(f.area());
    let mut lines: Vec<Line<'_>> = match view {
        Some(v) => v.lines(connect).into_iter().map(Line::from).collect(),
        None => vec![Line::from(format!("tensorwire top: {connect}: first interval..."))],
    };
    if let Some(e) = error {
        lines.push(Line::from(format!("scrape failed: {e}")));
    }
    f.render_widget(Paragraph::new(lines).block(Block::bordered().title("cluster")), head);
    let rows: Vec<Row<'_>> =
        view.map(View::pool_rows).unwrap_or_default().into_iter().map(Row::new).collect();
    let widths = [
        Constraint::Length(9),
        Constraint::Length(24),
        Constraint::Length(12),
        Constraint::Length(8),
        Constraint::Length(11),
    ];
    let table = Table::new(rows, widths)
        .header(Row::new(["pool", "workers", "interactive", "batch", "slots busy"]))
        .block(Block::bordered().title("pools (queued: interactive, batch)"));
    f.render_widget(table, pools);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape_of(text: &str, at: Instant) -> Scrape {
        Scrape { at, samples: Samples::parse(text).unwrap(), endpoints: 3, failed: vec![] }
    }

    #[test]
    fn the_view_takes_rates_over_the_interval_and_levels_as_they_are() {
        let t0 = Instant::now();
        let before = scrape_of(
            "tensorwire_requests_total{class=\"batch\",outcome=\"completed\"} 10\n\
             tensorwire_transfer_bytes_total{backend=\"tcp\",direction=\"read\"} 1000000000\n",
            t0,
        );
        let after = scrape_of(
            "tensorwire_requests_total{class=\"batch\",outcome=\"completed\"} 30\n\
             tensorwire_requests_total{class=\"batch\",outcome=\"failed\"} 1\n\
             tensorwire_transfer_bytes_total{backend=\"tcp\",direction=\"read\"} 3000000000\n\
             tensorwire_transfer_bytes_total{backend=\"tcp\",direction=\"write\"} 2000000000\n\
             tensorwire_workers{stage=\"denoise\",state=\"live\"} 6\n\
             tensorwire_queue_depth{stage=\"denoise\",class=\"batch\"} 4\n\
             tensorwire_credits_in_use{stage=\"denoise\"} 5\n\
             tensorwire_free_slots{stage=\"denoise\"} 1\n\
             tensorwire_ttff_seconds_bucket{class=\"batch\",le=\"1\"} 2\n\
             tensorwire_ttff_seconds_bucket{class=\"batch\",le=\"+Inf\"} 2\n\
             tensorwire_store_objects 7\n",
            t0 + Duration::from_secs(2),
        );
        let v = View::of(&before, &before, &after);
        assert_eq!((v.completed_per_s, v.completed, v.failed), (10.0, 30.0, 1.0));
        assert_eq!(v.backends, [("tcp".to_string(), 2.0)], "4 GB more in 2 s");
        assert_eq!(v.pools[1], ("denoise".into(), 6.0, 0.0, 0.0, 4.0, 5.0, 6.0));
        assert_eq!(v.store[0], 7.0);
        assert_eq!(v.ttff, Some((0.5, 0.99)), "both samples in the window, under 1 s");
        assert_eq!(v.ttff_over, "last 2 s");
        let quiet = View::of(&after, &after, &after);
        assert_eq!((quiet.ttff, quiet.ttff_over.as_str()), (Some((0.5, 0.99)), "since start"));
        let text = v.text("127.0.0.1:1".parse().unwrap());
        assert!(text.contains("10.0/s completed") && text.contains("denoise"), "{text}");
    }

    #[test]
    fn sd_targets_are_read_from_every_group() {
        let sd = r#"[{"targets":["127.0.0.1:1"],"labels":{"stage":"encode"}},{"targets":["h:2","h:3"],"labels":{}}]"#;
        assert_eq!(targets(sd), ["127.0.0.1:1", "h:2", "h:3"]);
        assert!(targets("[]").is_empty());
        assert!(targets("garbage").is_empty());
    }
}
