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
fn a_row_read_before_settles_only_entries_it_shows_answered() {
    let row = |horizon, seqs: Vec<i64>, accounts: &[&str], quiet| Published {
        horizon,
        seqs,
        accounts: accounts.iter().map(|a| account_hash(a)).collect(),
        quiet,
    };
    let at = Instant::now();
    let mut read = Remembered::default();
    let entry = |instance, seq| Foreign(vec![(instance, seq)]);
    assert!(
        !read.settled("a", &entry(3, 1), at),
        "process 3 was never read"
    );
    read.keep(HashMap::from([(3, row(10, vec![4], &["a"], false))]), at);
    assert!(read.settled("a", &entry(3, 3), at));
    assert!(read.settled("b", &entry(3, 9), at));
    assert!(!read.settled("a", &entry(3, 4), at), "4 of a was pending");
    assert!(
        !read.settled("b", &entry(3, 10), at),
        "10 was handed out after the row was written"
    );
    assert!(
        !read.settled("b", &Foreign(vec![(3, 2), (5, 2)]), at),
        "every entry must be settled, process 5's too"
    );
    // A quiet row settles nothing it shows pending: its process may write again and send it.
    // What it shows answered stays answered.
    read.keep(HashMap::from([(5, row(7, vec![6], &["a"], true))]), at);
    assert!(!read.settled("a", &entry(5, 6), at));
    assert!(!read.settled("a", &entry(5, 7), at));
    assert!(read.settled("b", &entry(5, 6), at));
    assert!(read.settled("b", &Foreign(vec![(3, 2), (5, 2)]), at));
    // A read that ended later but saw an earlier write does not replace a later one.
    read.keep(HashMap::from([(3, row(8, vec![], &[], false))]), at);
    assert!(
        read.settled("b", &entry(3, 9), at),
        "the row of horizon 10 stays"
    );
    read.keep(HashMap::from([(3, row(12, vec![11], &["b"], false))]), at);
    assert!(read.settled("a", &entry(3, 11), at));
    assert!(!read.settled("b", &entry(3, 11), at));
    // A row read REREAD_AFTER ago or longer is read again: a process that stopped since is
    // then seen quiet, and its entries removed.
    assert!(!read.settled("a", &entry(3, 11), at + REREAD_AFTER));
    assert!(read.settled(
        "a",
        &entry(3, 11),
        at + REREAD_AFTER - Duration::from_millis(1)
    ));
}
