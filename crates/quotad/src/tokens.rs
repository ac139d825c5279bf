//! The API's bearer tokens: each has a name and a scope. They come from `QUOTAD_ADMIN_TOKEN`
//! (the quick-start admin token, named `admin`) and from `api.tokens_file`, which is read again
//! every `api.tokens_check_ms`, so a token is added or revoked without a restart.
//!
//! The file (TOML) lists the tokens by their SHA-256 digest, or names a file holding one:
//!
//! ```toml
//! [[tokens]]
//! name = "gateway-eu"
//! scope = "check"
//! token_sha256 = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"
//!
//! [[tokens]]
//! name = "deployer"
//! scope = "admin"
//! token_file = "/run/secrets/quotad-deployer"
//! ```
//!
//! A presented token is hashed once and compared with every digest in constant time
//! ([`crate::secret::digests_match`]); which one matched, if any, is known only after all were
//! compared. A file that does not parse leaves the tokens in use unchanged (logged and audited).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::Deserialize;
use tokio::sync::watch;

use crate::secret::{digest, digests_match, Secret, TokenDigest};

/// The name of the token from `QUOTAD_ADMIN_TOKEN` (reserved: a tokens file may not use it).
pub const ADMIN_TOKEN_NAME: &str = "admin";

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Decisions: `POST /v1/check` and `/v1/check/batch` (unless `api.open_checks`).
    Check,
    /// Tenant data and cluster state: policies, allowance, listing, status, members.
    Read,
    /// Everything, mutations included.
    Admin,
}

impl Scope {
    /// Every scope, narrowest first.
    pub const ALL: [Scope; 3] = [Scope::Check, Scope::Read, Scope::Admin];

    /// True when a token of this scope may make a request needing `needed`.
    pub fn grants(self, needed: Scope) -> bool {
        self == Scope::Admin || self == needed
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Check => "check",
            Scope::Read => "read",
            Scope::Admin => "admin",
        }
    }
}

/// Who made a request: the name and scope of the token it carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub name: Arc<str>,
    pub scope: Scope,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    caller: Caller,
    digest: TokenDigest,
}

/// A set of named tokens, looked up in constant time per entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenSet {
    entries: Vec<Entry>,
}

impl TokenSet {
    /// The caller whose token is `presented`, if any. Every entry is compared, whichever
    /// matches, so the time taken does not tell which (or whether one) did.
    pub fn lookup(&self, presented: &str) -> Option<&Caller> {
        let d = digest(presented);
        let mut found = None;
        for e in &self.entries {
            if digests_match(&e.digest, &d) {
                found = Some(&e.caller);
            }
        }
        found
    }

    /// The names and scopes, for the audit log of a reload.
    fn names(&self) -> BTreeMap<&str, Scope> {
        self.entries
            .iter()
            .map(|e| (&*e.caller.name, e.caller.scope))
            .collect()
    }

    fn push(&mut self, name: &str, scope: Scope, digest: TokenDigest) {
        self.entries.push(Entry {
            caller: Caller {
                name: name.into(),
                scope,
            },
            digest,
        });
    }
}

/// A tokens file that cannot be used, with the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct TokensFileError {
    /// e.g. `tokens[2].token_sha256`, or `api.tokens_file` for the file as a whole.
    pub field: String,
    pub message: String,
}

fn fault(field: impl Into<String>, message: impl Into<String>) -> TokensFileError {
    TokensFileError {
        field: field.into(),
        message: message.into(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    tokens: Vec<TokenSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenSpec {
    name: String,
    scope: Scope,
    token_sha256: Option<String>,
    token_file: Option<PathBuf>,
}

/// Reads and checks a tokens file, and the token files it names (relative to its directory).
pub fn read_file(path: &Path) -> Result<TokenSet, TokensFileError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        fault(
            "api.tokens_file",
            format!("cannot read {}: {e}", path.display()),
        )
    })?;
    parse(&text, path.parent().unwrap_or(Path::new(".")))
}

/// Parses a tokens file's text; `dir` resolves relative `token_file` paths.
pub fn parse(text: &str, dir: &Path) -> Result<TokenSet, TokensFileError> {
    let file: TokensFile = toml::from_str(text).map_err(|e| {
        fault(
            "api.tokens_file",
            format!("not a tokens file: {}", e.message()),
        )
    })?;
    let mut set = TokenSet::default();
    let mut names = HashSet::new();
    let mut digests = HashSet::new();
    for (i, t) in file.tokens.iter().enumerate() {
        let at = |f: &str| format!("tokens[{i}].{f}");
        let valid_name = !t.name.is_empty()
            && t.name.len() <= 64
            && t.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !valid_name {
            return Err(fault(at("name"), "1 to 64 characters of A-Z a-z 0-9 - _ ."));
        }
        if t.name == ADMIN_TOKEN_NAME {
            return Err(fault(
                at("name"),
                "`admin` names the QUOTAD_ADMIN_TOKEN token; choose another name",
            ));
        }
        if !names.insert(t.name.as_str()) {
            return Err(fault(at("name"), format!("`{}` appears twice", t.name)));
        }
        let d = match (&t.token_sha256, &t.token_file) {
            (Some(hex_digest), None) => {
                let mut d = [0u8; 32];
                hex::decode_to_slice(hex_digest.trim(), &mut d).map_err(|_| {
                    fault(
                        at("token_sha256"),
                        "64 hexadecimal digits: the SHA-256 of the token (`printf %s \"$TOKEN\" | sha256sum`)",
                    )
                })?;
                d
            }
            (None, Some(file)) => {
                let file = dir.join(file);
                let token = std::fs::read_to_string(&file).map_err(|e| {
                    fault(
                        at("token_file"),
                        format!("cannot read {}: {e}", file.display()),
                    )
                })?;
                let token = token.trim();
                if token.len() < 16 {
                    return Err(fault(
                        at("token_file"),
                        "the token must be at least 16 characters",
                    ));
                }
                digest(token)
            }
            _ => {
                return Err(fault(
                    at("token_sha256"),
                    "set exactly one of token_sha256 and token_file",
                ))
            }
        };
        if !digests.insert(d) {
            return Err(fault(
                at("token_sha256"),
                "the same token as an earlier entry",
            ));
        }
        set.push(&t.name, t.scope, d);
    }
    Ok(set)
}

/// The tokens in use: the admin token and the tokens file's, swapped whole on a reload.
#[derive(Debug)]
pub struct Tokens {
    admin: Option<TokenDigest>,
    file: Option<PathBuf>,
    current: ArcSwap<TokenSet>,
}

/// What a reload found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reload {
    /// No tokens file, or it holds the tokens in use.
    Unchanged,
    /// Other tokens, now in use.
    Changed {
        added: Vec<String>,
        removed: Vec<String>,
        changed: Vec<String>,
    },
    /// The file cannot be used; the tokens in use are kept.
    Kept(TokensFileError),
}

impl Tokens {
    /// The admin token (if any) and the tokens of `file` (if any), as read at start-up.
    pub fn new(admin: Option<&Secret>, file: Option<PathBuf>, initial: TokenSet) -> Self {
        let admin = admin.map(Secret::digest);
        let tokens = Self {
            admin,
            file,
            current: ArcSwap::from_pointee(TokenSet::default()),
        };
        tokens.current.store(Arc::new(tokens.with_admin(initial)));
        tokens
    }

    /// Only the admin token (tests, and daemons without a tokens file).
    pub fn admin_only(admin: &Secret) -> Self {
        Self::new(Some(admin), None, TokenSet::default())
    }

    fn with_admin(&self, mut set: TokenSet) -> TokenSet {
        if let Some(d) = self.admin {
            set.push(ADMIN_TOKEN_NAME, Scope::Admin, d);
        }
        set
    }

    /// The caller presenting `token`, if it is a token in use.
    pub fn lookup(&self, token: &str) -> Option<Caller> {
        self.current.load().lookup(token).cloned()
    }

    /// Reads the tokens file again and uses what it holds, if it parses; writes one audit
    /// event when the tokens change or the file cannot be used.
    pub fn reload(&self) -> Reload {
        let Some(path) = &self.file else {
            return Reload::Unchanged;
        };
        let next = match read_file(path) {
            Ok(set) => self.with_admin(set),
            Err(e) => {
                tracing::error!(target: "audit", action = "tokens.reload", outcome = "kept",
                    error = %e, "The tokens file cannot be used: the tokens in use are kept.");
                crate::audit::count("tokens.reload", "kept");
                return Reload::Kept(e);
            }
        };
        let old = self.current.load();
        if **old == next {
            return Reload::Unchanged;
        }
        let (before, after) = (old.names(), next.names());
        let keys: BTreeSet<&str> = before.keys().chain(after.keys()).copied().collect();
        let (mut added, mut removed, mut changed) = (Vec::new(), Vec::new(), Vec::new());
        for k in keys {
            match (before.get(k), after.get(k)) {
                (None, Some(_)) => added.push(k.to_string()),
                (Some(_), None) => removed.push(k.to_string()),
                _ => {
                    let digest_of = |s: &TokenSet| {
                        s.entries
                            .iter()
                            .find(|e| &*e.caller.name == k)
                            .map(|e| (e.digest, e.caller.scope))
                    };
                    if digest_of(&old) != digest_of(&next) {
                        changed.push(k.to_string());
                    }
                }
            }
        }
        tracing::info!(target: "audit", action = "tokens.reload", outcome = "ok",
            added = ?added, removed = ?removed, changed = ?changed, "Tokens reloaded.");
        crate::audit::count("tokens.reload", "ok");
        drop(old);
        self.current.store(Arc::new(next));
        Reload::Changed {
            added,
            removed,
            changed,
        }
    }

    /// Reloads every `every` until `shutdown`.
    pub async fn watch(self: Arc<Self>, every: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            self.reload();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(token: &str) -> String {
        hex::encode(digest(token))
    }

    #[test]
    fn scopes_grant_themselves_and_admin_grants_all() {
        for needed in Scope::ALL {
            assert!(Scope::Admin.grants(needed));
            for s in [Scope::Check, Scope::Read] {
                assert_eq!(s.grants(needed), s == needed, "{s:?} for {needed:?}");
            }
        }
    }

    #[test]
    fn a_file_names_tokens_by_digest_or_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("t"), "file-token-0123456789\n").unwrap();
        let text = format!(
            "[[tokens]]\nname = \"gw\"\nscope = \"check\"\ntoken_sha256 = \"{}\"\n\
             [[tokens]]\nname = \"ops\"\nscope = \"admin\"\ntoken_file = \"t\"\n",
            sha("gateway-token-0123")
        );
        let set = parse(&text, dir.path()).unwrap();
        assert_eq!(
            set.lookup("gateway-token-0123").unwrap().scope,
            Scope::Check
        );
        let ops = set.lookup("file-token-0123456789").unwrap();
        assert_eq!((&*ops.name, ops.scope), ("ops", Scope::Admin));
        assert_eq!(set.lookup("gateway-token-012"), None);
        assert_eq!(set.lookup(""), None);
    }

    #[test]
    fn bad_files_name_the_field() {
        let dir = Path::new(".");
        let cases = [
            (
                "[[tokens]]\nname = \"a\"\nscope = \"check\"\n",
                "tokens[0].token_sha256",
            ),
            (
                "[[tokens]]\nname = \"a\"\nscope = \"check\"\ntoken_sha256 = \"xyz\"\n",
                "tokens[0].token_sha256",
            ),
            (
                &format!(
                    "[[tokens]]\nname = \"admin\"\nscope = \"read\"\ntoken_sha256 = \"{}\"\n",
                    sha("x")
                ),
                "tokens[0].name",
            ),
            (
                &format!(
                    "[[tokens]]\nname = \"a\"\nscope = \"read\"\ntoken_sha256 = \"{0}\"\n\
                     [[tokens]]\nname = \"a\"\nscope = \"read\"\ntoken_sha256 = \"{1}\"\n",
                    sha("x"),
                    sha("y")
                ),
                "tokens[1].name",
            ),
            (
                "[[tokens]]\nname = \"a\"\nscope = \"root\"\n",
                "api.tokens_file",
            ),
            ("tokenz = 1\n", "api.tokens_file"),
        ];
        for (text, field) in cases {
            assert_eq!(parse(text, dir).unwrap_err().field, field, "{text}");
        }
    }

    #[test]
    fn a_reload_adds_and_revokes_and_keeps_the_old_set_on_a_bad_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.toml");
        let write = |entries: &[(&str, &str, &str)]| {
            let text: String = entries
                .iter()
                .map(|(n, s, t)| {
                    format!(
                        "[[tokens]]\nname = \"{n}\"\nscope = \"{s}\"\ntoken_sha256 = \"{}\"\n",
                        sha(t)
                    )
                })
                .collect();
            std::fs::write(&path, text).unwrap();
        };
        write(&[("reader", "read", "reader-token")]);
        let admin = Secret::new("the-admin-token");
        let tokens = Tokens::new(Some(&admin), Some(path.clone()), read_file(&path).unwrap());
        assert_eq!(tokens.lookup("reader-token").unwrap().scope, Scope::Read);
        assert_eq!(&*tokens.lookup("the-admin-token").unwrap().name, "admin");
        assert_eq!(tokens.reload(), Reload::Unchanged);

        write(&[("gw", "check", "gw-token")]);
        assert_eq!(
            tokens.reload(),
            Reload::Changed {
                added: vec!["gw".into()],
                removed: vec!["reader".into()],
                changed: vec![],
            }
        );
        assert_eq!(tokens.lookup("reader-token"), None);
        assert_eq!(tokens.lookup("gw-token").unwrap().scope, Scope::Check);

        std::fs::write(&path, "[[tokens]]\nname = ").unwrap();
        assert!(matches!(tokens.reload(), Reload::Kept(_)));
        assert_eq!(tokens.lookup("gw-token").unwrap().scope, Scope::Check);
        assert!(tokens.lookup("the-admin-token").is_some());
    }
}
