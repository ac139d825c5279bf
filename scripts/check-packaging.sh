#!/usr/bin/env bash
# Static checks of the packaging: hadolint on the Dockerfile, `docker-compose config` on
# deploy/compose.yaml (needs no Docker engine) and kubernetes-validate on every manifest under
# deploy/kubernetes. Run by .ci/run; needs hadolint, docker-compose and kubernetes-validate.
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
kubernetes-validate --strict --quiet "${manifests[@]}"
echo "deploy/kubernetes: kubernetes-validate OK (${#manifests[@]} files)"
