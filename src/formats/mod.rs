//! File formats, parsed by the libraries that define them.

pub mod safetensors_header;
pub mod spilled;

use std::io::{self, Write};
use std::path::Path;

/// Write `bytes` to the file `path` atomically: under a temporary name in the
/// same directory (that of the file a symbolic link at `path` resolves to),
/// renamed over the file once written, so a failure or a crash leaves `path`
/// as it was and no reader sees a partial file. A replaced file keeps its
/// permissions; a new one is created `0o666` less the umask (as `open(2)`
/// would make it). The temporary file is removed on any error.
///
/// Errors: `IsADirectory` for a directory at `path`, `InvalidInput` for
/// something other than a regular file there (a device or FIFO is never
/// replaced by a rename), else what creating, writing or renaming returns.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    // An existing name (a link followed to its end); a new one is made as is.
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let existing = match std::fs::metadata(&real) {
        Ok(m) if m.is_dir() => {
            return Err(io::Error::new(
                io::ErrorKind::IsADirectory,
                format!("{} is a directory", path.display()),
            ))
        }
        Ok(m) if !m.is_file() => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} is not a regular file (ferroquant writes files, atomically)",
                    path.display()
                ),
            ))
        }
        Ok(m) => Some(m.permissions()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
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
    let mut tmp = builder.tempfile_in(parent)?;
    tmp.write_all(bytes)?;
    tmp.flush()?;
    if let Some(p) = existing {
        tmp.as_file().set_permissions(p)?;
    }
    tmp.persist(&real).map(drop).map_err(|e| e.error)
}
