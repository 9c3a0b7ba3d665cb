//! A safetensors file written from tensors that wait in a spill file, one
//! tensor in memory at a time.
//!
//! safetensors lists every tensor's offsets in a header that comes first, so
//! a file cannot be streamed straight out; a writer that meets its tensors one
//! by one (the command line's, which quantizes a model a tensor at a time)
//! appends their bytes to an unnamed temporary file, and [`SpillFile::write_safetensors`]
//! has the `safetensors` crate write the real file, each tensor read back
//! from the spill only when the crate asks for its bytes. Mapping the spill
//! instead would put every page of it in the process's resident set while the
//! file is written, so peak memory would grow with the model.

use crate::formats::safetensors_header::sort_metadata_in_file;
use safetensors::tensor::{serialize_to_file, Dtype, View};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;

/// Why [`SpillFile::write_safetensors`] failed.
#[derive(Debug)]
pub enum WriteError {
    /// Reading the spill or writing the file failed.
    Io(io::Error),
    /// A tensor's bytes could not be allocated.
    OutOfMemory(usize),
    /// safetensors refused the tensors (a header over its size limit, a
    /// length that does not fit the shape, an unknown dtype tag).
    Format(String),
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Io(e) => write!(f, "{e}"),
            WriteError::OutOfMemory(n) => write!(f, "cannot allocate {n} bytes for a tensor"),
            WriteError::Format(m) => write!(f, "{m}"),
        }
    }
}

/// One tensor of the spill: its name, safetensors dtype tag (`"F32"`, ...),
/// shape, and where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spilled {
    /// The tensor's name in the file.
    pub name: String,
    /// The safetensors dtype tag.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// Byte offset in the spill.
    pub offset: u64,
    /// Byte length.
    pub len: usize,
}

/// An unnamed temporary file that tensors' bytes are appended to.
///
/// Only the process that made it may use it: a child forked while it is open
/// shares its descriptor and offset with the parent, and writing or reading
/// through it would change the parent's file, so it is refused there.
#[derive(Debug)]
pub struct SpillFile {
    file: File,
    len: u64,
    owner: u32,
}

/// Dimensions a tensor may have (NumPy's limit).
pub const MAX_NDIM: usize = 64;

impl SpillFile {
    /// A new spill in `dir` (removed by the system when it is dropped).
    pub fn new_in(dir: &Path) -> io::Result<Self> {
        Ok(SpillFile {
            file: tempfile::tempfile_in(dir)?,
            len: 0,
            owner: std::process::id(),
        })
    }

    /// `Err` in a process other than the one that made the spill.
    fn check_owner(&self) -> io::Result<()> {
        if self.owner == std::process::id() {
            Ok(())
        } else {
            Err(io::Error::other(
                "the spill belongs to the process that made it (this one is a forked child)",
            ))
        }
    }

    /// Bytes appended so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was appended.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Append `bytes`; returns the offset they start at.
    pub fn append(&mut self, bytes: &[u8]) -> io::Result<u64> {
        self.check_owner()?;
        let at = self.len;
        self.file.seek(SeekFrom::Start(at))?;
        self.file.write_all(bytes)?;
        self.len += bytes.len() as u64;
        Ok(at)
    }

    /// Write the safetensors file `path` holding `tensors` (read back from
    /// this spill one at a time) and `metadata`. The file is made under a
    /// temporary name beside `path` and renamed over it only when every
    /// tensor was written, so on error `path` is as it was. It gets the
    /// temporary file's mode (0600); set another after, if wanted.
    ///
    /// Errors: `Format` for a name used twice or reserved (`__metadata__`), a
    /// shape of more than [`MAX_NDIM`] dimensions, bytes outside the spill, an
    /// unknown dtype tag, or what safetensors refuses (a length that does not
    /// fit the shape); `Io`; `OutOfMemory` for a tensor's bytes.
    pub fn write_safetensors(
        &mut self,
        tensors: &[Spilled],
        metadata: Option<HashMap<String, String>>,
        path: &Path,
    ) -> Result<(), WriteError> {
        self.check_owner().map_err(WriteError::Io)?;
        let mut names = std::collections::HashSet::new();
        for t in tensors {
            if t.name == "__metadata__" || !names.insert(t.name.as_str()) {
                return Err(WriteError::Format(format!(
                    "tensor name {:?} is used twice or reserved",
                    t.name
                )));
            }
            if t.shape.len() > MAX_NDIM {
                return Err(WriteError::Format(format!(
                    "tensor {:?} has {} dimensions, more than {MAX_NDIM}",
                    t.name,
                    t.shape.len()
                )));
            }
            if t.offset
                .checked_add(t.len as u64)
                .is_none_or(|end| end > self.len)
            {
                return Err(WriteError::Format(format!(
                    "tensor {:?} lies outside the {} bytes written",
                    t.name, self.len
                )));
            }
        }
        let views = tensors
            .iter()
            .map(|t| {
                let dtype: Dtype = serde_json::from_value(serde_json::Value::String(
                    t.dtype.clone(),
                ))
                .map_err(|_| WriteError::Format(format!("unknown dtype tag {:?}", t.dtype)))?;
                Ok((
                    t.name.as_str(),
                    Lazy {
                        t,
                        dtype,
                        source: &self.file,
                        error: RefCell::new(None),
                    },
                ))
            })
            .collect::<Result<Vec<_>, WriteError>>()?;
        // The crate writes its own temporary file and renames it over the name
        // it is given: a name of ours, renamed over `path` only on success (a
        // failed read still leaves the crate's file complete, zero-filled).
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let partial = tempfile::Builder::new()
            .prefix(".ferroquant-")
            .suffix(".partial")
            .tempfile_in(parent)
            .map_err(WriteError::Io)?
            .into_temp_path();
        let written = serialize_to_file(views.iter().map(|(n, v)| (*n, v)), metadata, &partial);
        // A failed read shows as a short tensor: its error comes first.
        if let Some(e) = views.iter().find_map(|(_, v)| v.error.borrow_mut().take()) {
            return Err(e);
        }
        written.map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => WriteError::Io(e),
            other => WriteError::Format(other.to_string()),
        })?;
        // The crate writes metadata in a HashMap's order: the same run twice
        // gave different bytes.
        sort_metadata_in_file(&partial).map_err(WriteError::Io)?;
        partial.persist(path).map_err(|e| WriteError::Io(e.error))
    }
}

/// A tensor whose bytes are read from the spill when asked for.
struct Lazy<'a> {
    t: &'a Spilled,
    dtype: Dtype,
    source: &'a File,
    error: RefCell<Option<WriteError>>,
}

impl View for &Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.t.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let mut buf = Vec::new();
        if buf.try_reserve_exact(self.t.len).is_err() {
            *self.error.borrow_mut() = Some(WriteError::OutOfMemory(self.t.len));
            return Cow::Owned(buf);
        }
        buf.resize(self.t.len, 0);
        let mut f = self.source;
        let read = f
            .seek(SeekFrom::Start(self.t.offset))
            .and_then(|_| f.read_exact(&mut buf));
        if let Err(e) = read {
            *self.error.borrow_mut() = Some(WriteError::Io(e));
            buf.clear();
        }
        Cow::Owned(buf)
    }

    fn data_len(&self) -> usize {
        self.t.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spilled_file_reads_back_as_written() -> Result<(), WriteError> {
        let dir = tempfile::tempdir().map_err(WriteError::Io)?;
        let mut spill = SpillFile::new_in(dir.path()).map_err(WriteError::Io)?;
        let a: Vec<u8> = [1.5f32, -2.0, 3.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b = [1u8, 255, 7, 0];
        let oa = spill.append(&a).map_err(WriteError::Io)?;
        let ob = spill.append(&b).map_err(WriteError::Io)?;
        let tensors = [
            Spilled {
                name: "a".into(),
                dtype: "F32".into(),
                shape: vec![3],
                offset: oa,
                len: 12,
            },
            Spilled {
                name: "b".into(),
                dtype: "I8".into(),
                shape: vec![2, 2],
                offset: ob,
                len: 4,
            },
        ];
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        let path = dir.path().join("out.safetensors");
        spill.write_safetensors(&tensors, Some(meta), &path)?;
        let bytes = std::fs::read(&path).map_err(WriteError::Io)?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| WriteError::Format(e.to_string()))?;
        assert_eq!(
            st.tensor("a").map(|t| t.data().to_vec()).ok(),
            Some(a.clone())
        );
        assert_eq!(
            st.tensor("b").map(|t| t.data().to_vec()).ok(),
            Some(b.to_vec())
        );
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| WriteError::Format(e.to_string()))?;
        assert_eq!(
            meta.metadata()
                .as_ref()
                .and_then(|m| m.get("k"))
                .map(String::as_str),
            Some("v")
        );
        // Outside the spill, or an unknown tag: refused before anything is written.
        let mut bad = tensors.clone();
        bad[1].len = 5;
        assert!(matches!(
            spill.write_safetensors(&bad, None, &path),
            Err(WriteError::Format(_))
        ));
        bad[1].len = 4;
        bad[1].dtype = "Q4".into();
        assert!(matches!(
            spill.write_safetensors(&bad, None, &path),
            Err(WriteError::Format(_))
        ));
        // Names twice or reserved, too many dimensions: refused (safetensors
        // panics on a name twice).
        let edits: [fn(&mut Vec<Spilled>); 3] = [
            |t| t[1].name = "a".into(),
            |t| t[1].name = "__metadata__".into(),
            |t| t[1].shape = vec![1; MAX_NDIM + 1],
        ];
        for edit in edits {
            let mut bad = tensors.to_vec();
            edit(&mut bad);
            assert!(matches!(
                spill.write_safetensors(&bad, None, &path),
                Err(WriteError::Format(_))
            ));
        }
        // The file written first is still there, whole.
        assert_eq!(std::fs::read(&path).map_err(WriteError::Io)?, bytes);
        // A failed read back (bytes the spill lost) leaves `path` as it was,
        // and no temporary file behind.
        spill.file.set_len(8).map_err(WriteError::Io)?;
        assert!(matches!(
            spill.write_safetensors(&tensors, None, &path),
            Err(WriteError::Io(_))
        ));
        assert_eq!(std::fs::read(&path).map_err(WriteError::Io)?, bytes);
        assert_eq!(
            std::fs::read_dir(dir.path())
                .map_err(WriteError::Io)?
                .count(),
            1
        );
        Ok(())
    }
}
