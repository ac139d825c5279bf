//! A secret value (a token or a password) and the one way tokens are compared.
//!
//! Every bearer check of the system goes through here: quota-raft's peer API, and in quotad
//! the admin and decision API, the usage and lease peer endpoints and the forwarded-check
//! header. Both sides are hashed with SHA-256 and the digests compared in constant time, so
//! neither a token's bytes nor its length leak through timing.

use std::fmt;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The SHA-256 digest of a token: what a token file stores instead of the token.
pub type TokenDigest = [u8; 32];

/// The digest of `token`.
pub fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// True when two digests are equal, compared in constant time.
pub fn digests_match(a: &TokenDigest, b: &TokenDigest) -> bool {
    a.ct_eq(b).into()
}

/// The token of an `Authorization: Bearer <token>` header value, if it is one.
pub fn bearer(header: &[u8]) -> Option<&str> {
    let token = header.strip_prefix(b"Bearer ")?;
    std::str::from_utf8(token).ok().filter(|t| !t.is_empty())
}

/// A secret value: never printed, compared in constant time.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The secret itself; call only where it is used, never to log.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// This secret's SHA-256 digest.
    pub fn digest(&self) -> TokenDigest {
        digest(&self.0)
    }

    /// True when `presented` equals this secret (see the module documentation).
    pub fn matches(&self, presented: &str) -> bool {
        digests_match(&self.digest(), &digest(presented))
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_whole_tokens() {
        let s = Secret::new("abc");
        assert!(s.matches("abc"));
        assert!(!s.matches("abd"));
        assert!(!s.matches("ab"));
        assert!(!s.matches(""));
    }

    #[test]
    fn never_prints_its_value() {
        assert_eq!(format!("{:?}", Secret::new("abc")), "Secret(<redacted>)");
    }

    #[test]
    fn reads_bearer_headers_only() {
        assert_eq!(bearer(b"Bearer abc"), Some("abc"));
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"bearer abc"), None);
        assert_eq!(bearer(b"Bearer \xff"), None);
    }
}
