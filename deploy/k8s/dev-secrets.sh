#!/usr/bin/env bash
# Development Secrets for deploy/k8s (never for production): a fresh CA and certificates, a
# Redis user per service with a random password each (and the operator's), and one API key
# for tenant `dev`, which this prints. Needs kubectl pointed at the cluster and the
# specserve CLI (make install).
set -euo pipefail
SPECSERVE=${SPECSERVE:-.venv/bin/specserve}
NS=specserve
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

"$SPECSERVE" certs dev --out "$dir/tls" >/dev/null
"$SPECSERVE" redis-users --out "$dir/redis" --host redis:6379 >/dev/null
key="ssk_$(python3 -c 'import secrets; print(secrets.token_hex(6))')_$(python3 -c 'import secrets; print(secrets.token_hex(24))')"
printf -- '- {key: %s, tenant: dev, tier: standard}\n' "$key" >"$dir/keys.yaml"
rm -f "$dir/tls/ca-key.pem"  # the cluster never needs the CA's key

kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
apply() { kubectl -n "$NS" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -; }
apply specserve-redis --from-file="$dir/redis"  # redis.conf, url (the operator's), url-<service>
for service in gateway scheduler verifier drafter; do  # a TLS Secret per service: its key only
  apply "specserve-tls-$service" --from-file=ca.pem="$dir/tls/ca.pem" \
    --from-file="$service.pem=$dir/tls/$service.pem" \
    --from-file="$service-key.pem=$dir/tls/$service-key.pem"
done
kubectl -n "$NS" delete secret specserve-tls --ignore-not-found  # (the old one held every key)
apply specserve-api-keys --from-file=keys.yaml="$dir/keys.yaml"
echo "dev API key (tenant dev): $key"
