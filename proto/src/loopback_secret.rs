//! The secret a process uses with peers on loopback when it was given none: one per user, made
//! on first use and kept in a file only that user can read, so every process of the user finds
//! the same one and a process of another user on the same host (who can reach every loopback
//! port) cannot prove it. Without it, anyone on a shared GPU host who found the port would get
//! the region keys in the handshake and read or overwrite payloads.
//!
//! Where it lives, first that applies:
//! 1. `$TENSORWIRE_LOOPBACK_SECRET` (a file path);
//! 2. `$XDG_CONFIG_HOME/tensorwire/loopback-secret`, else `~/.config/tensorwire/loopback-secret`
//!    (`~` is `$HOME`, else the user's home in the password database; kept across logins: a
//!    server started before a logout still matches clients started after);
//! 3. `$XDG_RUNTIME_DIR/tensorwire/loopback-secret` where there is no writable home;
//! 4. `/tmp/tensorwire-UID/loopback-secret` where there is neither.
//!
//! Its folder is made with mode 0700 and must belong to the user with no group or other write
//! bit; the file must belong to the user with mode 0600 (the checks of
//! [`ClusterSecret::from_file`]). Two processes that start at once make it once: the secret is
//! written to a temporary file and linked into place, and the loser of the race reads the
//! winner's. The cost: processes of two users, or of one user with different home folders (two
//! containers sharing a network namespace), need an explicit shared secret to talk over loopback.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::auth::{ClusterSecret, nonce};
use crate::error::{Error, Result};

/// The environment variable naming the loopback secret's file.
pub const ENV: &str = "TENSORWIRE_LOOPBACK_SECRET";

/// This process's loopback secret (see the module docs), read or made once per process.
pub fn loopback_secret() -> Result<ClusterSecret> {
    static SECRET: OnceLock<std::result::Result<ClusterSecret, String>> = OnceLock::new();
    SECRET
        .get_or_init(|| {
            let path = default_path().map_err(|e| e.to_string())?;
            load_or_create(&path).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|why| {
            Error::InvalidArgument(format!(
                "no loopback secret: {why} (peers on loopback authenticate with a per-user \
                 secret when no cluster secret is given: set {ENV} to a file path, or give a \
                 cluster secret)"
            ))
        })
}

/// Where this process's loopback secret lives (see the module docs).
pub(crate) fn default_path() -> Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var(ENV) {
        return Ok(p);
    }
    let home = var("HOME").or_else(home_of_user);
    let config = var("XDG_CONFIG_HOME").or_else(|| home.map(|h| h.join(".config")));
    let runtime = var("XDG_RUNTIME_DIR");
    let file = |d: PathBuf| d.join("tensorwire").join("loopback-secret");
    Ok(match (config, runtime) {
        (Some(c), _) if writable_or_creatable(&c) => file(c),
        (_, Some(r)) => file(r),
        _ => PathBuf::from(format!("/tmp/tensorwire-{}", uid())).join("loopback-secret"),
    })
}

/// This user's home folder in the password database.
fn home_of_user() -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0u8; 4096];
    // SAFETY: a zeroed passwd is a valid value for getpwuid_r to overwrite.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call: `pw` and `found` are locals, `buf` is
    // writable for its length; getpwuid_r writes the strings into `buf`.
    let rc =
        unsafe { libc::getpwuid_r(uid(), &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut found) };
    if rc != 0 || found.is_null() || pw.pw_dir.is_null() {
        return None;
    }
    // SAFETY: on success `pw_dir` points at a NUL-terminated string inside `buf`, alive here.
    let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
    let dir = std::path::Path::new(std::ffi::OsStr::from_bytes(dir.to_bytes()));
    (!dir.as_os_str().is_empty()).then(|| dir.to_path_buf())
}

/// Whether `dir` exists and is writable, or can be made (its nearest existing ancestor is
/// writable).
fn writable_or_creatable(dir: &Path) -> bool {
    let mut d = dir;
    loop {
        if d.exists() {
            return access_w(d);
        }
        match d.parent() {
            Some(p) => d = p,
            None => return false,
        }
    }
}

fn access_w(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else { return false };
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Reads the secret in `path`, or makes one there if there is none; the folder and the file
/// must be this user's and private (see the module docs).
pub(crate) fn load_or_create(path: &Path) -> Result<ClusterSecret> {
    let shown = path.display();
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .ok_or_else(|| Error::InvalidArgument(format!("loopback secret {shown}: no folder")))?;
    private_dir(dir)?;
    for _ in 0..3 {
        match std::fs::symlink_metadata(path) {
            Ok(meta) => {
                if !meta.is_file() || meta.uid() != uid() {
                    return Err(Error::InvalidArgument(format!(
                        "loopback secret {shown} is not a file of uid {} (found uid {}): \
                         remove it, or set {ENV}",
                        uid(),
                        meta.uid()
                    )));
                }
                return ClusterSecret::from_file(path);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(made) = create(dir, path)? {
                    return Ok(made);
                }
                // Another process linked its file first: read that one.
            }
            Err(e) => return Err(Error::InvalidArgument(format!("loopback secret {shown}: {e}"))),
        }
    }
    Err(Error::InvalidArgument(format!("loopback secret {shown}: it keeps changing")))
}

/// Makes the folder (mode 0700) or checks that it is this user's and that nobody else can write
/// it.
fn private_dir(dir: &Path) -> Result<()> {
    let shown = dir.display();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| Error::InvalidArgument(format!("loopback secret folder {shown}: {e}")))?;
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| Error::InvalidArgument(format!("loopback secret folder {shown}: {e}")))?;
    let mode = meta.mode() & 0o777;
    if !meta.is_dir() || meta.uid() != uid() || mode & 0o022 != 0 {
        return Err(Error::InvalidArgument(format!(
            "loopback secret folder {shown} must be a folder of uid {} that only it can write \
             (found uid {}, mode {mode:03o})",
            uid(),
            meta.uid()
        )));
    }
    Ok(())
}

/// Writes a new secret to a temporary file in `dir` and links it to `path`; `None` when another
/// process linked its own first.
fn create(dir: &Path, path: &Path) -> Result<Option<ClusterSecret>> {
    let err = |e: std::io::Error| {
        Error::InvalidArgument(format!("loopback secret {}: {e}", path.display()))
    };
    let tmp =
        dir.join(format!(".loopback-secret-{}-{:016x}", std::process::id(), rand::random::<u64>()));
    let bytes = nonce();
    let mut text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    text.push('\n');
    let written = (|| {
        let mut f =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()
    })();
    let linked = written.and_then(|()| std::fs::hard_link(&tmp, path));
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(Some(ClusterSecret::new(bytes))),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(None),
        Err(e) => Err(err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "tw-loopback-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn made_once_then_read_back_by_everyone() {
        let d = dir();
        let p = d.join("sub").join("secret");
        let made = load_or_create(&p).unwrap();
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(p.parent().unwrap()).unwrap().mode() & 0o777, 0o700);
        assert_eq!(load_or_create(&p).unwrap(), made);
        // Made by many at once: one secret, no temporary file left.
        let p2 = d.join("race");
        let all: Vec<_> = (0..8)
            .map(|_| {
                let p2 = p2.clone();
                std::thread::spawn(move || load_or_create(&p2).unwrap())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(all.iter().all(|s| *s == all[0]));
        let left: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.iter().all(|n| !n.to_string_lossy().starts_with(".loopback")), "{left:?}");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn the_users_home_is_found_without_home_set() {
        let home = home_of_user().expect("this user has a home in the password database");
        assert!(home.is_absolute(), "{home:?}");
        assert!(default_path().unwrap().ends_with("loopback-secret"));
    }

    #[test]
    fn an_open_folder_or_file_is_refused() {
        let d = dir();
        let open = d.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = load_or_create(&open.join("secret")).unwrap_err().to_string();
        assert!(e.contains("only it can write") && e.contains("777"), "{e}");
        let shown = d.join("shown");
        load_or_create(&shown).unwrap();
        std::fs::set_permissions(&shown, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load_or_create(&shown).unwrap_err().to_string();
        assert!(e.contains("readable by group or others"), "{e}");
        let link = d.join("link");
        std::os::unix::fs::symlink(&shown, &link).unwrap();
        let e = load_or_create(&link).unwrap_err().to_string();
        assert!(e.contains("is not a file"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }
}
