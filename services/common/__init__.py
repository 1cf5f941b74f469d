"""Infrastructure every service shares, none of it torch: settings, TLS, the gRPC server,
telemetry, process start, health probes, outage logging, and the small rules several services
apply alike (KV capacity, prefix hashes, rollout pools, the log-probability wire format)."""
