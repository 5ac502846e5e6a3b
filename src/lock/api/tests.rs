use super::*;

#[test]
fn a_request_finds_its_operation_or_a_404_or_a_405() {
    let find = |action, method| Operation::find(action, &method);
    assert_eq!(find(None, Method::GET).unwrap(), Operation::Inspect);
    assert_eq!(
        find(Some("acquire"), Method::POST).unwrap(),
        Operation::Acquire
    );
    assert_eq!(find(Some("renew"), Method::POST).unwrap(), Operation::Renew);
    assert_eq!(
        find(Some("release"), Method::POST).unwrap(),
        Operation::Release
    );
    for (action, method) in [
        (None, Method::POST),
        (Some("acquire"), Method::GET),
        (Some("release"), Method::DELETE),
    ] {
        assert!(matches!(
            find(action, method),
            Err(ApiError::MethodNotAllowed(_))
        ));
    }
    for action in ["steal", "", "acquire/more"] {
        assert!(matches!(
            find(Some(action), Method::POST),
            Err(ApiError::NotFound)
        ));
    }
}
