//! The header of a safetensors file, parsed and validated by the `safetensors`
//! crate (the parser the `safetensors` Python package wraps).
//!
//! The Python loader reads the 8-byte length and the JSON header itself, hands
//! them here with the file's length, and maps the tensors' bytes from the
//! offsets returned: the header is parsed once and no tensor data is touched or
//! copied, so the work is bounded by the header's size (the crate caps it at
//! 100 MB) rather than re-done per reader.

use crate::error::{QuantError, Result};
use safetensors::tensor::Metadata;

/// Length of the little-endian header-size prefix.
pub const PREFIX_LEN: usize = 8;

/// One tensor's entry: where its bytes are, relative to the end of the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's name.
    pub name: String,
    /// The safetensors dtype tag (`"F32"`, `"BF16"`, `"F8_E4M3"`, ...).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// Byte offsets `[start, end)` of its data after the header.
    pub start: usize,
    /// End offset (exclusive).
    pub end: usize,
}

/// A validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The `__metadata__` string map, sorted by key.
    pub metadata: Vec<(String, String)>,
    /// The tensors in file (offset) order.
    pub tensors: Vec<TensorEntry>,
}

fn format(msg: impl std::fmt::Display) -> QuantError {
    QuantError::Format {
        msg: msg.to_string(),
    }
}

/// Whether NumPy can make an array of `shape` with `itemsize`-byte elements: at
/// most `max_ndim` dimensions and, zero-sized dimensions aside, at most 2^63 - 1
/// bytes (NumPy checks the other dimensions' product even for an empty array).
pub fn representable(shape: &[usize], itemsize: usize, max_ndim: usize) -> bool {
    shape.len() <= max_ndim
        && shape
            .iter()
            .try_fold(itemsize.max(1), |acc, &d| acc.checked_mul(d.max(1)))
            .is_some_and(|bytes| bytes <= i64::MAX as usize)
}

/// Parse the JSON `header` of a safetensors file of `file_len` bytes whose
/// header is `header.len()` bytes long; shapes must be ones NumPy can represent
/// with `max_ndim` dimensions at most.
///
/// The `safetensors` crate validates the JSON, the dtypes, that offsets are
/// contiguous and match each shape and dtype (with overflow checks); this also
/// checks that the data ends exactly at the end of the file, as the crate's
/// own reader does.
pub fn parse_header(header: &[u8], file_len: usize, max_ndim: usize) -> Result<Header> {
    // serde keeps the last of two equal keys; a file that names a tensor or a
    // metadata key twice would read one way here and another in a reader that
    // keeps the first.
    let mut json = serde_json::Deserializer::from_slice(header);
    serde::de::DeserializeSeed::deserialize(UniqueKeys { top: true }, &mut json)
        .map_err(|e| format(format!("bad header: {e}")))?;
    let meta: Metadata =
        serde_json::from_slice(header).map_err(|e| format(format!("bad header: {e}")))?;
    let expected = PREFIX_LEN
        .checked_add(header.len())
        .and_then(|n| n.checked_add(meta.data_len()))
        .ok_or_else(|| format("header offsets overflow"))?;
    if expected != file_len {
        return Err(format(format!(
            "the header describes a file of {expected} bytes, but the file holds {file_len}"
        )));
    }
    let names = meta.offset_keys();
    let mut tensors = Vec::with_capacity(names.len());
    for name in names {
        let info = meta
            .info(&name)
            .ok_or_else(|| format(format!("tensor {name:?} has no entry")))?;
        if !representable(&info.shape, info.dtype.bitsize().div_ceil(8), max_ndim) {
            return Err(format(format!(
                "tensor {name:?} has a shape NumPy cannot represent ({} dimensions, at most {max_ndim}; \
                 at most 2**63 - 1 bytes across its non-zero dimensions)",
                info.shape.len()
            )));
        }
        tensors.push(TensorEntry {
            dtype: info.dtype.to_string(),
            shape: info.shape.clone(),
            start: info.data_offsets.0,
            end: info.data_offsets.1,
            name,
        });
    }
    let mut metadata: Vec<(String, String)> = meta
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    metadata.sort();
    Ok(Header { metadata, tensors })
}

/// Puts the `__metadata__` entries of a header the `safetensors` crate wrote
/// in key order, in place; whether anything moved.
///
/// The crate keeps metadata in a `HashMap` and writes it in that map's order,
/// which changes from one process (and one map) to the next: the same tensors
/// and metadata gave different files. It writes `__metadata__` first, compact,
/// with `serde_json`; re-serializing the same entries in key order with
/// `serde_json` gives the same bytes, reordered, at the same length, so the
/// header's length and every offset stay as they are. A header of another
/// shape (another writer's, or one this cannot reorder at the same length) is
/// left untouched.
pub fn sort_metadata(header: &mut [u8]) -> bool {
    const KEY: &[u8] = br#"{"__metadata__":"#;
    if !header.starts_with(KEY) {
        return false;
    }
    let start = KEY.len();
    let mut values = serde_json::Deserializer::from_slice(&header[start..])
        .into_iter::<std::collections::BTreeMap<String, String>>();
    let Some(Ok(entries)) = values.next() else {
        return false;
    };
    let end = start + values.byte_offset();
    let Ok(sorted) = serde_json::to_vec(&entries) else {
        return false;
    };
    if sorted.len() != end - start || sorted[..] == header[start..end] {
        return false;
    }
    header[start..end].copy_from_slice(&sorted);
    true
}

/// [`sort_metadata`] on the safetensors file at `path`, rewriting its header
/// in place (a file whose header is not the crate's is left as it is).
pub fn sort_metadata_in_file(path: &std::path::Path) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let mut prefix = [0u8; PREFIX_LEN];
    file.read_exact(&mut prefix)?;
    let len = u64::from_le_bytes(prefix);
    // The crate writes at most 100 MB of header; a longer one is not its.
    if len > 100_000_000 || len > file.metadata()?.len() - PREFIX_LEN as u64 {
        return Ok(());
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)?;
    if sort_metadata(&mut header) {
        file.seek(SeekFrom::Start(PREFIX_LEN as u64))?;
        file.write_all(&header)?;
    }
    Ok(())
}

/// A pass over the header that refuses a key given twice in the top-level
/// object (tensor names) or in its `__metadata__` object (values unread).
struct UniqueKeys {
    top: bool,
}

impl<'de> serde::de::DeserializeSeed<'de> for UniqueKeys {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueKeys {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    /// `"__metadata__": null` (the crate reads it as no metadata).
    fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<(), E> {
        if self.top {
            return Err(E::custom("the header must be a JSON object"));
        }
        Ok(())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if seen.contains(&key) {
                let what = if self.top { "name" } else { "__metadata__ key" };
                return Err(serde::de::Error::custom(format!(
                    "the {what} {key:?} appears twice"
                )));
            }
            if self.top && key == "__metadata__" {
                map.next_value_seed(UniqueKeys { top: false })?;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
            seen.insert(key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str, data: usize) -> Result<Header> {
        parse_header(json.as_bytes(), PREFIX_LEN + json.len() + data, 64)
    }

    /// The crate's file of one tensor and `meta`, as bytes.
    fn crate_file(meta: &[(&str, &str)]) -> Vec<u8> {
        let data = [1u8, 2, 3, 4];
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![4], &data).unwrap();
        let meta = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        safetensors::tensor::serialize([("t", view)], Some(meta)).unwrap()
    }

    fn header_of(file: &mut [u8]) -> &mut [u8] {
        let n = u64::from_le_bytes(file[..PREFIX_LEN].try_into().unwrap()) as usize;
        &mut file[PREFIX_LEN..PREFIX_LEN + n]
    }

    #[test]
    fn metadata_comes_out_in_key_order_whatever_the_map_order() {
        // Keys that escape (quotes, controls, non-ASCII) keep their length too.
        let meta: Vec<(String, String)> = (0..24)
            .map(|i| (format!("k{i:02}\"\u{1}é"), format!("v{i}\n\u{7f}")))
            .collect();
        let meta: Vec<(&str, &str)> = meta.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut seen = std::collections::BTreeSet::new();
        let mut first: Option<Vec<u8>> = None;
        for _ in 0..12 {
            let mut file = crate_file(&meta);
            seen.insert(file.clone());
            let before = file.len();
            sort_metadata(header_of(&mut file));
            assert_eq!(file.len(), before);
            let h = header_of(&mut file).to_vec();
            let parsed = parse_header(&h, file.len(), 64).unwrap();
            assert_eq!(parsed.metadata.len(), 24);
            // Keys in order in the bytes themselves.
            let at = |k: &str| {
                let needle = serde_json::to_vec(k).unwrap();
                h.windows(needle.len()).position(|w| w == needle).unwrap()
            };
            assert!(meta.windows(2).all(|p| at(p[0].0) < at(p[1].0)));
            match &first {
                Some(f) => assert_eq!(f, &file),
                None => first = Some(file),
            }
        }
        // The maps did come out in more than one order (else this proves nothing).
        assert!(seen.len() > 1);
    }

    #[test]
    fn a_header_of_another_shape_is_left_alone() {
        for text in [
            r#"{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"__metadata__":{"b":"1","a":"2"}}"#,
            r#"{"__metadata__":{"b":"1","a":"2"  },"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
            r#"{"__metadata__":{"b":1},"t":{}}"#,
            r#"{"__metadata__":{"a":"1","b":"2"},"t":{}}"#,
            r#"{"__metadata__":"#,
        ] {
            let mut h = text.as_bytes().to_vec();
            assert!(!sort_metadata(&mut h), "{text}");
            assert_eq!(h, text.as_bytes());
        }
        let mut h = br#"{"__metadata__":{"b":"1","a":"2"},"t":{}}"#.to_vec();
        assert!(sort_metadata(&mut h));
        assert_eq!(h, br#"{"__metadata__":{"a":"2","b":"1"},"t":{}}"#);
    }

    #[test]
    fn a_file_is_rewritten_in_place() {
        let meta: Vec<(String, String)> = (0..16).map(|i| (format!("m{i}"), "x".into())).collect();
        let meta: Vec<(&str, &str)> = meta.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let dir = tempfile::tempdir().unwrap();
        let mut want: Option<Vec<u8>> = None;
        for i in 0..8 {
            let path = dir.path().join(format!("f{i}"));
            std::fs::write(&path, crate_file(&meta)).unwrap();
            sort_metadata_in_file(&path).unwrap();
            let got = std::fs::read(&path).unwrap();
            match &want {
                Some(w) => assert_eq!(w, &got),
                None => want = Some(got),
            }
        }
        // Too short for its stated header: left as it is.
        let path = dir.path().join("short");
        std::fs::write(&path, 1000u64.to_le_bytes()).unwrap();
        sort_metadata_in_file(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), 1000u64.to_le_bytes());
    }

    #[test]
    fn a_name_or_metadata_key_given_twice_is_refused() {
        let t = r#""p":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}"#;
        let twice = format!(r#"{{{t},{t}}}"#);
        let err = parse(&twice, 2).unwrap_err().to_string();
        assert!(err.contains(r#"the name "p" appears twice"#), "{err}");
        let meta = format!(r#"{{"__metadata__":{{"k":"a","k":"b"}},{t}}}"#);
        let err = parse(&meta, 2).unwrap_err().to_string();
        assert!(
            err.contains(r#"the __metadata__ key "k" appears twice"#),
            "{err}"
        );
        // Equal keys at different levels, and a null __metadata__, are fine.
        let ok = format!(r#"{{"__metadata__":{{"p":"x"}},{t}}}"#);
        assert_eq!(
            parse(&ok, 2).unwrap().metadata,
            vec![("p".into(), "x".into())]
        );
        let null = format!(r#"{{"__metadata__":null,{t}}}"#);
        assert!(parse(&null, 2).unwrap().metadata.is_empty());
        // Keys are compared after unescaping.
        let escaped = format!(r#"{{"__metadata__":{{"k":"a","\u006b":"b"}},{t}}}"#);
        assert!(escaped.contains(r"\u006b"));
        assert!(parse(&escaped, 2).is_err());
    }

    #[test]
    fn a_valid_header_lists_tensors_in_offset_order() -> Result<()> {
        let h = parse(
            r#"{"__metadata__":{"k":"v"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                "a":{"dtype":"F8_E4M3","shape":[1,3],"data_offsets":[8,11]}}"#,
            11,
        )?;
        assert_eq!(h.metadata, vec![("k".to_string(), "v".to_string())]);
        let names: Vec<_> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(h.tensors[1].dtype, "F8_E4M3");
        assert_eq!((h.tensors[1].start, h.tensors[1].end), (8, 11));
        Ok(())
    }

    #[test]
    fn inconsistent_headers_are_format_errors() {
        let cases = [
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                7,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
            ),
            (
                r#"{"a":{"dtype":"XX","shape":[2],"data_offsets":[0,8]}}"#,
                8,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#,
                0,
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                12,
            ),
            (r#"not json"#, 0),
            (
                r#"{"a":{"dtype":"F32","shape":[0,4611686018427387904],"data_offsets":[0,0]}}"#,
                0,
            ),
        ];
        for (json, data) in cases {
            assert!(
                matches!(parse(json, data), Err(QuantError::Format { .. })),
                "{json}"
            );
        }
    }
}
