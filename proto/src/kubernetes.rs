//! Kubernetes names the webhook and the gateway must agree on: the webhook injects what the
//! gateway follows and fills.

/// Label the webhook puts on every injected Pod; the gateway follows supervised Pods
/// cluster-wide with the selector `supervision.openshell.ai/supervised=true`.
pub const SUPERVISED_LABEL: &str = "supervision.openshell.ai/supervised";

/// Value of [`SUPERVISED_LABEL`].
pub const SUPERVISED_VALUE: &str = "true";

/// Label (and annotation) the webhook puts on a Pod of a labelled namespace it admitted without
/// supervision: the label's value is the reason code (`runs_as_root`, …), the annotation's the
/// sentence shown as the admission warning. The gateway follows such Pods by the label, counts
/// them in the pool status and records a `NotSupervised` Event on each.
pub const NOT_SUPERVISED_KEY: &str = "supervision.openshell.ai/not-supervised";

/// The trust Secret the gateway keeps in every labelled namespace (keys `trust.jwks` and
/// `ca.crt`), mounted read-only by the injected sidecars.
pub const TOKEN_SECRET: &str = "openshell-supervision-token";

/// Namespaces neither mutated by the webhook nor written by the gateway, whatever their labels
/// say.
pub const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

/// A Pod names the `SandboxPolicy` it runs with this annotation.
pub const POLICY_ANNOTATION: &str = "supervision.openshell.ai/policy";

/// The policy a Pod of the namespace runs when its annotation names none.
pub const DEFAULT_POLICY: &str = "default";
