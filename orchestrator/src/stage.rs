//! The pipeline's stages, written once: their order, index, name and wire tag.

use tensorwire_core::{Error, Result};
use tensorwire_proto::wire::codec::{Reader, Writer};

/// Pipeline stages, in pipeline order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Condition encode.
    Encode,
    /// DiT denoise.
    Denoise,
    /// VAE decode.
    Decode,
}

impl Stage {
    /// Every stage, in pipeline order (`Stage::ALL[s.index()] == s`).
    pub const ALL: [Stage; 3] = [Stage::Encode, Stage::Denoise, Stage::Decode];

    /// Position in the pipeline: 0, 1, 2 (for per-stage arrays).
    pub const fn index(self) -> usize {
        match self {
            Stage::Encode => 0,
            Stage::Denoise => 1,
            Stage::Decode => 2,
        }
    }

    /// Lower-case name ("encode", "denoise", "decode").
    pub const fn name(self) -> &'static str {
        match self {
            Stage::Encode => "encode",
            Stage::Denoise => "denoise",
            Stage::Decode => "decode",
        }
    }

    /// The stage after this one, if any.
    pub fn next(self) -> Option<Stage> {
        Stage::ALL.get(self.index() + 1).copied()
    }

    /// The stage before this one, if any (the producer of this stage's inputs).
    pub fn prev(self) -> Option<Stage> {
        self.index().checked_sub(1).map(|i| Stage::ALL[i])
    }

    /// Appends the wire tag (the index).
    pub fn encode(self, w: &mut Writer) {
        w.u8(self.index() as u8);
    }

    /// Reads a wire tag; never panics.
    pub fn decode(r: &mut Reader<'_>) -> Result<Stage> {
        let t = r.u8()?;
        Stage::ALL
            .get(usize::from(t))
            .copied()
            .ok_or_else(|| Error::protocol(format!("unknown stage tag {t}")))
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
