use super::*;

fn hello() -> Hello {
    Hello {
        member: "supervisor-0".into(),
        process_id: "p-1".into(),
        connection_epoch: 1,
        runtime_address: "http://127.0.0.1:7443".into(),
        capacity: 256,
        ..Hello::default()
    }
}

#[test]
fn hello_errors_name_the_setting_to_fix() {
    assert!(validate_hello(&hello()).is_ok());
    for (broken, setting) in [
        (
            Hello {
                member: String::new(),
                ..hello()
            },
            "OPENSHELL_SUPERVISOR_POOL_MEMBER",
        ),
        (
            Hello {
                member: "Bad_Name".into(),
                ..hello()
            },
            "OPENSHELL_SUPERVISOR_POOL_MEMBER",
        ),
        (
            Hello {
                runtime_address: "127.0.0.1:7443".into(),
                ..hello()
            },
            "OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS",
        ),
        // An empty DNS label: the supervisor refuses it too (plumbing::validate).
        (
            Hello {
                member: "a..b".into(),
                ..hello()
            },
            "OPENSHELL_SUPERVISOR_POOL_MEMBER",
        ),
        (
            Hello {
                runtime_address: "http://".into(),
                ..hello()
            },
            "OPENSHELL_SUPERVISOR_POOL_RUNTIME_ADDRESS",
        ),
        (Hello { capacity: 0, ..hello() }, "OPENSHELL_SUPERVISOR_POOL_CAPACITY"),
        (
            Hello {
                capacity: 257,
                ..hello()
            },
            "OPENSHELL_SUPERVISOR_POOL_CAPACITY",
        ),
    ] {
        let status = validate_hello(&broken).unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains(setting), "{}", status.message());
    }
    assert!(
        validate_hello(&Hello {
            connection_epoch: 0,
            ..hello()
        })
        .is_err()
    );
}
