#!/usr/bin/env bash
# Static checks of the packaging: hadolint on the Dockerfile, `docker-compose config` on
# deploy/compose.yaml (needs no Docker engine) and a strict schema check of every manifest under
# deploy/kubernetes. Run by .ci/run; needs hadolint, docker-compose, kubernetes-validate and
# cloudcoil-models-cert-manager (the versions .ci/run installs).
set -euo pipefail
cd "$(dirname "$0")/.."

hadolint Dockerfile
echo "Dockerfile: hadolint OK"

# Compose refuses to render without the secrets it interpolates: stand-ins here.
QUOTAD_ADMIN_TOKEN=check QUOTAD_PEER_TOKEN=check-peer-token-0123 QUOTAD_REDIS_PASSWORD=check \
    docker-compose -f deploy/compose.yaml config --quiet
echo "deploy/compose.yaml: docker-compose config OK"

# Every manifest but the kustomization, which is kustomize's and has no Kubernetes schema.
manifests=()
for f in deploy/kubernetes/*.yaml; do
    [ "$(basename "$f")" = kustomization.yaml ] || manifests+=("$f")
done

# Every document against its schema, unknown fields refused. Kubernetes' own kinds: the strict
# schemas of kubernetes-validate (as `kubernetes-validate --strict`). cert-manager's kinds
# (cert-manager.io/v1), which kubernetes-validate has no schema for and would pass with a
# warning: the schemas of cloudcoil-models-cert-manager, models generated from cert-manager's
# CRDs, with unknown fields refused the same way. A kind neither knows fails the check.
python3 - "${manifests[@]}" <<'PY'
import importlib.metadata
import sys

import jsonschema
import yaml
from cloudcoil.models.cert_manager import v1 as cert_manager
from kubernetes_validate import utils as kubernetes

CERT_MANAGER_KINDS = ("Certificate", "CertificateRequest", "Issuer", "ClusterIssuer")


def crd_schema(node):
    """The models' JSON schema as the CRD has it: no null for an absent field, and every
    object with listed properties closed to others (what kubernetes-validate's strict
    schemas do)."""
    if isinstance(node, list):
        return [crd_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: crd_schema(v) for k, v in node.items()}
    if "anyOf" in node:
        node["anyOf"] = [s for s in node["anyOf"] if s != {"type": "null"}]
        if len(node["anyOf"]) == 1:
            node.update(node.pop("anyOf")[0])
    if node.get("type") == "object" and "properties" in node:
        node.setdefault("additionalProperties", False)
    return node


validators = {
    kind: jsonschema.Draft202012Validator(
        crd_schema(getattr(cert_manager, kind).model_json_schema(by_alias=True))
    )
    for kind in CERT_MANAGER_KINDS
}
version = kubernetes.latest_version()
failed = 0
checked = {"kubernetes": 0, "cert-manager": 0}
for path in sys.argv[1:]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for doc in docs:
        name = f"{path}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("apiVersion", "").startswith("cert-manager.io/"):
            validator = validators.get(doc.get("kind"))
            if validator is None or doc["apiVersion"] != "cert-manager.io/v1":
                print(f"ERROR {name}: no schema for {doc.get('apiVersion')} {doc.get('kind')}")
                failed += 1
                continue
            errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
            for e in errors:
                print(f"ERROR {name}: {'.'.join(map(str, e.path))}: {e.message}")
            failed += bool(errors)
            checked["cert-manager"] += 1
            continue
        try:
            kubernetes.validate(doc, version, strict=True)
            checked["kubernetes"] += 1
        except kubernetes.ValidationError as e:
            print(f"ERROR {name}: {'.'.join(map(str, e.path))}: {e.message}")
            failed += 1
        except kubernetes.SchemaNotFoundError as e:
            print(f"ERROR {name}: {e.message}")
            failed += 1
if failed:
    sys.exit(f"deploy/kubernetes: {failed} resources do not validate")
print(
    f"deploy/kubernetes: {checked['kubernetes']} resources valid against Kubernetes {version}"
    f" (kubernetes-validate {importlib.metadata.version('kubernetes-validate')}, strict),"
    f" {checked['cert-manager']} against cert-manager's CRDs (cloudcoil-models-cert-manager"
    f" {importlib.metadata.version('cloudcoil-models-cert-manager')}, strict)"
    f" in {len(sys.argv) - 1} files"
)
PY
