//! PLACEHOLDER — the reference sliding window (issue 2, owned by the store work).
