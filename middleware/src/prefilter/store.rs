use crate::envelope::BusinessKey;

/// What a [`PreFilter`] says about a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The key was never remembered: no delivery of it was settled here.
    CertainlyNew,
    /// The key may have been settled before (or the filter cannot tell): take the full path.
    MaybeSeen,
}

/// A backend for the [pre-filter tier](crate::prefilter): a local, approximate memory of
/// settled keys.
///
/// Implementations must never answer [`Verdict::CertainlyNew`] for a key they were told to
/// [`remember`](PreFilter::remember); answering [`Verdict::MaybeSeen`] for a new key is
/// allowed (it only costs speed). Both calls are synchronous and must be cheap: they run on
/// every delivery, inside the async stack.
pub trait PreFilter: Send + Sync + 'static {
    /// Whether `key` is certainly new.
    fn check(&self, key: &BusinessKey) -> Verdict;

    /// Remembers `key` as settled.
    fn remember(&self, key: &BusinessKey);
}
