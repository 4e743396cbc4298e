//! Random claim tokens.

use std::cell::Cell;
use std::fmt;

/// A random 128-bit token that identifies one claim or lock acquisition, so that only its
/// holder can complete or release it.
///
/// Tokens are unique, not secret: they guard against a holder whose lease ran out touching
/// what a later holder owns, not against an attacker who can read the store.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(u128);

thread_local! {
    // Seeded once per thread from the OS (a UUIDv4's randomness), then stepped: a token per
    // claim must not cost a system call on the hot path of every delivery.
    static NEXT: Cell<u128> = Cell::new(uuid::Uuid::new_v4().as_u128());
}

impl Token {
    /// A fresh token: distinct from every other token of this thread (a bijective mix of a
    /// counter), and from other threads' and processes' with overwhelming probability (each
    /// starts from 128 random bits).
    pub fn random() -> Self {
        let state = NEXT.with(|next| {
            let state = next.get().wrapping_add(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
            next.set(state);
            state
        });
        Token(mix(state))
    }
}

/// A bijection on `u128` (xor-shifts and multiplications by odd constants, each invertible)
/// that scatters consecutive counters across the whole range.
fn mix(mut x: u128) -> u128 {
    x ^= x >> 67;
    x = x.wrapping_mul(0x2545_F491_4F6C_DD1D_9E37_79B9_7F4A_7C15);
    x ^= x >> 59;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9_94D0_49BB_1331_11EB);
    x ^ (x >> 71)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_do_not_repeat() {
        let tokens: std::collections::HashSet<_> = (0..100_000).map(|_| Token::random()).collect();
        assert_eq!(tokens.len(), 100_000);
    }
}
