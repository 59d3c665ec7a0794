//! Line charts as PNG files, drawn with a small rasteriser and a built-in 5x7 bitmap font (no
//! system fonts or font libraries, so `tensorwire bench` works on a bare machine).

use std::path::Path;

/// An RGB colour.
pub(crate) type Rgb = [u8; 3];

/// Series colours, in order.
pub(crate) const PALETTE: [Rgb; 6] =
    [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189], [140, 86, 75]];

fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        '/' => [0, 0x01, 0x02, 0x04, 0x08, 0x10, 0],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        _ => [0; 7],
    }
}

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Canvas {
        Canvas { w, h, px: vec![255; w * h * 3] }
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn line(&mut self, from: (i64, i64), to: (i64, i64), c: Rgb, thick: i64) {
        self.stroke(from, to, c, thick, false);
    }

    /// A line; `dashed` leaves every other run of 8 pixels out.
    fn stroke(
        &mut self,
        (x0, y0): (i64, i64),
        (x1, y1): (i64, i64),
        c: Rgb,
        thick: i64,
        dashed: bool,
    ) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        let mut n = 0u32;
        loop {
            n += 1;
            if !dashed || (n / 8) % 2 == 0 {
                for ox in 0..thick {
                    for oy in 0..thick {
                        self.set(x + ox, y + oy, c);
                    }
                }
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    fn rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// Text at scale 2 (10x14 pixel glyphs, 12 pixels apart).
    fn text(&mut self, x: i64, y: i64, s: &str, c: Rgb) {
        for (i, ch) in s.chars().enumerate() {
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0x10 >> col) != 0 {
                        self.rect(x + i as i64 * 12 + col * 2, y + row as i64 * 2, 2, 2, c);
                    }
                }
            }
        }
    }

    fn save(&self, path: &Path) -> Result<(), String> {
        let f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(f), self.w as u32, self.h as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc.write_header().map_err(|e| format!("{}: {e}", path.display()))?;
        w.write_image_data(&self.px).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Text width in pixels at the canvas's text scale.
fn width(s: &str) -> i64 {
    s.chars().count() as i64 * 12
}

/// One line of a chart.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    /// Legend text.
    pub(crate) name: String,
    /// Colour.
    pub(crate) color: Rgb,
    /// Points (x, y), drawn in order.
    pub(crate) points: Vec<(f64, f64)>,
    /// Dashed (for baselines).
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
    /// Log2 x axis (sizes).
    pub(crate) log_x: bool,
    /// Formats an x tick.
    pub(crate) x_fmt: fn(f64) -> String,
    /// The lines.
    pub(crate) series: Vec<Series>,
    /// Fixed top of the y axis (default: from the data).
    pub(crate) y_max: Option<f64>,
}

fn nice_max(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * p >= v {
            return m * p;
        }
    }
    10.0 * p
}

fn fmt_y(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

impl Chart {
    /// Renders to a PNG of 960x560 pixels.
    pub(crate) fn save(&self, path: &Path) -> Result<(), String> {
        let (w, h) = (960i64, 560i64);
        let mut c = Canvas::new(w as usize, h as usize);
        // The legend sits between the title and the plot, never over the data.
        let (l, r, t, b) = (100i64, 30i64, 80 + 22 * self.series.len() as i64, 80i64);
        let (pw, ph) = (w - l - r, h - t - b);
        let pts = self.series.iter().flat_map(|s| s.points.iter().copied());
        let tx = |x: f64| if self.log_x { x.max(1e-12).log2() } else { x };
        let (mut x0, mut x1, mut ymax) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
        for (x, y) in pts {
            x0 = x0.min(tx(x));
            x1 = x1.max(tx(x));
            ymax = ymax.max(y);
        }
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let ymax = self.y_max.unwrap_or_else(|| nice_max(ymax * 1.05));
        let px = |x: f64| l + ((tx(x) - x0) / (x1 - x0) * pw as f64).round() as i64;
        let py = |y: f64| t + ph - (y / ymax * ph as f64).round() as i64;
        let ink = [40, 40, 40];
        let grid = [225, 225, 225];
        c.text((w - width(&self.title)) / 2, 20, &self.title, ink);
        for k in 0..=5 {
            let y = ymax * f64::from(k) / 5.0;
            c.line((l, py(y)), (l + pw, py(y)), grid, 1);
            let s = fmt_y(y);
            c.text(l - 10 - width(&s), py(y) - 7, &s, ink);
        }
        let mut xs: Vec<f64> =
            self.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let step = (xs.len() / 8).max(1);
        let mut last_end = i64::MIN;
        for x in xs.iter().step_by(step) {
            let s = (self.x_fmt)(*x);
            let at = px(*x) - width(&s) / 2;
            c.line((px(*x), t + ph), (px(*x), t + ph + 6), ink, 1);
            if at > last_end + 8 {
                c.text(at, t + ph + 12, &s, ink);
                last_end = at + width(&s);
            }
        }
        c.line((l, t), (l, t + ph), ink, 2);
        c.line((l, t + ph), (l + pw, t + ph), ink, 2);
        c.text(l + (pw - width(&self.x_label)) / 2, h - 34, &self.x_label, ink);
        c.text(10, t - 26, &self.y_label, ink);
        for s in &self.series {
            for win in s.points.windows(2) {
                c.stroke(
                    (px(win[0].0), py(win[0].1)),
                    (px(win[1].0), py(win[1].1)),
                    s.color,
                    3,
                    s.dashed,
                );
            }
            for &(x, y) in &s.points {
                c.rect(px(x) - 3, py(y) - 3, 7, 7, s.color);
            }
        }
        for (i, s) in self.series.iter().enumerate() {
            let y = 50 + i as i64 * 22;
            c.rect(l + 16, y + 2, 18, 10, s.color);
            c.text(l + 42, y, &s.name, ink);
        }
        c.save(path)
    }
}
