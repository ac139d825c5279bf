//! Header values built without `core::fmt`, for the decision responses.

use axum::http::HeaderValue;

/// A header value built in a stack buffer, so the value's own bytes are the only allocation.
/// Decision responses build three per check; `core::fmt` took ~1 900 instructions for each,
/// this takes a few hundred.
#[derive(Debug)]
pub(crate) struct HeaderText {
    buf: [u8; 128],
    len: usize,
    /// Set when the text outgrew `buf`; `spill` then holds all of it.
    spill: Option<Vec<u8>>,
}

impl HeaderText {
    pub(crate) fn new() -> Self {
        Self {
            buf: [0; 128],
            len: 0,
            spill: None,
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, bytes: &[u8]) -> &mut Self {
        if let Some(v) = &mut self.spill {
            v.extend_from_slice(bytes);
        } else if let Some(dst) = self.buf.get_mut(self.len..self.len + bytes.len()) {
            dst.copy_from_slice(bytes);
            self.len += bytes.len();
        } else {
            let mut v = self.buf[..self.len].to_vec();
            v.extend_from_slice(bytes);
            self.spill = Some(v);
        }
        self
    }

    pub(crate) fn str(&mut self, s: &str) -> &mut Self {
        self.push(s.as_bytes())
    }

    /// `n` in decimal.
    pub(crate) fn num(&mut self, n: u64) -> &mut Self {
        let mut b = itoa::Buffer::new();
        self.push(b.format(n).as_bytes())
    }

    /// `n` in lower-case hex, zero-padded to at least `width` digits (at most 16).
    pub(crate) fn hex(&mut self, n: u64, width: usize) -> &mut Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut b = [0u8; 16];
        let digits = (16 - n.leading_zeros() as usize / 4).max(width.min(16));
        for (i, d) in b[16 - digits..].iter_mut().enumerate() {
            *d = DIGITS[(n >> (4 * (digits - 1 - i))) as usize & 0xf];
        }
        self.push(&b[16 - digits..])
    }

    /// The value, or `None` if it holds a byte a header value may not.
    pub(crate) fn value(&self) -> Option<HeaderValue> {
        match &self.spill {
            Some(v) => HeaderValue::from_bytes(v).ok(),
            None => HeaderValue::from_bytes(&self.buf[..self.len]).ok(),
        }
    }
}
