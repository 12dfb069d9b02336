"""Telemetry: Prometheus metrics, OpenTelemetry traces and the GPU sampler."""
