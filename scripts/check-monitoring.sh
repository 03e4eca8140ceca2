#!/usr/bin/env bash
# The monitoring component (kustomize/components/monitoring): render it through
# kustomize/overlays/production-monitoring with `kubectl kustomize`, take the PrometheusRule's
# groups out to a rules file and run `promtool check rules` and `promtool test rules` (the unit
# tests of every alert in rules.test.yaml) when promtool is installed (Debian: apt-get install
# prometheus); without it, says so and runs only the schema check: every alert with a
# severity, summary, description and a runbook_url whose anchor is a heading of
# kustomize/README.md, every alert tested in rules.test.yaml, and the dashboard ConfigMap
# (grafana_dashboard label, JSON with panels that each query something). Which metric names
# the rules and the dashboard may use is checked against real processes by
# e2e/tests/monitoring.rs.
#
# Needs kubectl and python3 with PyYAML. Exit status: 0 when everything passes, 1 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMPONENT="$ROOT/kustomize/components/monitoring"
OVERLAY="kustomize/overlays/production-monitoring"

die() { echo "check-monitoring: $*" >&2; exit 1; }
command -v kubectl >/dev/null 2>&1 || die "kubectl not found (it provides 'kubectl kustomize')"
python3 -c 'import yaml' 2>/dev/null || die "python3 with PyYAML (import yaml) not found"

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
kubectl kustomize "$ROOT/$OVERLAY" >"$OUT/rendered.yaml" || die "kubectl kustomize $OVERLAY failed"
echo "rendered  $OVERLAY ($(grep -c '^kind:' "$OUT/rendered.yaml") resources)"

python3 - "$OUT/rendered.yaml" "$OUT/rules.yaml" "$COMPONENT/rules.test.yaml" "$ROOT/kustomize/README.md" <<'PY'
import json
import re
import sys
import yaml

rendered, rules_out, tests_path, readme_path = sys.argv[1:5]
docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
errors = []

rules = [d for d in docs if d.get("kind") == "PrometheusRule"]
if len(rules) != 1:
    errors.append(f"expected one PrometheusRule, found {len(rules)}")
groups = rules[0]["spec"]["groups"] if rules else []
with open(rules_out, "w") as f:
    yaml.safe_dump({"groups": groups}, f, sort_keys=False)


def anchor(heading):
    # GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes.
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


anchors = {anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", open(readme_path).read(), re.M)}
tests = yaml.safe_load(open(tests_path))
tested = {t["alertname"] for case in tests["tests"] for t in case.get("alert_rule_test", [])
          if any(t.get("exp_alerts") or [])}
alerts = []
for group in groups:
    if not group.get("name") or not group.get("rules"):
        errors.append(f"group without a name or rules: {group}")
    for rule in group.get("rules", []):
        name = rule.get("alert")
        if not name:
            errors.append(f"a rule that is not an alert: {rule.get('record') or rule}")
            continue
        alerts.append(name)
        if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
            errors.append(f"{name}: no expr")
        if rule.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
            errors.append(f"{name}: severity must be critical, warning or info")
        notes = rule.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            if not notes.get(key):
                errors.append(f"{name}: no {key} annotation")
        url = notes.get("runbook_url", "")
        if not url.startswith("kustomize/README.md#") or url.split("#", 1)[1] not in anchors:
            errors.append(f"{name}: runbook_url {url!r} is not a heading of kustomize/README.md")
        if name not in tested:
            errors.append(f"{name}: no unit test in rules.test.yaml expects it to fire")
if len(set(alerts)) != len(alerts):
    errors.append("alert names repeat")

maps = [d for d in docs if d.get("kind") == "ConfigMap"
        and d.get("metadata", {}).get("labels", {}).get("grafana_dashboard") == "1"]
if len(maps) != 1:
    errors.append(f"expected one ConfigMap labelled grafana_dashboard: \"1\", found {len(maps)}")
for cm in maps:
    for key, text in cm.get("data", {}).items():
        try:
            dash = json.loads(text)
        except ValueError as err:
            errors.append(f"dashboard {key}: not JSON: {err}")
            continue
        panels = [p for p in dash.get("panels", []) if p.get("type") != "row"]
        if not dash.get("uid") or not dash.get("title") or not panels:
            errors.append(f"dashboard {key}: needs a uid, a title and panels")
        for p in panels:
            exprs = [t.get("expr", "") for t in p.get("targets", [])]
            if not exprs or not all(e.strip() for e in exprs):
                errors.append(f"dashboard panel {p.get('title')!r}: a target without a query")
for kind in ("PodMonitor",):
    for d in docs:
        if d.get("kind") == kind:
            for ep in d["spec"].get("podMetricsEndpoints", []):
                if ep.get("path") != "/metrics" or not ep.get("port"):
                    errors.append(f"{kind} {d['metadata']['name']}: endpoint must name a port and /metrics")

print(f"schema    {len(alerts)} alerts, {len(maps)} dashboard, "
      f"{sum(d.get('kind') == 'PodMonitor' for d in docs)} PodMonitors")
for e in errors:
    print(f"ERROR     {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY

if command -v promtool >/dev/null 2>&1; then
  cp "$COMPONENT/rules.test.yaml" "$OUT/rules.test.yaml"
  promtool check rules "$OUT/rules.yaml"
  (cd "$OUT" && promtool test rules rules.test.yaml)
else
  echo "check-monitoring: NOTE promtool is not installed: the alert expressions were NOT checked" \
       "or unit-tested (apt-get install prometheus, or a promtool on PATH); schema check only" >&2
fi
echo "check-monitoring: ok"
