use super::*;

#[test]
fn foreign_entries_leave_out_the_callers_own() {
    assert_eq!(
        Foreign::from_row(7, &[7, 3, 9], &[40, 12, 5]),
        Foreign(vec![(3, 12), (9, 5)])
    );
    assert!(Foreign::from_row(7, &[7], &[40]).is_empty());
}

#[test]
fn an_entry_is_settled_below_the_horizon_unless_a_lower_one_of_its_account_is_pending() {
    let row = Published {
        horizon: 10,
        seqs: vec![4, 8],
        accounts: vec![account_hash("a"), account_hash("b")],
        quiet: false,
    };
    assert!(!row.settled("a", 4), "4 of a is pending");
    assert!(!row.settled("a", 6), "4 <= 6 of a is pending");
    assert!(row.settled("a", 3), "nothing of a at or below 3 is pending");
    assert!(row.settled("b", 7));
    assert!(!row.settled("b", 9));
    assert!(
        !row.settled("c", 10),
        "10 was not handed out when the row was written"
    );
    assert!(row.settled("c", 9));
    let quiet = Published { quiet: true, ..row };
    assert!(
        quiet.settled("a", 4),
        "a quiet process can send nothing more"
    );
}

#[test]
fn a_row_read_before_settles_only_entries_below_its_horizon() {
    let row = |horizon, seqs: Vec<i64>, accounts: &[&str], quiet| Published {
        horizon,
        seqs,
        accounts: accounts.iter().map(|a| account_hash(a)).collect(),
        quiet,
    };
    let at = Instant::now();
    let mut read = Remembered::default();
    let entry = |instance, seq| Foreign(vec![(instance, seq)]);
    let settled = |read: &Remembered, account, foreign: &Foreign| {
        read.settled(account, foreign, at).is_some()
    };
    assert!(
        !settled(&read, "a", &entry(3, 1)),
        "process 3 was never read"
    );
    read.keep(HashMap::from([(3, row(10, vec![4], &["a"], false))]), at);
    assert!(settled(&read, "a", &entry(3, 3)));
    assert!(settled(&read, "b", &entry(3, 9)));
    assert!(!settled(&read, "a", &entry(3, 4)), "4 of a was pending");
    assert!(
        !settled(&read, "b", &entry(3, 10)),
        "10 was handed out after the row was written"
    );
    assert!(
        !settled(&read, "b", &Foreign(vec![(3, 2), (5, 2)])),
        "every entry must be settled, process 5's too"
    );
    assert_eq!(
        read.settled("a", &entry(3, 3), at),
        Some(Foreign::default()),
        "a running process's entry stays: its next compare-and-set replaces it"
    );
    // A quiet process's row settles what it had handed out when written, nothing later: it
    // may have run again since, and handed out more. Its entries are to be removed.
    read.keep(HashMap::from([(5, row(7, vec![6], &["a"], true))]), at);
    assert!(settled(&read, "a", &entry(5, 6)));
    assert!(!settled(&read, "a", &entry(5, 7)));
    assert_eq!(
        read.settled("b", &Foreign(vec![(3, 2), (5, 2)]), at),
        Some(entry(5, 2))
    );
    // A read that ended later but saw an earlier write does not replace a later one.
    read.keep(HashMap::from([(3, row(8, vec![], &[], false))]), at);
    assert!(
        settled(&read, "b", &entry(3, 9)),
        "the row of horizon 10 stays"
    );
    read.keep(HashMap::from([(3, row(12, vec![11], &["b"], false))]), at);
    assert!(settled(&read, "a", &entry(3, 11)));
    assert!(!settled(&read, "b", &entry(3, 11)));
    // A row read longer ago than REREAD_AFTER is read again: a process that stopped since is
    // then seen quiet.
    assert!(
        read.settled("a", &entry(3, 11), at + REREAD_AFTER)
            .is_none()
    );
    assert!(
        read.settled(
            "a",
            &entry(3, 11),
            at + REREAD_AFTER - Duration::from_millis(1)
        )
        .is_some()
    );
}
