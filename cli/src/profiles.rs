//! Stage profiles of real models (`models.toml`): read from a path, or the copy shipped in this
//! crate so a fresh clone works without the shared workload directory.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The profiles shipped with the binary (a copy of shared/workloads/models.toml).
pub(crate) const SHIPPED: &str = include_str!("../profiles/models.toml");

/// One model's profile (bytes and milliseconds).
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct Model {
    /// Name.
    pub(crate) name: String,
    /// Denoising steps.
    pub(crate) steps: u32,
    /// Condition embedding bytes.
    pub(crate) embed_bytes: u64,
    /// Latent shape (bf16).
    pub(crate) latent_shape: Vec<u64>,
    /// Latent bytes.
    pub(crate) latent_bytes: u64,
    /// Encode time per request.
    pub(crate) encode_ms: f64,
    /// Time per denoising step.
    pub(crate) step_ms: f64,
    /// Decode time per request.
    pub(crate) decode_ms: f64,
    /// Classifier-free guidance: each step runs the DiT on two branches.
    #[serde(default)]
    pub(crate) cfg: bool,
    /// Weights per stage, GB (the capacity model; absent: assumed to fit).
    #[serde(default)]
    pub(crate) weights_gb: Option<PerStage>,
    /// Peak activations per stage, GB.
    #[serde(default)]
    pub(crate) act_gb: Option<PerStage>,
    /// Times measured on GPU classes other than the reference.
    #[serde(default)]
    pub(crate) measured: Vec<Measured>,
}

/// A figure per stage.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize)]
pub(crate) struct PerStage {
    /// Condition encode.
    pub(crate) encode: f64,
    /// DiT denoise.
    pub(crate) denoise: f64,
    /// VAE decode.
    pub(crate) decode: f64,
}

impl PerStage {
    /// The figure of `stage`.
    pub(crate) fn get(&self, stage: tensorwire_orchestrator::Stage) -> f64 {
        [self.encode, self.denoise, self.decode][stage.index()]
    }
}

/// Times measured on one GPU class.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct Measured {
    /// The class (a name from gpus.toml).
    pub(crate) class: String,
    /// With only that stage's model on the GPU.
    #[serde(default)]
    pub(crate) alone: Times,
    /// With the whole pipeline on one GPU.
    #[serde(default)]
    pub(crate) colocated: Times,
}

/// Measured times (ms); a missing one is derived.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize)]
pub(crate) struct Times {
    /// Encode per request.
    pub(crate) encode_ms: Option<f64>,
    /// Per denoising step.
    pub(crate) step_ms: Option<f64>,
    /// Decode per request.
    pub(crate) decode_ms: Option<f64>,
}

impl Times {
    /// The time of `stage` (per step for denoise).
    pub(crate) fn get(&self, stage: tensorwire_orchestrator::Stage) -> Option<f64> {
        [self.encode_ms, self.step_ms, self.decode_ms][stage.index()]
    }
}

impl Model {
    /// Denoise time per request.
    pub(crate) fn denoise_ms(&self) -> f64 {
        self.step_ms * f64::from(self.steps)
    }

    /// Temporal chunks for a chunked latent handoff (video: 3 latent frames per chunk).
    pub(crate) fn chunks(&self) -> Option<(u32, u32)> {
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
pub(crate) fn parse(text: &str, origin: &str) -> Result<Vec<Model>, String> {
    let f: File = toml::from_str(text)
        .map_err(|e| format!("{origin}: not a valid profile file: {}", e.message()))?;
    for m in &f.model {
        for (what, v) in [("weights_gb", m.weights_gb), ("act_gb", m.act_gb)] {
            let Some(v) = v else { continue };
            if [v.encode, v.denoise, v.decode].iter().any(|x| !x.is_finite() || *x < 0.0) {
                return Err(format!("{origin}: model {}: {what} must be >= 0", m.name));
            }
        }
        let times = m.measured.iter().flat_map(|x| [x.alone, x.colocated]);
        let bad = |t: Option<f64>| t.is_some_and(|x| !x.is_finite() || x <= 0.0);
        if times.clone().any(|t| bad(t.encode_ms) || bad(t.step_ms) || bad(t.decode_ms))
            || [m.encode_ms, m.step_ms, m.decode_ms].iter().any(|x| !x.is_finite() || *x < 0.0)
        {
            return Err(format!("{origin}: model {}: times must be finite and > 0", m.name));
        }
        let elems: u64 = m.latent_shape.iter().product();
        if elems * 2 != m.latent_bytes {
            return Err(format!(
                "{origin}: model {}: latent_shape {:?} is {} bf16 bytes, latent_bytes says {}",
                m.name,
                m.latent_shape,
                elems * 2,
                m.latent_bytes
            ));
        }
    }
    if f.model.is_empty() {
        return Err(format!("{origin}: no [[model]] entries"));
    }
    Ok(f.model)
}

/// Profiles from `path`, or the shipped copy.
pub(crate) fn load(path: Option<&Path>) -> Result<Vec<Model>, String> {
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
pub(crate) fn to_toml(models: &[Model]) -> Result<String, String> {
    #[derive(Serialize)]
    struct Out<'a> {
        model: &'a [Model],
    }
    toml::to_string(&Out { model: models }).map_err(|e| format!("writing profiles: {e}"))
}

/// Looks up models by name; the error lists the known names.
pub(crate) fn pick<'a>(all: &'a [Model], names: &[String]) -> Result<Vec<&'a Model>, String> {
    names
        .iter()
        .map(|n| {
            all.iter().find(|m| &m.name == n).ok_or_else(|| {
                let known: Vec<&str> = all.iter().map(|m| m.name.as_str()).collect();
                format!("unknown model {n:?}; known: {}", known.join(", "))
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
        assert!(pick(&all, &["nope".into()]).unwrap_err().contains("known:"));
        assert!(parse("model = 3", "x").unwrap_err().starts_with("x: not a valid profile file"));
        let back = parse(&to_toml(&all).unwrap(), "written").unwrap();
        assert_eq!(back.len(), all.len());
        assert_eq!(back[6].measured[0].alone.step_ms, Some(1880.0));
    }
}
