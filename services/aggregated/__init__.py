"""The aggregated baseline: prefill and decode in one process, serving the public API."""
