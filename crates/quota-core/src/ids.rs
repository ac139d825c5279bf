//! Validated identifiers. Every id that reaches a Redis key, a log line or a metric label passes
//! through here first, so keys stay well-formed and raw secrets (API keys, IPs, e-mails) never
//! appear: those are turned into a one-way [`hashed_id`] before use.

use std::fmt;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{kind} must not be empty")]
    Empty { kind: &'static str },
    #[error("{kind} is {len} characters long; at most {max} are allowed")]
    TooLong {
        kind: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{kind} may contain only A-Z, a-z, 0-9, '_' and '-' (found {found:?} at position {position})")]
    BadChar {
        kind: &'static str,
        found: char,
        position: usize,
    },
}

fn validate(kind: &'static str, s: &str, max: usize) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty { kind });
    }
    let len = s.chars().count();
    if len > max {
        return Err(IdError::TooLong { kind, len, max });
    }
    if let Some((position, found)) = s
        .chars()
        .enumerate()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(IdError::BadChar {
            kind,
            found,
            position,
        });
    }
    Ok(())
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The longest accepted value, in characters.
            pub const MAX_LEN: usize = $max;

            /// Validates `s` and wraps it.
            pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                validate($kind, &s, $max)?;
                Ok(Self(s))
            }

            /// The validated string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                Self::new(s)
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

id_type!(
    /// A tenant (or subject) id: 1–96 characters of `[A-Za-z0-9_-]`.
    TenantId,
    "tenant id",
    96
);
id_type!(
    /// A policy name, e.g. `writes`: 1–64 characters of `[A-Za-z0-9_-]`.
    PolicyName,
    "policy name",
    64
);
id_type!(
    /// A region id, e.g. `eu-west`: 1–32 characters of `[A-Za-z0-9_-]`.
    RegionId,
    "region id",
    32
);
id_type!(
    /// A plan name, e.g. `default` or `pro`: 1–64 characters of `[A-Za-z0-9_-]`.
    PlanName,
    "plan name",
    64
);

/// The prefix of the reserved subject under which a plan's policies live in the coordinator
/// ([`TenantId::for_plan`]). Tenant ids that start with `--` are reserved for it.
const PLAN_PREFIX: &str = "--plan--";

/// What a reserved subject id stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// The one-way hash of an identity ([`hashed_id`]): `h-` and 32 lowercase hex digits.
    Identity,
    /// Internal: anything starting with `--` (a plan's policies live under `--plan--<plan>`).
    Internal,
}

impl TenantId {
    /// The reserved subject a plan's policies are stored under: no id a client may name as a
    /// tenant can spell it ([`TenantId::reserved`]).
    pub fn for_plan(plan: &PlanName) -> TenantId {
        TenantId(format!("{PLAN_PREFIX}{}", plan.as_str()))
    }

    /// The plan whose policies this reserved subject holds, if it is one.
    pub fn plan(&self) -> Option<PlanName> {
        PlanName::new(self.0.strip_prefix(PLAN_PREFIX)?).ok()
    }

    /// Whether this id is reserved: an identity's hash, or an internal subject. The daemon
    /// refuses reserved ids as tenants, so a crafted tenant id can never alias an identity
    /// or a plan.
    pub fn reserved(&self) -> Option<Reserved> {
        let s = self.0.as_str();
        if s.starts_with("--") {
            return Some(Reserved::Internal);
        }
        let hex = s.strip_prefix("h-")?;
        (hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then_some(Reserved::Identity)
    }

    /// A short one-way tag for logs: a tenant appears in a log line only as this.
    pub fn log_tag(&self) -> LogTag {
        let digest = Sha256::new_with_prefix(b"quotad-log-v1:")
            .chain_update(self.0.as_bytes())
            .finalize();
        LogTag(hex::encode(&digest[..6]))
    }
}

// Debug and Display of a tenant print its log tag, so a `?tenant` in a tracing macro cannot leak
// the id. Use `as_str()` where the id itself is meant (keys, API responses to its owner).
impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TenantId(#{})", self.log_tag())
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.log_tag())
    }
}

macro_rules! plain_display {
    ($name:ident) => {
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}
plain_display!(PolicyName);
plain_display!(RegionId);
plain_display!(PlanName);

/// A one-way tag of a tenant id, safe to log.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LogTag(String);

impl fmt::Display for LogTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Turns an untrusted raw identifier (an API key, an IP address, an e-mail) into a stable tenant
/// id that reveals nothing about it.
///
/// The hash is keyed with a deployment secret: an unkeyed hash of an IPv4 address or an e-mail
/// can be reversed by enumerating the (small) input space. The same secret and input always give
/// the same id, on every region, so quotas follow the identity across regions.
pub fn hashed_id(secret: &[u8], raw: &[u8]) -> TenantId {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(b"quotad-id-v1:");
    mac.update(raw);
    let tag = mac.finalize().into_bytes();
    // 128 bits is plenty against collisions among identities and keeps keys short.
    TenantId(format!("h-{}", hex::encode(&tag[..16])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet_and_lengths() {
        assert!(TenantId::new("acme_Corp-42").is_ok());
        assert!(TenantId::new("a".repeat(96)).is_ok());
        assert!(PolicyName::new("writes").is_ok());
        assert!(RegionId::new("eu-west-1").is_ok());
    }

    #[test]
    fn rejects_empty_long_and_foreign_characters() {
        assert_eq!(TenantId::new(""), Err(IdError::Empty { kind: "tenant id" }));
        assert!(matches!(
            TenantId::new("a".repeat(97)),
            Err(IdError::TooLong { len: 97, .. })
        ));
        for bad in ["a b", "a:b", "a{b}", "é", "a/b", "a\nb", "a*"] {
            assert!(
                matches!(TenantId::new(bad), Err(IdError::BadChar { .. })),
                "{bad:?} must be rejected"
            );
        }
        assert!(matches!(
            TenantId::new("ab{c"),
            Err(IdError::BadChar {
                found: '{',
                position: 2,
                ..
            })
        ));
    }

    #[test]
    fn deserialization_validates() {
        let ok: TenantId = serde_json::from_str("\"acme\"").unwrap();
        assert_eq!(ok.as_str(), "acme");
        assert!(serde_json::from_str::<TenantId>("\"ac me\"").is_err());
    }

    #[test]
    fn hashed_ids_are_stable_keyed_and_valid() {
        let a = hashed_id(b"secret", b"203.0.113.7");
        assert_eq!(a, hashed_id(b"secret", b"203.0.113.7"));
        assert_ne!(a, hashed_id(b"other", b"203.0.113.7"));
        assert_ne!(a, hashed_id(b"secret", b"203.0.113.8"));
        assert!(TenantId::new(a.as_str()).is_ok());
        assert!(!a.as_str().contains("203"));
    }

    #[test]
    fn identities_and_plans_are_reserved_subjects() {
        let id = hashed_id(b"secret", b"203.0.113.7");
        assert_eq!(id.reserved(), Some(Reserved::Identity));
        let plan = PlanName::new("pro").unwrap();
        let class = TenantId::for_plan(&plan);
        assert_eq!(class.reserved(), Some(Reserved::Internal));
        assert_eq!(class.plan(), Some(plan));
        // Look-alikes that are not the exact hashed form stay ordinary tenants.
        for t in ["acme", "h-abc", "h-0123456789ABCDEF0123456789abcdef", "-a"] {
            assert_eq!(TenantId::new(t).unwrap().reserved(), None, "{t}");
        }
        assert_eq!(TenantId::new("acme").unwrap().plan(), None);
        // The longest plan name still makes a valid id.
        let long = PlanName::new("p".repeat(PlanName::MAX_LEN)).unwrap();
        assert!(TenantId::new(TenantId::for_plan(&long).as_str()).is_ok());
    }

    #[test]
    fn debug_and_display_never_show_the_tenant() {
        let t = TenantId::new("acme-secret-customer").unwrap();
        assert!(!format!("{t:?}").contains("acme"));
        assert!(!format!("{t}").contains("acme"));
        assert_eq!(
            t.log_tag(),
            TenantId::new("acme-secret-customer").unwrap().log_tag()
        );
    }
}
