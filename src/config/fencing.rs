//! `[fencing]`: the compare-and-set at the proxy.

use serde::{Deserialize, Serialize};

use super::values::{self, AccountPathTemplate, LockKeyTemplate};
use super::{Invalid, nonzero};

/// `[fencing]`: the compare-and-set at the proxy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FencingConfig {
    /// Kill switch (C5 §5.2). `false` forwards stale requests too and only counts them;
    /// it exists to demonstrate the corruption on purpose.
    pub enforce: bool,
    /// Accounts whose last-known mark is kept in memory to reject stale tokens early (rounded
    /// up to a multiple of 64).
    pub cache_capacity: u64,
    /// Most compare-and-sets grouped into one statement and one commit (and most
    /// idempotency-record completions, grouped the same way).
    pub batch_max: usize,
    /// Fence statements in flight at once (at most `database.pool_size`); completion
    /// statements and last looks too, each separately. Fewer make larger batches, which cost
    /// PostgreSQL less per request (docs/performance.md). A statement that has not answered
    /// within a tenth of `database.timeout_ms` stops counting here (`store::batch::slots`).
    pub batch_concurrency: usize,
    /// Refuse (400) a token without a grant proof. `false` is a migration switch for workers
    /// that cannot send the proof yet: it logs a loud error at start, exports
    /// `railguard_fencing_proof_required 0`, and counts unproven tokens; a proof that is sent
    /// and wrong is still refused.
    pub require_proof: bool,
    /// The lock key whose grants fence an account: `{account}` is replaced by the account id.
    pub lock_key_template: LockKeyTemplate,
    /// Where the rail's request path names the account (`/accounts/{account}/`): a request
    /// whose path does not name its `Fencing-Account` is refused (403). `""`: not checked.
    #[serde(with = "values::account_path")]
    pub account_in_path: Option<AccountPathTemplate>,
    /// Whether a forward another railguard process may still have on its way to the rail holds
    /// back this process's newer tokens for the account (`store::handover`). `false`
    /// exists only to show, in the fault harness, what goes wrong without it: it is logged
    /// loudly and `railguard_cross_process_order` is 0.
    pub order_across_processes: bool,
}

impl Default for FencingConfig {
    fn default() -> Self {
        Self {
            enforce: true,
            cache_capacity: 100_000,
            batch_max: 512,
            batch_concurrency: 1,
            require_proof: true,
            lock_key_template: LockKeyTemplate::default(),
            account_in_path: None,
            order_across_processes: true,
        }
    }
}

impl FencingConfig {
    pub(super) fn validate(&self) -> Result<(), Invalid> {
        nonzero("fencing.cache_capacity", self.cache_capacity)?;
        nonzero("fencing.batch_max", self.batch_max as u64)?;
        if self.batch_max > 10_000 {
            return Err(("fencing.batch_max", "must be at most 10000".into()));
        }
        nonzero("fencing.batch_concurrency", self.batch_concurrency as u64)
    }
}
