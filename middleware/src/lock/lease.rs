use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

/// The lock a delivery holds, as the tiers behind and the handler see it in the envelope's
/// [extensions](crate::Envelope::extensions).
///
/// ```
/// # use oncely::{Envelope, lock::LockLease};
/// # fn f(envelope: &Envelope) {
/// if let Some(lease) = envelope.extensions().get::<LockLease>() {
///     // Write `lease.fencing_token()` next to the business row and refuse older tokens.
///     let _ = lease.fencing_token();
/// }
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct LockLease {
    fencing_token: u64,
    lost: CancellationToken,
}

impl LockLease {
    pub(super) fn new(fencing_token: u64) -> Self {
        LockLease {
            fencing_token,
            lost: CancellationToken::new(),
        }
    }

    /// The acquisition's fencing token: larger than any token handed out before for the same
    /// entity.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// True once the lease has been lost: another holder may be running. Stop, and do not
    /// commit anything that assumes exclusivity.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Completes when the lease is lost; for `tokio::select!` around a long step.
    pub fn lost(&self) -> WaitForCancellationFuture<'_> {
        self.lost.cancelled()
    }

    pub(super) fn mark_lost(&self) {
        self.lost.cancel();
    }
}
