//! Stage profiles of real models (`models.toml`): read from a path, or the copy shipped in this
//! crate so a fresh clone works without the shared workload directory.

use std::path::Path;

use crate::Result;
use serde::{Deserialize, Serialize};

/// The profiles shipped with the binary (a copy of shared/workloads/models.toml).
pub const SHIPPED: &str = include_str!("../profiles/models.toml");

/// One model's profile (bytes and milliseconds).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Model {
    /// Name.
    pub name: String,
    /// Denoising steps.
    pub steps: u32,
    /// Condition embedding bytes.
    pub embed_bytes: u64,
    /// Latent shape (bf16).
    pub latent_shape: Vec<u64>,
    /// Latent bytes.
    pub latent_bytes: u64,
    /// Encode time per request.
    pub encode_ms: f64,
    /// Time per denoising step.
    pub step_ms: f64,
    /// Decode time per request.
    pub decode_ms: f64,
    /// Classifier-free guidance: each step runs the DiT on two branches.
    #[serde(default)]
    pub cfg: bool,
    /// Weights per stage, GB (the capacity model; absent: assumed to fit).
    #[serde(default)]
    pub weights_gb: Option<PerStage>,
    /// Peak activations per stage, GB.
    #[serde(default)]
    pub act_gb: Option<PerStage>,
    /// Times measured on GPU classes other than the reference.
    #[serde(default)]
    pub measured: Vec<Measured>,
}

/// A figure per stage.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize)]
pub struct PerStage {
    /// Condition encode.
    pub encode: f64,
    /// DiT denoise.
    pub denoise: f64,
    /// VAE decode.
    pub decode: f64,
}

impl PerStage {
    /// The figure of `stage`.
    pub fn get(&self, stage: tensorwire_orchestrator::Stage) -> f64 {
        [self.encode, self.denoise, self.decode][stage.index()]
    }
}

/// Times measured on one GPU class.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Measured {
    /// The class (a name from gpus.toml).
    pub class: String,
    /// With only that stage's model on the GPU.
    #[serde(default)]
    pub alone: Times,
    /// With the whole pipeline on one GPU.
    #[serde(default)]
    pub colocated: Times,
}

/// Measured times (ms); a missing one is derived.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize)]
pub struct Times {
    /// Encode per request.
    pub encode_ms: Option<f64>,
    /// Per denoising step.
    pub step_ms: Option<f64>,
    /// Decode per request.
    pub decode_ms: Option<f64>,
}

impl Times {
    /// The time of `stage` (per step for denoise).
    pub fn get(&self, stage: tensorwire_orchestrator::Stage) -> Option<f64> {
        [self.encode_ms, self.step_ms, self.decode_ms][stage.index()]
    }
}

impl Model {
    /// Denoise time per request.
    pub fn denoise_ms(&self) -> f64 {
        self.step_ms * f64::from(self.steps)
    }

    /// Temporal chunks for a chunked latent handoff (video: 3 latent frames per chunk).
    pub fn chunks(&self) -> Option<(u32, u32)> {
        (self.latent_shape.len() == 4 && self.latent_shape[1] >= 3).then(|| {
            let t = self.latent_shape[1] as u32;
            (1, (t / 3).max(1))
        })
    }
}

#[derive(Debug, Deserialize)]
struct File {
    model: Vec<Model>,
}

/// Parses profiles; the error names the file and what is wrong.
pub fn parse(text: &str, origin: &str) -> Result<Vec<Model>> {
    let f: File = toml::from_str(text)
        .map_err(|e| format!("{origin}: not a valid profile file: {}", e.message()))?;
    for m in &f.model {
        for (what, v) in [("weights_gb", m.weights_gb), ("act_gb", m.act_gb)] {
            let Some(v) = v else { continue };
            if [v.encode, v.denoise, v.decode].iter().any(|x| !x.is_finite() || *x < 0.0) {
                return Err(format!("{origin}: model {}: {what} must be >= 0", m.name).into());
            }
        }
        let times = m.measured.iter().flat_map(|x| [x.alone, x.colocated]);
        let bad = |t: Option<f64>| t.is_some_and(|x| !x.is_finite() || x <= 0.0);
        if times.clone().any(|t| bad(t.encode_ms) || bad(t.step_ms) || bad(t.decode_ms))
            || [m.encode_ms, m.step_ms, m.decode_ms].iter().any(|x| !x.is_finite() || *x < 0.0)
        {
            return Err(format!("{origin}: model {}: times must be finite and > 0", m.name).into());
        }
        let elems: u64 = m.latent_shape.iter().product();
        if elems * 2 != m.latent_bytes {
            return Err(format!(
                "{origin}: model {}: latent_shape {:?} is {} bf16 bytes, latent_bytes says {}",
                m.name,
                m.latent_shape,
                elems * 2,
                m.latent_bytes
            )
            .into());
        }
    }
    if f.model.is_empty() {
        return Err(format!("{origin}: no [[model]] entries").into());
    }
    Ok(f.model)
}

/// Profiles from `path`, or the shipped copy.
pub fn load(path: Option<&Path>) -> Result<Vec<Model>> {
    match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("{}: cannot read: {e}", p.display()))?;
            parse(&text, &p.display().to_string())
        }
        None => parse(SHIPPED, "built-in models.toml"),
    }
}

/// `models` as a profile file ([`parse`] reads it back).
pub fn to_toml(models: &[Model]) -> Result<String> {
    #[derive(Serialize)]
    struct Out<'a> {
        model: &'a [Model],
    }
    toml::to_string(&Out { model: models }).map_err(|e| format!("writing profiles: {e}").into())
}

/// Looks up models by name; the error lists the known names.
pub fn pick<'a>(all: &'a [Model], names: &[String]) -> Result<Vec<&'a Model>> {
    names
        .iter()
        .map(|n| {
            all.iter().find(|m| &m.name == n).ok_or_else(|| {
                let known: Vec<&str> = all.iter().map(|m| m.name.as_str()).collect();
                format!("unknown model {n:?}; known: {}", known.join(", ")).into()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_profiles_parse() {
        let all = load(None).unwrap();
        assert!(all.len() >= 6);
        let wan = &pick(&all, &["wan2.1-t2v-1.3b-480p".into()]).unwrap()[0];
        assert_eq!(wan.chunks(), Some((1, 7)));
        assert!(pick(&all, &["nope".into()]).unwrap_err().0.contains("known:"));
        assert!(parse("model = 3", "x").unwrap_err().0.starts_with("x: not a valid profile file"));
        let back = parse(&to_toml(&all).unwrap(), "written").unwrap();
        assert_eq!(back.len(), all.len());
        assert_eq!(back[6].measured[0].alone.step_ms, Some(1880.0));
    }
}
