//! Stage profiles of real models (`models.toml`): read from a path, or the copy shipped in this
//! crate so a fresh clone works without the shared workload directory.

use std::path::Path;

use serde::Deserialize;

/// The profiles shipped with the binary (a copy of shared/workloads/models.toml).
pub(crate) const SHIPPED: &str = include_str!("../profiles/models.toml");

/// One model's profile (bytes and milliseconds).
#[derive(Debug, Clone, Deserialize)]
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
    }
}
