//! Shared pieces of the role commands: sizes, tokens, and TOML configuration files.
//!
//! Every role takes its settings from flags or from a TOML file (`--config FILE`) whose keys are
//! the long flag names with `_` for `-` (`chunk_size = "1M"`); a flag given on the command line
//! wins over the file.

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use std::path::Path;

/// Parses a size such as `4096`, `64K`, `512M`, `2G` (binary multiples; `B` and `iB` suffixes
/// allowed).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .with_context(|| format!("{text:?} is not a size (like 4096, 64K, 512M, 2G)"))?;
    n.checked_mul(1 << shift)
        .with_context(|| format!("size {text:?} is too large"))
}

/// Reads a TOML configuration file into `T`, or `T::default()` when no file is given.
pub fn load<T: DeserializeOwned + Default>(path: Option<&Path>) -> Result<T> {
    let Some(path) = path else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parse {}", path.display()))
}

/// The cluster token: from the flag, the `CITRONFS_TOKEN` environment variable (through clap),
/// or the file; it must be given somewhere.
pub fn require_token(token: Option<String>) -> Result<String> {
    match token {
        Some(t) if !t.is_empty() => Ok(t),
        _ => bail!("the cluster token is missing: give --token, set CITRONFS_TOKEN, or put token = \"...\" in the --config file"),
    }
}

/// Takes the first of the values that is set: the flag, then the file.
#[macro_export]
macro_rules! merge {
    ($cli:expr, $file:expr; $($field:ident),+ $(,)?) => {
        $( if $cli.$field.is_none() { $cli.$field = $file.$field.take(); } )+
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
