//! `[runtime]`: the threads `railguard serve` runs its tasks on.

use serde::{Deserialize, Serialize};

use super::Invalid;

/// `[runtime]`: the threads `railguard serve` runs its tasks on.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Worker threads of the async runtime; 0 is one per CPU (as the process may use them:
    /// `available_parallelism`, which honours CPU affinity and cgroup quotas; tokio's
    /// `TOKIO_WORKER_THREADS` is not read). Every task (connections, the
    /// fence's batches, the database and rail clients) runs on these; a task woken from another
    /// thread costs a wake-up across threads, which is why fewer threads can cost less CPU per
    /// request when railguard shares its cores (docs/performance.md).
    pub worker_threads: usize,
}

impl RuntimeConfig {
    /// Most worker threads a configuration may ask for.
    pub const MAX_WORKER_THREADS: usize = 256;

    pub(super) fn validate(&self) -> Result<(), Invalid> {
        if self.worker_threads > Self::MAX_WORKER_THREADS {
            return Err((
                "runtime.worker_threads",
                format!(
                    "must be at most {} (0 is one per CPU)",
                    Self::MAX_WORKER_THREADS
                ),
            ));
        }
        Ok(())
    }
}
