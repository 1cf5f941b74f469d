#!/usr/bin/env bash
# Development Secrets for deploy/k8s (never for production): a fresh CA and certificates, a
# random Redis password, and one API key for tenant `dev`, which this prints. Needs kubectl
# pointed at the cluster and the specserve CLI (make install).
set -euo pipefail
SPECSERVE=${SPECSERVE:-.venv/bin/specserve}
NS=specserve
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

"$SPECSERVE" certs dev --out "$dir/tls" >/dev/null
password=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
key="ssk_$(python3 -c 'import secrets; print(secrets.token_hex(6))')_$(python3 -c 'import secrets; print(secrets.token_hex(24))')"
printf 'requirepass %s\n' "$password" >"$dir/redis.conf"
printf 'redis://:%s@redis:6379/0' "$password" >"$dir/url"
printf -- '- {key: %s, tenant: dev, tier: standard}\n' "$key" >"$dir/keys.yaml"
rm -f "$dir/tls/ca-key.pem"  # the cluster never needs the CA's key

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
apply() { kubectl -n "$NS" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -; }
apply specserve-redis --from-file=url="$dir/url" --from-file=redis.conf="$dir/redis.conf"
for service in gateway scheduler verifier drafter; do  # a TLS Secret per service: its key only
  apply "specserve-tls-$service" --from-file=ca.pem="$dir/tls/ca.pem" \
    --from-file="$service.pem=$dir/tls/$service.pem" \
    --from-file="$service-key.pem=$dir/tls/$service-key.pem"
done
kubectl -n "$NS" delete secret specserve-tls --ignore-not-found  # (the old one held every key)
apply specserve-api-keys --from-file=keys.yaml="$dir/keys.yaml"
echo "dev API key (tenant dev): $key"
