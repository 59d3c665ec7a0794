//! Reading an endpoint back: a GET client for the endpoint's routes, a parser of the
//! Prometheus text format, and the sums and histogram quantiles `tensorwire top` shows.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest answer read.
const MAX_ANSWER: u64 = 64 << 20;

/// `GET path` from an endpoint at `addr`: the body of a 200 answer, else an error naming the
/// status. Bounded by `timeout` in all.
pub async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<String, String> {
    let fetch = async {
        let mut s = TcpStream::connect(addr).await.map_err(|e| format!("{addr}: {e}"))?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.map_err(|e| format!("{addr}: {e}"))?;
        let mut raw = Vec::new();
        s.take(MAX_ANSWER).read_to_end(&mut raw).await.map_err(|e| format!("{addr}: {e}"))?;
        let text = String::from_utf8(raw).map_err(|_| format!("{addr}{path}: not UTF-8"))?;
        let (head, body) =
            text.split_once("\r\n\r\n").ok_or_else(|| format!("{addr}{path}: no HTTP head"))?;
        let status = head.split(' ').nth(1).unwrap_or("");
        if status != "200" {
            return Err(format!("{addr}{path}: HTTP {status}: {}", body.trim()));
        }
        Ok(body.to_string())
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("{addr}{path}: no answer within {timeout:?}"))?
}

/// One sample of an exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The series name (a histogram's are `NAME_bucket`, `NAME_sum`, `NAME_count`).
    pub name: String,
    /// Its labels, in order.
    pub labels: Labels,
    /// Its value.
    pub value: f64,
}

impl Sample {
    /// The value of label `k`.
    pub fn label(&self, k: &str) -> Option<&str> {
        self.labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
    }

    fn matches(&self, filter: &[(&str, &str)]) -> bool {
        filter.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

/// The samples of one or more expositions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Samples(pub Vec<Sample>);

impl Samples {
    /// Parses the Prometheus text format (comments skipped); total: a malformed line is an
    /// error naming it.
    pub fn parse(text: &str) -> Result<Samples, String> {
        let mut out = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            out.push(parse_line(line).map_err(|e| format!("line {}: {e}: {line:?}", n + 1))?);
        }
        Ok(Samples(out))
    }

    /// Adds another exposition's samples.
    pub fn extend(&mut self, other: Samples) {
        self.0.extend(other.0);
    }

    /// The sum of every series `name` whose labels include `filter`.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        let sum: f64 =
            self.0.iter().filter(|s| s.name == name && s.matches(filter)).map(|s| s.value).sum();
        sum + 0.0 // an empty sum is -0.0
    }

    /// The values of label `label` among the series `name`, sorted, each once.
    pub fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .0
            .iter()
            .filter(|s| s.name == name)
            .filter_map(|s| s.label(label).map(str::to_string))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Cumulative bucket counts of histogram `name` (every series matching `filter` summed):
    /// (upper bound, count), by bound.
    pub fn buckets(&self, name: &str, filter: &[(&str, &str)]) -> Vec<(f64, f64)> {
        let bucket = format!("{name}_bucket");
        let mut v: Vec<(f64, f64)> = Vec::new();
        for s in self.0.iter().filter(|s| s.name == bucket && s.matches(filter)) {
            let Some(le) = s.label("le").and_then(parse_value) else { continue };
            match v.iter_mut().find(|(b, _)| *b == le) {
                Some(e) => e.1 += s.value,
                None => v.push((le, s.value)),
            }
        }
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    }

    /// The `q` quantile of histogram `name` (as Prometheus' `histogram_quantile`: linear within
    /// the bucket it falls in; the highest finite bound when it falls in `+Inf`); `None`
    /// without samples.
    pub fn quantile(&self, name: &str, q: f64, filter: &[(&str, &str)]) -> Option<f64> {
        quantile_of(&self.buckets(name, filter), q)
    }

    /// [`Samples::quantile`] of what histogram `name` recorded since `earlier` (the bucket
    /// counts' differences); `None` without new samples.
    pub fn quantile_since(
        &self,
        earlier: &Samples,
        name: &str,
        q: f64,
        filter: &[(&str, &str)],
    ) -> Option<f64> {
        let before = earlier.buckets(name, filter);
        let mut b = self.buckets(name, filter);
        for (le, count) in &mut b {
            let was = before.iter().find(|(l, _)| l == le).map_or(0.0, |(_, c)| *c);
            *count = (*count - was).max(0.0);
        }
        quantile_of(&b, q)
    }
}

/// The `q` quantile of cumulative buckets (bound, count), sorted by bound.
fn quantile_of(b: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = b.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in b {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let inside = count - prev.1;
            let frac = if inside > 0.0 { (rank - prev.1) / inside } else { 1.0 };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, count);
    }
    Some(prev.0)
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        s => s.parse().ok(),
    }
}

fn parse_line(line: &str) -> Result<Sample, &'static str> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or("no value")?;
    let name = &line[..name_end];
    let name_ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    if name.is_empty()
        || !name.chars().all(name_ok)
        || name.starts_with(|c: char| c.is_ascii_digit())
    {
        return Err("bad metric name");
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(body) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(body)?;
        labels = parsed;
        rest = after;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().and_then(parse_value).ok_or("bad value")?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| "bad timestamp")?;
    }
    if fields.next().is_some() {
        return Err("trailing fields");
    }
    Ok(Sample { name: name.to_string(), labels, value })
}

type Labels = Vec<(String, String)>;

/// Labels up to the closing brace; returns them and what follows the brace.
fn parse_labels(mut s: &str) -> Result<(Labels, &str), &'static str> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let eq = s.find('=').ok_or("label without '='")?;
        let key = s[..eq].trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err("bad label name");
        }
        let v = s[eq + 1..].trim_start().strip_prefix('"').ok_or("label value not quoted")?;
        let mut value = String::new();
        let mut chars = v.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value"),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('"' | '\\'))) => value.push(c),
                    _ => return Err("bad escape in a label value"),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        s = v[end + 1..].trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return Err("expected ',' or '}' after a label");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP x_total Things.
# TYPE x_total counter
x_total{kind="a",dir="in"} 3
x_total{kind="b",dir="in"} 4.5
plain 7 1700000000000
q_seconds_bucket{class="i",le="0.1"} 2
q_seconds_bucket{class="i",le="1"} 6
q_seconds_bucket{class="i",le="+Inf"} 10
q_seconds_bucket{class="b",le="0.1"} 0
q_seconds_bucket{class="b",le="1"} 0
q_seconds_bucket{class="b",le="+Inf"} 0
esc{v="a\"b\\c\nd, e}"} 1
"#;

    #[test]
    fn parses_sums_and_quantiles() {
        let s = Samples::parse(TEXT).unwrap();
        assert_eq!(s.sum("x_total", &[]), 7.5);
        assert_eq!(s.sum("x_total", &[("kind", "b")]), 4.5);
        assert_eq!(s.sum("plain", &[]), 7.0);
        assert_eq!(s.label_values("x_total", "kind"), ["a", "b"]);
        let q = |p| s.quantile("q_seconds", p, &[]).unwrap();
        assert!((q(0.1) - 0.05).abs() < 1e-9, "{}", q(0.1)); // rank 1 of 2 below 0.1
        assert!((q(0.5) - 0.775).abs() < 1e-9, "{}", q(0.5)); // rank 5: 3 of the 4 in (0.1, 1]
        assert_eq!(q(0.99), 1.0, "in +Inf: the highest finite bound");
        assert_eq!(s.quantile("q_seconds", 0.5, &[("class", "b")]), None, "no samples");
        assert_eq!(s.quantile("nothing", 0.5, &[]), None);
        let later = Samples::parse(
            &TEXT
                .replace("le=\"1\"} 6", "le=\"1\"} 9")
                .replace("le=\"+Inf\"} 10", "le=\"+Inf\"} 13"),
        )
        .unwrap();
        // Three more samples, all in (0.1, 1]: the quantiles of those alone.
        assert_eq!(later.quantile_since(&s, "q_seconds", 0.0, &[]), Some(0.1));
        assert_eq!(later.quantile_since(&s, "q_seconds", 1.0, &[]), Some(1.0));
        assert_eq!(s.quantile_since(&s, "q_seconds", 0.5, &[]), None, "nothing new");
        let esc = s.0.iter().find(|x| x.name == "esc").unwrap();
        assert_eq!(esc.label("v"), Some("a\"b\\c\nd, e}"));
    }

    #[test]
    fn malformed_lines_are_errors() {
        for bad in [
            "x{",
            "x{a=1} 2",
            "x{a=\"1} 2",
            "x{a=\"1\" b=\"2\"} 3",
            "x{=\"1\"} 2",
            "x",
            "x abc",
            "x 1 2 3",
            "9x 1",
            "x{a=\"\\q\"} 1",
            "x 1 notatime",
            "{a=\"1\"} 1",
        ] {
            assert!(Samples::parse(bad).is_err(), "{bad:?}");
        }
    }
}
