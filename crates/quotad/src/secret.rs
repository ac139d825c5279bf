//! A secret value (a token or a password) and the one way tokens are compared: quota-raft's
//! [`quota_raft::secret`], so the API, the peer endpoints and Raft's peer API share one
//! constant-time comparison.

pub use quota_raft::secret::{bearer, digest, digests_match, Secret, TokenDigest};
