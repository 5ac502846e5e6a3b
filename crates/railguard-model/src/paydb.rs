//! The worker's own database (paydb) and its fenced UPDATE (C1 §1.6, FR-15).
//!
//! One row per account: its fence (the highest token that wrote it) and its queue of payments.
//! A worker *claims* a payment — the oldest fresh one, or one a previous holder claimed and
//! never completed (its outcome unknown: it is retried with the same id, as the harness's
//! workers do) — and later *completes* it. Both writes are the SDK's
//! `UPDATE … SET fence = $token WHERE id = $id AND fence <= $token`.
//!
//! The row also remembers which grant wrote it last. That is the model's ground truth, not a
//! column of the real table: it lets the properties see a stale writer whose UPDATE matched
//! (INV-05) or two grants writing under one token.

use crate::lock::{GrantId, Token};

/// Where a payment is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PaymentState {
    Pending,
    /// Claimed by a grant; its outcome at the rail is not known to paydb yet.
    Submitting,
    Done,
}

/// The `account` row and its payments.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AccountRow {
    pub fence: Token,
    pub last_writer: Option<GrantId>,
    pub payments: Vec<PaymentState>,
    /// Per payment, the token of the grant that first claimed it (0: never claimed, or no store
    /// may go back in this run, where it would never count): what the harness keeps in
    /// `payment.first_token` and every submit of it sends as `Idempotency-First-Token`.
    pub first: Vec<Token>,
}

/// What a fenced UPDATE did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FencedWrite {
    /// Zero rows matched: a newer token wrote the row.
    FencedOut,
    /// One row matched. `stale`: a grant made after this one had already written the row.
    /// `token_shared`: the row's fence already equalled the token, written by another grant.
    Updated { stale: bool, token_shared: bool },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PayDb {
    pub accounts: Vec<AccountRow>,
}

impl PayDb {
    pub fn new(accounts: u8, payments: u8) -> Self {
        Self {
            accounts: (0..accounts)
                .map(|_| AccountRow {
                    fence: 0,
                    last_writer: None,
                    payments: vec![PaymentState::Pending; payments as usize],
                    first: vec![0; payments as usize],
                })
                .collect(),
        }
    }

    /// The payments a holder of the account's lock may take next: the oldest pending one, and
    /// every one still `submitting` (claimed by a grant that never completed it: the harness
    /// retries those once its visibility timeout has passed — a clock, so here at any time).
    pub fn claimable(&self, account: u8) -> Vec<u8> {
        let payments = &self.accounts[account as usize].payments;
        let pending = payments.iter().position(|p| *p == PaymentState::Pending);
        payments
            .iter()
            .enumerate()
            .filter(|(i, p)| **p == PaymentState::Submitting || Some(*i) == pending)
            .map(|(i, _)| i as u8)
            .collect()
    }

    /// The fenced UPDATE of `account`'s row under `token`, by `grant`, setting `payment`'s
    /// state to `to` if it matches.
    pub fn fenced_update(
        &mut self,
        account: u8,
        token: Token,
        grant: GrantId,
        payment: u8,
        to: PaymentState,
    ) -> FencedWrite {
        let row = &mut self.accounts[account as usize];
        if row.fence > token {
            return FencedWrite::FencedOut;
        }
        let stale = row.last_writer.is_some_and(|w| w > grant);
        let token_shared = row.fence == token && row.last_writer.is_some_and(|w| w != grant);
        row.fence = token;
        row.last_writer = Some(grant);
        row.payments[payment as usize] = to;
        FencedWrite::Updated {
            stale,
            token_shared,
        }
    }
}
