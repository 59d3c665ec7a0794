//! GPU classes (`profiles/gpus.toml`): memory, links, relative speed and price of each kind of
//! GPU a pool may run on.

use std::path::Path;

use crate::Result;
use serde::Deserialize;

/// The classes shipped with the binary.
const SHIPPED: &str = include_str!("../profiles/gpus.toml");

/// One kind of GPU (or a CPU-only host).
#[derive(Debug, Clone, Deserialize)]
pub struct GpuClass {
    /// Name (`h100`, `l40s`, ...).
    pub name: String,
    /// Memory a pool's models and activations must fit in, GB.
    pub vram_gb: f64,
    /// Memory bandwidth, GB/s.
    pub mem_bw_gbps: f64,
    /// Host link, one direction, GB/s: what offloaded weights stream over.
    pub host_link_gbps: f64,
    /// NVLink, GB/s (0: none).
    pub nvlink_gbps: f64,
    /// Speed relative to an H100 (the profiles' reference) where no time was measured.
    pub speed: f64,
    /// Rental price, US$ per hour per GPU.
    pub usd_per_hour: f64,
}

#[derive(Debug, Deserialize)]
struct File {
    class: Vec<GpuClass>,
}

/// Parses classes; the error names the file and what is wrong.
pub fn parse(text: &str, origin: &str) -> Result<Vec<GpuClass>> {
    let f: File = toml::from_str(text)
        .map_err(|e| format!("{origin}: not a valid GPU class file: {}", e.message()))?;
    for c in &f.class {
        let figures = [c.vram_gb, c.mem_bw_gbps, c.host_link_gbps, c.speed, c.usd_per_hour];
        if figures.iter().any(|x| !x.is_finite() || *x <= 0.0) || c.nvlink_gbps < 0.0 {
            return Err(format!("{origin}: class {}: every figure must be > 0", c.name).into());
        }
    }
    if f.class.is_empty() {
        return Err(format!("{origin}: no [[class]] entries").into());
    }
    Ok(f.class)
}

/// Classes from `path`, or the shipped ones.
pub fn load(path: Option<&Path>) -> Result<Vec<GpuClass>> {
    match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("{}: cannot read: {e}", p.display()))?;
            parse(&text, &p.display().to_string())
        }
        None => parse(SHIPPED, "built-in gpus.toml"),
    }
}

/// Looks up a class by name; the error lists the known names.
pub fn pick<'a>(all: &'a [GpuClass], name: &str) -> Result<&'a GpuClass> {
    all.iter().find(|c| c.name == name).ok_or_else(|| {
        let known: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
        format!("unknown GPU class {name:?}; known: {}", known.join(", ")).into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_classes_parse() {
        let all = load(None).unwrap();
        for name in ["h200", "h100", "a100-80gb", "a100-40gb", "l40s", "rtx4090", "cpu"] {
            pick(&all, name).unwrap();
        }
        assert!(pick(&all, "tpu").unwrap_err().0.contains("known: h200"));
        let bad = "[[class]]\nname='x'\nvram_gb=0.0\nmem_bw_gbps=1.0\nhost_link_gbps=1.0\nnvlink_gbps=0.0\nspeed=1.0\nusd_per_hour=1.0\n";
        assert!(parse(bad, "f").unwrap_err().0.contains("class x"));
    }
}
