"""What the API measures and reports: metrics, the request log, Prometheus."""
