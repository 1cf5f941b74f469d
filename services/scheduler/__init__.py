"""Scheduler: owns the queues and placement of requests on verifiers."""
