//! Settings of the role commands (`citronfs meta-server`, `data-server`, `mount`): the flags
//! they share, sizes, the token, logging, and the layering of defaults, file, environment and
//! flags.
//!
//! Each role has one serde configuration struct (`roles::MetaServerConfig`, ...) whose fields
//! are its settings, whose `Default` is the only place their defaults are written, and whose
//! field names are the TOML keys, the environment names and the flags' long names (`_` for
//! `-`). [`load`] layers them with figment, each layer overriding the ones before:
//! 1. the struct's `Default`;
//! 2. the TOML file given with `--config` (an unknown key is an error naming it);
//! 3. the environment: `CITRONFS_` and the key in capitals (`CITRONFS_CHUNK_SIZE=4M`,
//!    `CITRONFS_TOKEN`), for the role's keys only, so that other roles' variables are ignored;
//! 4. the flags given on the command line (flags not given leave the value below them).
//!
//! Invariant, tested: a role's clap flags and its configuration struct name the same settings,
//! so no flag is dropped and no key lacks a flag. `--help` shows each default, taken from the
//! struct's `Default` ([`show_defaults`]), not from a copy in the doc strings.

use anyhow::{bail, Context, Result};
use clap::Args;
use fabric::Backend;
use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The prefix of every setting's environment variable.
pub const ENV_PREFIX: &str = "CITRONFS_";
/// The variable of the log filter (`log`) for every command: the role commands read it
/// through the environment layer, `up` and `bench` directly.
pub const LOG_ENV: &str = "CITRONFS_LOG";

/// The environment variable of the cluster token (the `token` key of every role).
pub const TOKEN_ENV: &str = "CITRONFS_TOKEN";
/// The default log filter: warnings and errors.
pub const DEFAULT_LOG: &str = "warn";
/// The default cluster name.
pub const DEFAULT_CLUSTER: &str = "citronfs";
/// Where the meta server's RPC service listens by default, and where clients and data servers
/// look for it.
pub const DEFAULT_META_ADDR: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 7700));
/// The fabric of the role commands by default: tcp, the one that spans hosts.
pub const DEFAULT_ROLE_FABRIC: Backend = Backend::Tcp;

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

/// A number of bytes as a setting: written `4096`, `64K`, `512M`, `2G` in flags, files and
/// the environment (a plain integer too, in a file), and shown in the largest unit that
/// divides it (`64M`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Size, String> {
        parse_size(s).map(Size).map_err(|e| format!("{e:#}"))
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = [(40, 'T'), (30, 'G'), (20, 'M'), (10, 'K')]
            .into_iter()
            .find(|&(shift, _)| self.0 != 0 && self.0 % (1 << shift) == 0);
        match unit {
            Some((shift, suffix)) => write!(f, "{}{suffix}", self.0 >> shift),
            None => write!(f, "{}", self.0),
        }
    }
}

impl Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Size, D::Error> {
        struct SizeVisitor;
        impl serde::de::Visitor<'_> for SizeVisitor {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as 4096, \"64K\", \"512M\", \"2G\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Size, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(SizeVisitor)
    }
}

/// The flags every role shares.
#[derive(Args, Debug, Default, Serialize)]
pub struct CommonArgs {
    /// A TOML file with any of this command's settings: keys are the long flag names with `_`
    /// for `-` (`cluster = "prod"`).
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// The cluster's name.
    #[arg(long)]
    pub cluster: Option<String>,
    /// The cluster's shared secret (or CITRONFS_TOKEN, or `token` in the --config file); this
    /// or --token-file is required. It shows in `ps`: prefer --token-file outside tests.
    #[arg(long)]
    pub token: Option<String>,
    /// A file holding the cluster's shared secret (surrounding whitespace ignored), readable by
    /// its owner only (mode 0600 or 0400, like an ssh key); instead of --token.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// What to log: a level (error, warn, info, debug, trace) or a tracing filter such as
    /// `info,meta_server=debug`.
    #[arg(long)]
    pub log: Option<String>,
}

/// The flags of the roles that serve a region (meta server, data server).
#[derive(Args, Debug, Default, Serialize)]
pub struct FabricArgs {
    /// How clients reach the region.
    #[arg(long, value_enum)]
    pub fabric: Option<Backend>,
    /// shm: the region's directory [default: /dev/shm/citronfs/CLUSTER/meta for the meta
    /// server, /dev/shm/citronfs/CLUSTER/NAME for a data server].
    #[arg(long)]
    pub region_dir: Option<PathBuf>,
    /// tcp: where the region's fabric server listens [default: the meta server's --listen
    /// host, or 127.0.0.1, any port].
    #[arg(long)]
    pub fabric_listen: Option<SocketAddr>,
}

/// A role's flags: they name its configuration struct's settings.
pub trait RoleArgs: Serialize + Sized {
    /// The role's configuration.
    type Config: Serialize + DeserializeOwned + Default;
    /// The shared flags (the `--config` file among them).
    fn common(&self) -> &CommonArgs;

    /// The role's settings: defaults, then the `--config` file, then the environment, then
    /// these flags (see the module docs).
    fn load(&self) -> Result<Self::Config> {
        load(self.common().config.as_deref(), self)
    }
}

/// Layers `C`'s defaults, the TOML `file`, the `CITRONFS_*` environment and `flags` (the
/// serialized clap struct; flags not given are `None` and left out) into a `C`.
pub fn load<C: Serialize + DeserializeOwned + Default>(
    file: Option<&Path>,
    flags: &impl Serialize,
) -> Result<C> {
    // `file_exact`: a file named but missing is an error, not an empty layer.
    layered(file.map(Toml::file_exact), flags)
}

/// [`load`] with the file layer given as a figment TOML source (a file, or a string for the
/// fuzz entry).
fn layered<C: Serialize + DeserializeOwned + Default>(
    file: Option<impl Provider>,
    flags: &impl Serialize,
) -> Result<C> {
    let defaults = C::default();
    let keys: Vec<String> = settings_of(&defaults)?.into_keys().collect();
    let mut figment = Figment::from(Serialized::defaults(&defaults));
    if let Some(file) = file {
        figment = figment.merge(file);
    }
    figment
        .merge(RawEnv::for_keys(&keys))
        .merge(Flags::new(flags)?)
        // Lossy: numbers and booleans are read from the environment's strings.
        .extract_lossy()
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("invalid settings")
}

/// A serializable settings struct as a figment dictionary (a key for every field; `None`
/// fields are `Value::Empty`).
fn settings_of(settings: &impl Serialize) -> Result<Dict> {
    Value::serialize(settings)
        .context("settings to a dictionary")?
        .into_dict()
        .context("settings are a struct of named fields")
}

/// The role's `CITRONFS_<KEY>` environment variables, selected by figment's `Env`, with each
/// value kept as the string it is: `Env` itself would parse `12345` into a number, which a
/// string setting (a token, a cluster name) then refuses. Only the role's own keys are taken:
/// the environment is shared with other roles and programs, and an unknown key is an error.
struct RawEnv(Env);

impl RawEnv {
    fn for_keys(keys: &[String]) -> RawEnv {
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        RawEnv(Env::prefixed(ENV_PREFIX).only(&keys))
    }
}

impl Provider for RawEnv {
    fn metadata(&self) -> Metadata {
        self.0.metadata()
    }

    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        let dict: Dict = self
            .0
            .iter()
            .map(|(key, value)| (key.to_string(), Value::from(value)))
            .collect();
        Ok(Profile::Default.collect(dict))
    }
}

/// The flags given on the command line: the clap struct serialized, less the flags not given,
/// which would otherwise override the layers below with nothing.
struct Flags(Dict);

impl Flags {
    fn new(flags: &impl Serialize) -> Result<Flags> {
        let mut dict = settings_of(flags)?;
        dict.retain(|_, value| !matches!(value, Value::Empty(..)));
        Ok(Flags(dict))
    }
}

impl Provider for Flags {
    fn metadata(&self) -> Metadata {
        Metadata::named("command-line flags")
    }

    fn data(&self) -> std::result::Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.0.clone()))
    }
}

/// Appends to the help of each flag of `cmd` the default of its setting in `C::default()`, so
/// that `--help` shows the defaults without a second copy of them in the doc strings.
/// Settings without a default (`None`) are left as they are.
pub fn show_defaults<C: Serialize + Default>(mut cmd: clap::Command) -> clap::Command {
    let Ok(defaults) = settings_of(&C::default()) else {
        return cmd;
    };
    let ids: Vec<clap::Id> = cmd.get_arguments().map(|a| a.get_id().clone()).collect();
    for id in ids {
        let Some(shown) = defaults.get(id.as_str()).and_then(shown_value) else {
            continue;
        };
        cmd = cmd.mut_arg(id, |arg| {
            let suffix = format!(" [default: {shown}]");
            let help = arg.get_help().map(|h| format!("{h}{suffix}"));
            let long = arg.get_long_help().map(|h| format!("{h}{suffix}"));
            let arg = match help {
                Some(help) => arg.help(help),
                None => arg,
            };
            match long {
                Some(long) => arg.long_help(long),
                None => arg,
            }
        });
    }
    cmd
}

/// How a default is shown in `--help`; `None` for no default.
fn shown_value(value: &Value) -> Option<String> {
    match value {
        Value::String(_, s) => Some(s.clone()),
        Value::Bool(_, b) => Some(b.to_string()),
        Value::Char(_, c) => Some(c.to_string()),
        Value::Num(..) => (value.to_u128().map(|n| n.to_string()))
            .or_else(|| value.to_i128().map(|n| n.to_string()))
            .or_else(|| value.to_f64().map(|n| n.to_string())),
        Value::Empty(..) | Value::Dict(..) | Value::Array(..) => None,
    }
}

/// The cluster token from the layered settings: given as `token` (a flag, the environment or
/// the file) or read from `token_file`, not both, and not empty.
pub fn require_token(token: Option<String>, token_file: Option<&Path>) -> Result<String> {
    match (token, token_file) {
        (Some(t), Some(file)) if !t.is_empty() => bail!(
            "the cluster token is given twice: as a token (--token, CITRONFS_TOKEN or token = \
             in the --config file) and as the token file {}; give one",
            file.display()
        ),
        (_, Some(file)) => read_token_file(file),
        (Some(t), None) if !t.is_empty() => Ok(t),
        _ => bail!(
            "the cluster token is missing: give --token-file PATH (a file of mode 0600 holding \
             it), --token, set CITRONFS_TOKEN, or put token_file = \"...\" or token = \"...\" in \
             the --config file"
        ),
    }
}

/// Reads the cluster token from `path`: the file's text less surrounding whitespace (a
/// trailing newline), refused when the file is readable or writable by its group or others
/// (as ssh refuses such a private key) or holds no token.
pub fn read_token_file(path: &Path) -> Result<String> {
    use std::os::unix::fs::PermissionsExt;
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open the token file {}", path.display()))?;
    let mode = file
        .metadata()
        .with_context(|| format!("cannot stat the token file {}", path.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        bail!(
            "the token file {} is accessible to its group or to others (mode {:04o}); it holds \
             the cluster's secret: make it private with `chmod 600 {}`",
            path.display(),
            mode & 0o7777,
            path.display()
        );
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut &file, &mut text)
        .with_context(|| format!("cannot read the token file {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        bail!("the token file {} is empty", path.display());
    }
    Ok(token.to_string())
}

/// Installs the logger (to stderr) with `filter`: a level or a tracing filter.
pub fn init_logging(filter: &str) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .with_context(|| format!("{filter:?} is not a log level or filter"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    Ok(())
}

/// The log filter of the commands without layered settings (`up`, `bench`): `CITRONFS_LOG`,
/// else [`DEFAULT_LOG`].
pub fn log_from_env() -> String {
    std::env::var(LOG_ENV).unwrap_or_else(|_| DEFAULT_LOG.into())
}

/// A role's settings from the TOML `text` as its `--config` file, with no flags given.
#[cfg(any(test, feature = "fuzzing"))]
pub fn load_str<C: Serialize + DeserializeOwned + Default>(text: &str) -> Result<C> {
    layered(Some(Toml::string(text)), &Dict::new())
}

/// Fuzz entry of a role's settings file: `text` is read as the `--config` TOML file of a role
/// whose settings are `C`, layered exactly as [`load`] layers a file (no flags given). Checks,
/// panicking on a finding: loading ends in settings or an error, never a panic; a file with a
/// top-level key that is not a setting is refused, with an error naming the key when it is
/// the file's only fault; settings that load survive a round trip through figment's values
/// unchanged.
#[cfg(any(test, feature = "fuzzing"))]
pub fn fuzz_settings_file<C>(text: &str)
where
    C: Serialize + DeserializeOwned + Default + PartialEq + fmt::Debug,
{
    let loaded = load_str::<C>(text);
    let keys = match settings_of(&C::default()) {
        Ok(dict) => dict.into_keys().collect::<Vec<_>>(),
        Err(e) => panic!("the defaults are not a dictionary: {e:#}"),
    };
    let parsed = Toml::string(text).data().ok();
    let unknown = parsed
        .as_ref()
        .and_then(|profiles| profiles.get(&Profile::Default))
        .and_then(|dict| dict.keys().find(|k| !keys.contains(k)).cloned());
    match (loaded, unknown) {
        (Ok(settings), None) => {
            let back: C = match Figment::from(Serialized::defaults(&settings)).extract() {
                Ok(back) => back,
                Err(e) => panic!("loaded settings do not load again: {e}: {settings:?}"),
            };
            assert_eq!(back, settings, "settings changed in a round trip");
        }
        (Ok(settings), Some(key)) => {
            panic!("the unknown key {key:?} was accepted: {settings:?}")
        }
        (Err(error), Some(key)) => {
            // Figment reports one error; the key must be it when nothing else is wrong.
            let mut known = parsed
                .and_then(|mut profiles| profiles.remove(&Profile::Default))
                .unwrap_or_default();
            known.retain(|k, _| keys.contains(k));
            let file = Serialized::defaults(known);
            if layered::<C>(Some(file), &Dict::new()).is_ok() {
                let message = format!("{error:#}");
                assert!(
                    message.contains(&key),
                    "the error for the unknown key {key:?} does not name it: {message}"
                );
            }
        }
        (Err(_), None) => {}
    }
}

/// A settings file holding every setting of `C` at its default (settings without a default
/// left out), as a seed for [`fuzz_settings_file`].
#[cfg(test)]
pub fn settings_file_seed<C: Serialize + Default>() -> String {
    let mut text = String::new();
    let Ok(dict) = settings_of(&C::default()) else {
        return text;
    };
    for (key, value) in dict {
        let shown = match &value {
            Value::String(_, s) => format!("{s:?}"),
            Value::Bool(_, b) => b.to_string(),
            Value::Num(..) => match value.to_u128() {
                Some(n) => n.to_string(),
                None => continue,
            },
            _ => continue,
        };
        text.push_str(&format!("{key} = {shown}\n"));
    }
    text
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

    #[test]
    fn sizes_show_in_their_largest_unit_and_read_back() {
        for (bytes, shown) in [
            (64 << 20, "64M"),
            (4096, "4K"),
            (1 << 30, "1G"),
            (1536, "1536"),
            (0, "0"),
            (3 << 40, "3T"),
        ] {
            assert_eq!(Size(bytes).to_string(), shown);
            assert_eq!(shown.parse::<Size>().unwrap(), Size(bytes));
        }
    }

    #[test]
    fn the_log_variable_is_the_log_setting_in_the_environment() {
        assert_eq!(LOG_ENV, format!("{ENV_PREFIX}LOG"));
    }
}

/// Settings of the commands that ask a running meta server — `citronfs fsck` and
/// `citronfs status` — layered like the roles' settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AskConfig {
    /// The cluster's name ([`DEFAULT_CLUSTER`]).
    pub cluster: String,
    /// The cluster's shared secret; this or `token_file` is required to ask a running meta
    /// server.
    pub token: Option<String>,
    /// A file holding the cluster's shared secret, private to its owner.
    pub token_file: Option<std::path::PathBuf>,
    /// The log filter ([`DEFAULT_LOG`]).
    pub log: String,
    /// The meta server's RPC address ([`DEFAULT_META_ADDR`]).
    pub meta: String,
}

impl Default for AskConfig {
    fn default() -> Self {
        AskConfig {
            cluster: DEFAULT_CLUSTER.into(),
            token: None,
            token_file: None,
            log: DEFAULT_LOG.into(),
            meta: DEFAULT_META_ADDR.to_string(),
        }
    }
}
