use super::*;

#[test]
fn bad_mode_annotation_falls_back_with_warning() {
    let injector = Injector::new(InjectConfig::default());
    let pod = json!({
        "metadata": { "annotations": { SIDECAR_MODE_ANNOTATION: "sideways" } },
        "spec": {
            "securityContext": { "runAsUser": 1000 },
            "containers": [ { "name": "app", "image": "x" } ]
        }
    });
    let Ok(Decision::Inject(injection)) = injector.mutate_pod(&pod, "team-a") else {
        panic!("expected an injection");
    };
    assert_eq!(injection.mode, SidecarMode::Native);
    assert_eq!(injection.warnings.len(), 1);
    assert!(injection.warnings[0].contains("sideways"));
}

#[test]
fn wrong_types_are_errors_not_panics() {
    let injector = Injector::new(InjectConfig::default());
    for (pod, expected) in [
        (json!({ "metadata": {} }), InjectError::MissingSpec),
        (json!({ "spec": {} }), InjectError::MissingContainers),
        (
            json!({ "spec": { "containers": {} } }),
            InjectError::WrongType("spec.containers".into(), "an array"),
        ),
        (
            json!({ "spec": { "containers": [], "volumes": "x" } }),
            InjectError::WrongType("spec.volumes".into(), "an array"),
        ),
        (
            json!({ "spec": { "containers": [ { "name": "a", "env": 3 } ] } }),
            InjectError::WrongType("spec.containers[0].env".into(), "an array"),
        ),
        (
            json!({ "metadata": 7, "spec": { "containers": [] } }),
            InjectError::WrongType("metadata".into(), "an object"),
        ),
        (
            json!({ "metadata": { "labels": "x" }, "spec": { "containers": [] } }),
            InjectError::WrongType("metadata.labels".into(), "an object"),
        ),
        (
            json!({ "spec": { "containers": [ { "name": "a", "volumeMounts": 3 } ] } }),
            InjectError::WrongType("spec.containers[0].volumeMounts".into(), "an array"),
        ),
    ] {
        assert_eq!(injector.mutate_pod(&pod, "team-a"), Err(expected));
    }
}

#[test]
fn a_volume_with_our_name_is_refused_not_reused() {
    let injector = Injector::new(InjectConfig::default());
    for volume in [
        json!({ "name": TOKEN_VOLUME, "emptyDir": {} }),
        json!({ "name": STATE_VOLUME, "emptyDir": {} }),
    ] {
        let pod = json!({ "spec": { "containers": [ { "name": "app" } ], "volumes": [volume] } });
        let Ok(Decision::Refuse(refusal)) = injector.mutate_pod(&pod, "team-a") else {
            panic!("expected a refusal");
        };
        assert_eq!(refusal.reason(), refuse::RefuseReason::VolumeDeclared);
    }
}

#[test]
fn security_fields_of_the_wrong_type_are_errors_not_a_pass() {
    let injector = Injector::new(InjectConfig::default());
    for (spec, expected) in [
        (
            json!({ "containers": [ { "name": "a", "securityContext": { "privileged": "yes" } } ] }),
            "spec.containers[0].securityContext.privileged",
        ),
        (
            json!({ "containers": [ { "name": "a", "securityContext": { "capabilities": { "add": [7] } } } ] }),
            "spec.containers[0].securityContext.capabilities.add[]",
        ),
        (
            json!({ "containers": [], "initContainers": [ { "name": "i", "volumeDevices": {} } ] }),
            "spec.initContainers[0].volumeDevices",
        ),
        (json!({ "containers": [], "hostPID": 1 }), "spec.hostPID"),
        (
            json!({ "containers": [], "volumes": [ { "name": "v", "projected": { "sources": {} } } ] }),
            "spec.volumes[0].projected.sources",
        ),
    ] {
        let pod = json!({ "spec": spec });
        match injector.mutate_pod(&pod, "team-a") {
            Err(InjectError::WrongType(path, _)) => assert_eq!(path, expected),
            other => panic!("{expected}: {other:?}"),
        }
    }
}
