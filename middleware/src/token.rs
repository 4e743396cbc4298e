//! Random claim tokens.

use std::fmt;

/// A random 128-bit token that identifies one claim or lock acquisition, so that only its
/// holder can complete or release it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u128);

impl Token {
    /// A fresh random token (UUID version 4 randomness: 122 random bits).
    pub fn random() -> Self {
        Token(uuid::Uuid::new_v4().as_u128())
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({self})")
    }
}
