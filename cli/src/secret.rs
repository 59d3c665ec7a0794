//! `tensorwire secret new FILE`: writes a fresh cluster secret (32 random bytes in hex, mode
//! 0600) for `--secret-file`; and reading one for `serve` and `worker`, with the library's checks
//! (private to its owner, at least 16 random-looking bytes).

use std::path::{Path, PathBuf};

use tensorwire_core::ClusterSecret;

/// `secret` subcommands.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum SecretCmd {
    /// Write a new random cluster secret to FILE (mode 0600; FILE must not exist). Copy the same
    /// file to every host of the cluster and pass it with `--secret-file`.
    New {
        /// Where to write it.
        file: PathBuf,
    },
}

/// Runs `secret`.
pub(crate) fn run(cmd: SecretCmd) -> anyhow::Result<()> {
    match cmd {
        SecretCmd::New { file } => {
            ClusterSecret::create_file(&file)?;
            println!("wrote a new cluster secret to {} (mode 0600)", file.display());
            Ok(())
        }
    }
}

/// The secret in `path`, if one is given.
pub(crate) fn read(path: Option<&Path>) -> anyhow::Result<Option<ClusterSecret>> {
    path.map(|p| ClusterSecret::from_file(p).map_err(anyhow::Error::from)).transpose()
}
