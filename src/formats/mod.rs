//! File formats, parsed by the libraries that define them.

pub mod safetensors_header;
pub mod spilled;

use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Write `bytes` to the file `path` atomically, as the Python package's
/// `save` does: under a temporary name in the directory of the file a
/// symbolic link at `path` leads to (followed to its end, existing or not,
/// as `realpath` does), renamed over that file once written. A failure or a
/// crash leaves it as it was, no reader sees a partial file, and the links
/// are kept. A replaced file keeps its permissions (and must be writable by
/// the caller, as `open(2)` would require); a new one is created `0o666`
/// less the umask. The temporary file is removed on any error, and every
/// error names `path`, never the temporary name.
///
/// Errors: `IsADirectory` for a directory at `path` (or a path ending in
/// `/`), `InvalidInput` for something other than a regular file there (a
/// device or FIFO is never replaced by a rename), `PermissionDenied` for a
/// file the caller may not write, else what resolving, creating, writing or
/// renaming returns.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let named = |e: io::Error| named_error(e, path);
    if path.as_os_str().as_encoded_bytes().last() == Some(&b'/') {
        // `open(2)` refuses to create a file named with a trailing slash.
        return Err(named(io::ErrorKind::IsADirectory.into()));
    }
    let real = follow_links(path).map_err(named)?;
    let existing = match std::fs::metadata(&real) {
        Ok(m) if m.is_dir() => return Err(named(io::ErrorKind::IsADirectory.into())),
        Ok(m) if !m.is_file() => {
            return Err(named(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file (ferroquant writes files, atomically)",
            )))
        }
        Ok(m) => Some(m.permissions()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(named(e)),
    };
    #[cfg(target_os = "linux")]
    if existing.is_some() {
        // The rename needs only the directory's permission: a read-only file
        // would be replaced where writing it in place is refused.
        use nix::unistd::{access, AccessFlags};
        access(&real, AccessFlags::W_OK).map_err(|e| named(e.into()))?;
    }
    let parent = match real.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(".ferroquant-").suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // The mode `open(2)` gives a new file: the umask applies to it.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut tmp = builder.tempfile_in(parent).map_err(named)?;
    tmp.write_all(bytes).map_err(named)?;
    tmp.flush().map_err(named)?;
    if let Some(p) = existing {
        tmp.as_file().set_permissions(p).map_err(named)?;
    }
    tmp.persist(&real).map(drop).map_err(|e| named(e.error))
}

/// The bytes of the regular file `path`, as `std::fs::read` reads them, but
/// checked first: a FIFO (which would block until a writer comes), a device
/// (`/dev/zero` never ends) or a directory is refused before any read. The
/// file is opened without blocking, so opening a FIFO returns at once.
///
/// Errors: `IsADirectory` for a directory, `InvalidInput` for anything else
/// that is not a regular file, else what opening or reading returns
/// (`OutOfMemory` for a file larger than the memory to hold it); each names
/// `path`.
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let named = |e: io::Error| named_error(e, path);
    // Checked before opening too: opening a FIFO, even to refuse it, would
    // release a writer blocked in its own open(2) into a pipe nobody reads.
    regular(std::fs::metadata(path).map_err(named)?.file_type()).map_err(named)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(nix::libc::O_NONBLOCK);
    }
    let mut file = options.open(path).map_err(named)?;
    // Again on what was opened: the path may have been replaced in between.
    let meta = file.metadata().map_err(named)?;
    regular(meta.file_type()).map_err(named)?;
    let mut bytes = Vec::new();
    let hint = usize::try_from(meta.len()).unwrap_or(usize::MAX);
    bytes.try_reserve_exact(hint).map_err(|_| {
        named(io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("{hint} bytes cannot be allocated"),
        ))
    })?;
    file.read_to_end(&mut bytes).map_err(named)?;
    Ok(bytes)
}

/// `IsADirectory` for a directory, `InvalidInput` for anything else that is
/// not a regular file.
fn regular(kind: std::fs::FileType) -> io::Result<()> {
    if kind.is_dir() {
        return Err(io::ErrorKind::IsADirectory.into());
    }
    if !kind.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(())
}

/// `path` with symbolic links in its last component followed to the end,
/// the last one possibly missing (a new file where a dangling link points).
/// At most [`MAX_LINKS`] links, as the kernel follows.
fn follow_links(path: &Path) -> io::Result<PathBuf> {
    let mut p = path.to_path_buf();
    for hops in 0..=MAX_LINKS {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                if hops == MAX_LINKS {
                    break;
                }
                let target = std::fs::read_link(&p)?;
                p = match p.parent() {
                    Some(dir) if target.is_relative() => dir.join(target),
                    _ => target,
                };
            }
            Ok(_) => return Ok(p),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(p),
            Err(e) => return Err(e),
        }
    }
    #[cfg(target_os = "linux")]
    return Err(nix::errno::Errno::ELOOP.into());
    #[cfg(not(target_os = "linux"))]
    Err(io::Error::other("too many levels of symbolic links"))
}

/// The symbolic links a path may pass through: Linux's `MAXSYMLINKS`.
const MAX_LINKS: usize = 40;

/// An error of [`write_atomic`]: its message names the caller's path, and its
/// source is the error the system returned (with its `raw_os_error`).
#[derive(Debug)]
struct AtPath {
    path: PathBuf,
    text: String,
    source: io::Error,
}

impl std::fmt::Display for AtPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.path.as_os_str().is_empty() {
            return write!(f, "'' (an empty path): {}", self.text);
        }
        write!(f, "{}: {}", self.path.display(), self.text)
    }
}

impl std::error::Error for AtPath {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// `e` as the caller's error: its kind, a message naming `path`, `e` as its
/// source. `tempfile` appends ` at path "<its temporary name>"` to the
/// system's text: dropped from the first occurrence (the system's own text
/// never holds it; a directory name in the temporary path may).
fn named_error(e: io::Error, path: &Path) -> io::Error {
    let full = e.to_string();
    let text = full
        .find(" at path \"")
        .map_or(&full[..], |i| &full[..i])
        .to_owned();
    io::Error::new(
        e.kind(),
        AtPath {
            path: path.to_path_buf(),
            text,
            source: e,
        },
    )
}
