//! Charts as SVG files, drawn with `plotters` (its SVG backend writes text as SVG text, so no
//! font files are needed and the files embed cleanly in report.md).

use std::path::Path;

use plotters::prelude::*;

/// An RGB colour.
pub(crate) type Rgb = [u8; 3];

/// Series colours, in order.
pub(crate) const PALETTE: [Rgb; 6] =
    [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189], [140, 86, 75]];

/// Size of every chart, pixels.
const SIZE: (u32, u32) = (960, 560);

/// One line of a chart.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    /// Legend text.
    pub(crate) name: String,
    /// Colour.
    pub(crate) color: Rgb,
    /// (x, y) points, in x order.
    pub(crate) points: Vec<(f64, f64)>,
    /// Dashed (e.g. the raw medium next to the backend).
    pub(crate) dashed: bool,
}

/// A line chart.
#[derive(Debug, Clone)]
pub(crate) struct Chart {
    /// Title.
    pub(crate) title: String,
    /// X axis label.
    pub(crate) x_label: String,
    /// Y axis label.
    pub(crate) y_label: String,
    /// Log-scaled x axis (base 2: ticks at powers of two, as op sizes are).
    pub(crate) log_x: bool,
    /// X tick label of a data value; ticks fall on whole numbers (whole powers of two with
    /// `log_x`).
    pub(crate) x_fmt: fn(f64) -> String,
    /// The lines.
    pub(crate) series: Vec<Series>,
    /// Y axis top (default: fitted to the data).
    pub(crate) y_max: Option<f64>,
}

fn color(c: Rgb) -> RGBColor {
    RGBColor(c[0], c[1], c[2])
}

fn fail(path: &Path) -> impl Fn(String) -> anyhow::Error + '_ {
    move |e| anyhow::anyhow!("{}: drawing the chart: {e}", path.display())
}

/// The data's x range and y top, never empty.
fn ranges(points: impl Iterator<Item = (f64, f64)>, y_max: Option<f64>) -> ((f64, f64), f64) {
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
    for (x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y1 = y_max.unwrap_or(if y1 > 0.0 { y1 * 1.1 } else { 1.0 });
    ((x0, x1), y1)
}

impl Chart {
    /// The points as drawn: x in log2 units with `log_x`.
    fn drawn(&self, s: &Series) -> Vec<(f64, f64)> {
        let x = |v: f64| if self.log_x { v.max(f64::MIN_POSITIVE).log2() } else { v };
        s.points.iter().map(|&(a, b)| (x(a), b)).collect()
    }

    /// Writes the chart as an SVG file.
    pub(crate) fn save(&self, path: &Path) -> anyhow::Result<()> {
        let root = SVGBackend::new(path, SIZE).into_drawing_area();
        let e = fail(path);
        root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
        let series: Vec<Vec<(f64, f64)>> = self.series.iter().map(|s| self.drawn(s)).collect();
        let ((x0, x1), y1) = ranges(series.iter().flatten().copied(), self.y_max);
        // A tick on each whole number when they are few, so labels never repeat.
        let span = (x1 - x0).ceil();
        let x_ticks = if span <= 24.0 { span as usize + 1 } else { 12 };
        let x_fmt = |x: &f64| {
            if (x - x.round()).abs() > 1e-6 {
                String::new()
            } else if self.log_x {
                (self.x_fmt)(x.round().exp2())
            } else {
                (self.x_fmt)(x.round())
            }
        };
        let y_fmt = |y: &f64| fmt_y(*y);
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(x0..x1, 0.0..y1)
            .map_err(|x| e(x.to_string()))?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_labels(x_ticks)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(|x| e(x.to_string()))?;
        for (s, pts) in self.series.iter().zip(series) {
            let c = color(s.color);
            let style = c.stroke_width(3);
            let drawn = if s.dashed {
                chart.draw_series(DashedLineSeries::new(pts.iter().copied(), 10, 6, style))
            } else {
                chart.draw_series(LineSeries::new(pts.iter().copied(), style))
            };
            drawn
                .map_err(|x| e(x.to_string()))?
                .label(s.name.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 18, y + 5)], c.filled()));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(|x| e(x.to_string()))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .draw()
            .map_err(|x| e(x.to_string()))?;
        root.present().map_err(|x| e(x.to_string()))
    }
}

/// A labelled point of a [`scatter`] chart.
#[derive(Debug, Clone)]
pub(crate) struct Labelled {
    /// Label drawn next to the point.
    pub(crate) label: String,
    /// X.
    pub(crate) x: f64,
    /// Y.
    pub(crate) y: f64,
    /// Colour.
    pub(crate) color: Rgb,
}

/// Writes a scatter chart of labelled points as an SVG file (e.g. layouts by throughput and
/// p99 TTFF).
pub(crate) fn scatter(
    path: &Path,
    title: &str,
    axes: (&str, &str),
    points: &[Labelled],
) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let e = fail(path);
    root.fill(&WHITE).map_err(|x| e(x.to_string()))?;
    let ((x0, x1), y1) = ranges(points.iter().map(|p| (p.x, p.y)), None);
    let pad = (x1 - x0) * 0.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d((x0 - pad).max(0.0)..x1 + pad * 3.0, 0.0..y1)
        .map_err(|x| e(x.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .y_label_formatter(&|y| fmt_y(*y))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|x| e(x.to_string()))?;
    // Points are numbered on the chart and named in the legend, so that close points stay
    // readable.
    for (i, p) in points.iter().enumerate() {
        let c = color(p.color);
        chart
            .draw_series([Circle::new((p.x, p.y), 6, c.filled())])
            .map_err(|x| e(x.to_string()))?
            .label(format!("{}: {}", i + 1, p.label))
            .legend(move |(x, y)| Circle::new((x + 8, y), 5, c.filled()));
        let number = Text::new(format!("{}", i + 1), (8, -20), ("sans-serif", 15).into_font());
        chart.draw_series([EmptyElement::at((p.x, p.y)) + number]).map_err(|x| e(x.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .draw()
        .map_err(|x| e(x.to_string()))?;
    root.present().map_err(|x| e(x.to_string()))
}

fn fmt_y(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_svg_with_their_text() {
        let dir = std::env::temp_dir().join(format!("tw-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let chart = Chart {
            title: "tcp write".into(),
            x_label: "op size".into(),
            y_label: "GB/s".into(),
            log_x: true,
            x_fmt: |x| format!("{x:.0}"),
            series: vec![
                Series {
                    name: "tcp".into(),
                    color: PALETTE[0],
                    points: vec![(1.0, 2.0), (4.0, 3.0)],
                    dashed: false,
                },
                Series {
                    name: "raw".into(),
                    color: PALETTE[1],
                    points: vec![(1.0, 2.5), (4.0, 3.5)],
                    dashed: true,
                },
            ],
            y_max: None,
        };
        let p = dir.join("c.svg");
        chart.save(&p).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("tcp write") && svg.contains("raw"));
        let q = dir.join("s.svg");
        let pts = [Labelled { label: "E|DV".into(), x: 0.3, y: 20.0, color: PALETTE[2] }];
        scatter(&q, "layouts", ("req/s", "p99 TTFF s"), &pts).unwrap();
        assert!(std::fs::read_to_string(&q).unwrap().contains("E|DV"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
