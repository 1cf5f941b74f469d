"""Code shared by every service: settings, Redis schema, gRPC scaffolding, telemetry, models."""
