//! Cluster secrets in files, handled like ssh keys: a file readable by group or others is
//! refused, and so is a secret too short or too regular to be random. The file holds the secret
//! in hex (what [`ClusterSecret::create_file`] and `tensorwire secret new` write). Neither the
//! bytes nor the file's text ever appear in an error.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::auth::{ClusterSecret, nonce};
use crate::error::{Error, Result};

/// Fewest bytes a secret decodes to.
pub const MIN_SECRET_BYTES: usize = 16;
/// Fewest distinct byte values in a secret (a placeholder such as all zeros has one).
const MIN_DISTINCT: usize = 8;

impl ClusterSecret {
    /// Reads a secret file: the file must be private to its owner (no group or other bits, like
    /// an ssh key) and hold at least [`MIN_SECRET_BYTES`] bytes of random-looking secret in hex.
    pub fn from_file(path: &Path) -> Result<ClusterSecret> {
        let shown = path.display();
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::InvalidArgument(format!("secret file {shown}: {e}")))?;
        let mode = meta.mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(Error::InvalidArgument(format!(
                "secret file {shown} is readable by group or others (mode {mode:03o}): \
                 run `chmod 600 {shown}`"
            )));
        }
        let text = std::fs::read(path)
            .map_err(|e| Error::InvalidArgument(format!("secret file {shown}: {e}")))?;
        let bytes = decode_hex(text.trim_ascii()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "secret file {shown} does not hold a hex secret (make one with \
                 `tensorwire secret new FILE`)"
            ))
        })?;
        check_strength(&bytes)
            .map_err(|why| Error::InvalidArgument(format!("secret file {shown}: {why}")))?;
        Ok(ClusterSecret::new(bytes))
    }

    /// Writes a new random 32-byte secret to `path` (which must not exist yet) in hex, readable
    /// only by its owner (mode 0600), and returns it.
    pub fn create_file(path: &Path) -> Result<ClusterSecret> {
        let bytes = nonce();
        let mut text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        text.push('\n');
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| Error::InvalidArgument(format!("secret file {}: {e}", path.display())))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| Error::InvalidArgument(format!("secret file {}: {e}", path.display())))?;
        Ok(ClusterSecret::new(bytes))
    }
}

/// Why `bytes` cannot be a cluster secret, if it cannot.
pub(crate) fn check_strength(bytes: &[u8]) -> std::result::Result<(), String> {
    if bytes.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "the secret is {} bytes; a cluster secret needs at least {MIN_SECRET_BYTES}",
            bytes.len()
        ));
    }
    let mut seen = [false; 256];
    bytes.iter().for_each(|&b| seen[usize::from(b)] = true);
    if seen.iter().filter(|s| **s).count() < MIN_DISTINCT {
        return Err("the secret repeats a few byte values: it is not random".into());
    }
    Ok(())
}

fn decode_hex(text: &[u8]) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    text.chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir() -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("tw-secret-{}-{}", std::process::id(), nonce()[0]));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn a_created_file_reads_back_the_same_secret() {
        let d = dir();
        let p = d.join("secret");
        let made = ClusterSecret::create_file(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        assert_eq!(ClusterSecret::from_file(&p).unwrap(), made);
        let again = ClusterSecret::create_file(&p).unwrap_err().to_string();
        assert!(again.contains("exists"), "{again}");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn bad_files_are_refused_with_their_reason_and_never_their_text() {
        let d = dir();
        let p = d.join("secret");
        let good = "00112233445566778899aabbccddeeff";
        let cases = [
            (good, 0o644, "readable by group or others"),
            (good, 0o640, "readable by group or others"),
            ("0011223344556677", 0o600, "8 bytes"),
            ("00000000000000000000000000000000", 0o600, "not random"),
            ("a cluster passphrase, not hex!!", 0o600, "does not hold a hex secret"),
        ];
        for (text, mode, why) in cases {
            write(&p, text, mode);
            let e = ClusterSecret::from_file(&p).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?} {mode:o}: {e}");
            assert!(!e.contains(text), "the error shows the secret: {e}");
        }
        write(&p, &format!("{good}\n"), 0o400);
        ClusterSecret::from_file(&p).unwrap();
        std::fs::remove_dir_all(d).unwrap();
    }
}
