use std::fmt;

use fastbloom::AtomicBloomFilter;

use super::store::{PreFilter, Verdict};
use crate::envelope::BusinessKey;
use crate::error::ConfigError;

/// A [`PreFilter`] on a Bloom filter (the `fastbloom` crate), for keys of any shape.
///
/// Sized once from the expected number of keys and the false-positive rate wanted at that
/// size: about 9.6 bits per key at 1 %, so ten million keys take about 12 MB. Lock-free;
/// clones of the layer share one filter. It cannot forget single keys: beyond the expected
/// count, false positives grow (more keys take the full path, none is skipped wrongly);
/// replace it with a larger one, or rebuild it, when that happens.
pub struct BloomPreFilter {
    filter: AtomicBloomFilter,
    expected_items: usize,
    false_positive_rate: f64,
}

impl BloomPreFilter {
    /// A filter for `expected_items` keys with false positives at `false_positive_rate`
    /// (between 0 and 1, exclusive) at that size.
    pub fn new(expected_items: usize, false_positive_rate: f64) -> Result<Self, ConfigError> {
        if expected_items == 0 {
            return Err(ConfigError::InvalidPreFilter {
                reason: "expected_items must be at least 1".into(),
            });
        }
        if !(false_positive_rate > 0.0 && false_positive_rate < 1.0) {
            return Err(ConfigError::InvalidPreFilter {
                reason: format!("false_positive_rate {false_positive_rate} is not between 0 and 1"),
            });
        }
        Ok(BloomPreFilter {
            filter: AtomicBloomFilter::with_false_pos(false_positive_rate).expected_items(expected_items),
            expected_items,
            false_positive_rate,
        })
    }
}

impl PreFilter for BloomPreFilter {
    fn check(&self, key: &BusinessKey) -> Verdict {
        if self.filter.contains(key.as_str()) {
            Verdict::MaybeSeen
        } else {
            Verdict::CertainlyNew
        }
    }

    fn remember(&self, key: &BusinessKey) {
        self.filter.insert(key.as_str());
    }
}

impl fmt::Debug for BloomPreFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BloomPreFilter")
            .field("expected_items", &self.expected_items)
            .field("false_positive_rate", &self.false_positive_rate)
            .field("bits", &self.filter.num_bits())
            .finish()
    }
}
