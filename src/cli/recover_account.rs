//! `railguard recover-account`.

use std::path::PathBuf;
use std::process::ExitCode;

use super::config::{admin_endpoint, config_path, load};
use super::fail;

/// Make a poisoned account payable again, without lowering its mark.
///
/// A poisoned account's mark is above anything the token source has issued, so every grant of
/// its lock key is fenced out. This moves the token source past that mark (never lowering any
/// mark) through the running railguard's admin listener, recorded in railguard_audit with
/// REASON, and says what was done. Exit 0 when recovered or nothing was needed.
#[derive(clap::Args)]
pub(crate) struct Args {
    /// The running railguard's config file (for admin.listen).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The poisoned account's id, as workers send it in Fencing-Account.
    account: String,
    /// Why, for the audit record (required).
    #[arg(long)]
    reason: String,
    /// Print the admin listener's answer as JSON (fields `outcome`, `account`, `lock_key`,
    /// `mark`, `position`, `drawn`, `audit_id`), for scripts.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args) -> ExitCode {
    let Args {
        config,
        account,
        reason,
        json,
    } = args;
    let config = match load(&config_path(config)) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let answer = match railguard::admin::recover_account(
        &admin_endpoint(&config),
        &account,
        &reason,
    )
    .await
    {
        Ok(answer) => answer,
        Err(e) => return fail(&format!("recover-account {account}: {e}")),
    };
    if json {
        println!("{answer}");
        return ExitCode::SUCCESS;
    }
    match serde_json::from_str(&answer)
        .ok()
        .and_then(|a| describe(&a))
    {
        Some(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        None => fail(&format!(
            "recover-account {account}: an answer this command does not understand (the \
             recovery may have been made; `railguard marks {account}` and the audit record \
             say): {answer}"
        )),
    }
}

/// The admin listener's answer to a recovery, for people, as `marks` says a mark.
fn describe(answer: &serde_json::Value) -> Option<String> {
    let account = answer["account"].as_str()?;
    let lock_key = answer["lock_key"].as_str()?;
    let mark = answer["mark"].as_i64()?;
    let position = answer["position"].as_i64()?;
    let audit = answer["audit_id"].as_i64()?;
    let key = if lock_key == account {
        String::new()
    } else {
        format!(" (lock key {lock_key})")
    };
    match answer["outcome"].as_str()? {
        "recovered" => Some(format!(
            "{account}: recovered: the token source moved from {position} past the mark \
             {mark}{key}; a fresh draw came out at {}, and grants resume. Audit record {audit}.",
            answer["drawn"].as_i64()?
        )),
        "nothing_to_do" => Some(format!(
            "{account}: nothing to do: the token source is at {position}, already at or past the \
             mark {mark}{key}. Audit record {audit}."
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::describe;

    #[test]
    fn a_recovery_is_said_in_a_sentence() {
        let recovered = serde_json::json!({
            "outcome": "recovered", "account": "acct-p", "lock_key": "acct-p",
            "mark": 1000000, "position": 12, "drawn": 1000002, "audit_id": 7,
        });
        assert_eq!(
            describe(&recovered).unwrap(),
            "acct-p: recovered: the token source moved from 12 past the mark 1000000; a fresh \
             draw came out at 1000002, and grants resume. Audit record 7."
        );
        let nothing = serde_json::json!({
            "outcome": "nothing_to_do", "account": "acct-ok", "lock_key": "pay/acct-ok",
            "mark": 5, "position": 9, "audit_id": 8,
        });
        assert_eq!(
            describe(&nothing).unwrap(),
            "acct-ok: nothing to do: the token source is at 9, already at or past the mark 5 \
             (lock key pay/acct-ok). Audit record 8."
        );
        let unknown = serde_json::json!({
            "outcome": "lowered", "account": "a", "lock_key": "a", "mark": 1, "position": 0,
            "audit_id": 1,
        });
        assert_eq!(describe(&unknown), None);
    }
}
