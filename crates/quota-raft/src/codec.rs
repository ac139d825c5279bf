//! The one encoding used on disk and on the wire: postcard behind a one-byte format version.
//!
//! postcard is compact and fast but not self-describing, so a reader must know exactly which type
//! it decodes; the version byte lets a future format be told apart instead of decoding silently
//! wrong, and every redb table and HTTP route holds exactly one type.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The current format version, written as the first byte of every encoded value.
///
/// Bump it whenever an encoded type changes shape (postcard cannot tell): 2 added
/// `CoordinatorState::tenant_pins` (tenant-level pins), 3 plans (`plan_assignments`, the plan
/// operations) and a policy's shadow mode, 4 promoted subjects (`CoordinatorState::promoted`,
/// `Operation::SetPromoted`), 5 a region's daemons and agent role (`RegionState::daemons`,
/// `RegionState::agent`, `CoordinatorState::last_fence`, the agent operations), 6 a policy's
/// `debt_limit` and `after_the_fact`, so an older snapshot, log or peer message is refused by name
/// instead of decoding wrong.
pub const FORMAT_VERSION: u8 = 6;

/// Why bytes could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("empty input: expected a format version byte")]
    Empty,
    #[error("unknown format version {found} (this build reads {expected})")]
    UnknownVersion { found: u8, expected: u8 },
    #[error("postcard: {source}")]
    Postcard {
        #[from]
        source: postcard::Error,
    },
}

/// Encodes `value` as the version byte followed by its postcard bytes.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    Ok(postcard::to_extend(value, vec![FORMAT_VERSION])?)
}

/// Decodes bytes written by [`encode`], rejecting other versions and trailing garbage.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_versions(bytes, &[])
}

/// [`decode`], also reading the older `versions` a caller knows its type kept the shape of.
pub fn decode_versions<T: DeserializeOwned>(
    bytes: &[u8],
    versions: &[u8],
) -> Result<T, CodecError> {
    let (&version, body) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != FORMAT_VERSION && !versions.contains(&version) {
        return Err(CodecError::UnknownVersion {
            found: version,
            expected: FORMAT_VERSION,
        });
    }
    let (value, rest) = postcard::take_from_bytes(body)?;
    if !rest.is_empty() {
        return Err(CodecError::Postcard {
            source: postcard::Error::DeserializeBadEncoding,
        });
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_version_check() {
        let v: (u64, Option<String>) = (42, Some("x".into()));
        let bytes = encode(&v).unwrap();
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(decode::<(u64, Option<String>)>(&bytes).unwrap(), v);

        let mut wrong = bytes.clone();
        wrong[0] = 9;
        assert!(matches!(
            decode::<(u64, Option<String>)>(&wrong),
            Err(CodecError::UnknownVersion { found: 9, .. })
        ));
        assert!(matches!(decode::<u64>(&[]), Err(CodecError::Empty)));
        let mut trailing = bytes;
        trailing.push(0);
        assert!(decode::<(u64, Option<String>)>(&trailing).is_err());
        let mut old = encode(&7u64).unwrap();
        old[0] = 3;
        assert!(decode::<u64>(&old).is_err());
        assert_eq!(decode_versions::<u64>(&old, &[3]).unwrap(), 7);
    }

    proptest::proptest! {
        /// Peer input is untrusted: decoding garbage into any wire type is an error, never a
        /// panic or a huge allocation.
        #[test]
        fn arbitrary_bytes_never_panic(
            tail in proptest::collection::vec(proptest::num::u8::ANY, 0..256)
        ) {
            let mut bytes = vec![FORMAT_VERSION];
            bytes.extend_from_slice(&tail);
            let _ = decode::<quota_core::coordinator::Command>(&bytes);
            let _ = decode::<openraft::raft::AppendEntriesRequest<crate::TypeConfig>>(&bytes);
            let _ = decode::<openraft::raft::VoteRequest<u64>>(&bytes);
            let _ = decode::<crate::protocol::ForwardRequest>(&bytes);
            let _ = decode::<crate::protocol::SnapshotHeader>(&bytes);
        }
    }
}
