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
