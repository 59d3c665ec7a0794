//! The scale section of `tensorwire bench`'s report: each curve of the scale bench
//! (`tensorwire_benches::scale`) as a table and an SVG chart of the per-op time against the
//! count, with the curve's growth against the 1.5x target.

use std::fmt::Write as _;
use std::path::Path;

use tensorwire_benches::scale::{self, Curve, Limits};

use crate::plot::{Chart, PALETTE, Series};

/// A count as a tick label: 1, 30, 1k, 100k, 1M.
fn count_label(x: f64) -> String {
    let n = x.round() as u64;
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1000 && n % 1000 == 0 => format!("{}k", n / 1000),
        n => n.to_string(),
    }
}

fn chart(c: &Curve) -> Chart {
    Chart {
        title: format!("{}: time per op against the count", c.curve),
        x_label: c.unit.to_string(),
        y_label: "us per op".into(),
        log_x: true,
        x_fmt: count_label,
        series: vec![Series {
            name: format!("{} (growth {:.2}x)", c.curve, c.growth),
            color: PALETTE[0],
            points: c.points.iter().map(|p| (p.x as f64, p.per_op_us)).collect(),
            dashed: false,
        }],
        y_max: None,
    }
}

/// Measures every curve with `limits` and writes the section into `md`, a chart per curve into
/// `out` (their names pushed on `plots`).
pub(crate) async fn section(
    md: &mut String,
    out: &Path,
    plots: &mut Vec<String>,
    limits: &Limits,
    which: &str,
) -> anyhow::Result<()> {
    eprintln!("bench: scale ({which} counts)");
    let curves = scale::all(limits, &|p| {
        eprintln!("  {:<20} {:>9}: {:>9.2} us per op", p.curve, p.x, p.per_op_us);
    })
    .await
    .map_err(anyhow::Error::msg)?;
    let _ = writeln!(
        md,
        "## Scale ({which} counts)\n\nThe time of one op as one count grows and everything else stays (`xfer --scale`; see `tensorwire_benches::scale`). Growth: the largest per-op time over the one at the smallest count; target 1.5x.\n"
    );
    let _ = writeln!(
        md,
        "| curve | from | to | us per op, first | us per op, last | growth | within 1.5x |\n|---|---|---|---|---|---|---|"
    );
    for c in &curves {
        let (first, last) = (c.points.first(), c.points.last());
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {} |",
            c.curve,
            first.map_or(0, |p| p.x),
            last.map_or(0, |p| p.x),
            first.map_or(0.0, |p| p.per_op_us),
            last.map_or(0.0, |p| p.per_op_us),
            c.growth,
            if c.within_target { "yes" } else { "no" }
        );
    }
    let _ = writeln!(md);
    for c in &curves {
        let file = format!("scale-{}.svg", c.curve.replace(' ', "-"));
        chart(c).save(&out.join(&file))?;
        let _ = writeln!(md, "### {}\n\n![{}]({file})\n", c.curve, c.curve);
        let _ =
            writeln!(md, "| {} | us per op | ops/s | bytes per unit |\n|---|---|---|---|", c.unit);
        for p in &c.points {
            let per = p.bytes_per_unit.map_or("-".to_string(), |b| format!("{b:.0}"));
            let _ = writeln!(md, "| {} | {:.2} | {:.0} | {per} |", p.x, p.per_op_us, p.ops_per_s);
        }
        let _ = writeln!(md);
        plots.push(file);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_as_counts() {
        assert_eq!(count_label(1.0), "1");
        assert_eq!(count_label(30.0), "30");
        assert_eq!(count_label(3000.0), "3k");
        assert_eq!(count_label(100_000.0), "100k");
        assert_eq!(count_label(1_000_000.0), "1M");
        assert_eq!(count_label(4096.0), "4096");
    }
}
