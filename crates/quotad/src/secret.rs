//! A secret value (a token or a password) and the one way tokens are compared.
//!
//! A leaf: the API's bearer check, the peer endpoints and the decision path's forwarded-check
//! header all compare through [`Secret::matches`], and none of them pulls in another's module.

use std::fmt;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

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

    /// True when `presented` equals this secret. The comparison is constant-time over SHA-256
    /// digests, so neither the secret's bytes nor its length leak through timing.
    pub fn matches(&self, presented: &str) -> bool {
        let a = Sha256::digest(self.0.as_bytes());
        let b = Sha256::digest(presented.as_bytes());
        a.ct_eq(&b).into()
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
}
