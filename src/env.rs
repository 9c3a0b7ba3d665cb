//! Reading ferroquant's environment variables: one rule for all three
//! (`FERROQUANT_NUM_THREADS`, `FERROQUANT_BIND_THREADS`, `FERROQUANT_SIMD`).
//!
//! A blank value means unset; a value that is not UTF-8 is ignored with a
//! warning rather than silently; a warning quotes at most 40 characters, so a
//! megabyte of garbage still makes a one-line message.

/// An environment value as a warning quotes it: at most 40 characters, quoted
/// and escaped.
pub(crate) fn shown(raw: &str) -> String {
    let head: String = raw.chars().take(40).collect();
    let more = if head.len() < raw.len() { "..." } else { "" };
    format!("{head:?}{more}")
}

/// The value of environment variable `name`: `None` if unset or blank,
/// `Some(Err(warning))` if it is not UTF-8 text.
pub(crate) fn text(name: &str) -> Option<std::result::Result<String, String>> {
    let raw = std::env::var_os(name)?;
    match raw.into_string() {
        Ok(t) if t.trim().is_empty() => None, // set but empty: the same as unset
        Ok(t) => Some(Ok(t)),
        Err(raw) => Some(Err(format!(
            "{name}={} is not UTF-8 text; it is ignored",
            shown(&raw.to_string_lossy())
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_quotes_at_most_forty_characters() {
        assert_eq!(shown("avx9000"), "\"avx9000\"");
        assert_eq!(shown(&"é".repeat(40)), format!("{:?}", "é".repeat(40)));
        assert_eq!(shown(&"é".repeat(41)), format!("{:?}...", "é".repeat(40)));
        assert_eq!(shown("a\nb"), "\"a\\nb\"");
    }
}
