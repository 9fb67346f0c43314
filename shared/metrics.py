"""Prometheus metrics for one service process, and the one-line-per-request log.

Each service builds its metrics on its own CollectorRegistry (so several services can share a
process in tests) and exposes them over HTTP when `BATON_PROMETHEUS_PORT` is set: a number, or
`auto` for a free port, which is then written to the file `BATON_PROMETHEUS_FILE` names (`baton up`
does this for every child, into its log directory).
"""
from __future__ import annotations

import json
import logging
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PORT_ENV = "BATON_PROMETHEUS_PORT"
FILE_ENV = "BATON_PROMETHEUS_FILE"

request_log = logging.getLogger("baton.requests")


class ServiceMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("baton_requests", "Requests handled, by outcome", ["outcome"], registry=r)
        if role in ("router", "aggregated"):
            self.ttft = Histogram("baton_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
            self.itl = Histogram("baton_itl_seconds", "Time between token chunks", buckets=LATENCY_BUCKETS, registry=r)
            self.e2e = Histogram("baton_request_seconds", "Whole request latency", buckets=LATENCY_BUCKETS, registry=r)
            self.in_flight = Gauge("baton_requests_in_flight", "Requests being driven", registry=r)
            self.queued = Gauge("baton_queue_depth", "Requests waiting in the router's queue for capacity",
                                registry=r)
            self.queue_wait = Histogram("baton_queue_wait_seconds", "Time a request waited in the router's queue",
                                        buckets=LATENCY_BUCKETS + (60, 120, 300), registry=r)
        if role in ("prefill", "decode"):
            self.free_pages = Gauge("baton_free_pages", "Free KV pages", registry=r)
            self.free_slots = Gauge("baton_free_slots", "Free request slots (rings, aux rows)", registry=r)
            self.queue = Gauge("baton_queue_depth", "Requests waiting (prefill: queued; decode: awaiting state)",
                               registry=r)
        if role == "prefill":
            self.prefill_seconds = Histogram("baton_prefill_seconds", "Prefill batch compute time",
                                             buckets=LATENCY_BUCKETS, registry=r)
            self.transfer_bytes = Counter("baton_transfer_bytes", "Bytes written to decode workers", registry=r)
            self.transfer_seconds = Histogram("baton_transfer_seconds", "Per-request NIXL WRITE time",
                                              buckets=LATENCY_BUCKETS, registry=r)
            self.transfer_failures = Counter("baton_transfer_failures", "Failed or aborted transfers", registry=r)
            self.prefix_lookups = Counter("baton_prefix_cache_lookups", "Prompts looked up in the prefix cache, by "
                                          "result", ["result"], registry=r)
            self.cached_tokens = Counter("baton_prefix_cache_tokens", "Prompt tokens taken from the prefix cache",
                                         registry=r)
            self.computed_tokens = Counter("baton_prefill_computed_tokens", "Prompt tokens computed", registry=r)
            self.prefix_evictions = Counter("baton_prefix_cache_evictions", "Prefix cache entries evicted", registry=r)
            self.prefix_entries = Gauge("baton_prefix_cache_entries", "Prompt ends held by the prefix cache",
                                        registry=r)
        if role == "decode":
            self.active = Gauge("baton_decode_active", "Requests in the decode batch", registry=r)
            self.step_seconds = Histogram("baton_decode_step_seconds", "One batched decode step",
                                          buckets=LATENCY_BUCKETS, registry=r)
            self.tokens = Counter("baton_generated_tokens", "Tokens generated", registry=r)
            self.verify_steps = Counter("baton_spec_verify_steps", "Target forwards that verified drafts", registry=r)
            self.drafted = Counter("baton_spec_drafted", "Draft tokens proposed", registry=r)
            self.accepted = Counter("baton_spec_accepted", "Draft tokens accepted", registry=r)
            self.acceptance_length = Histogram("baton_spec_acceptance_length", "Tokens per verify step, per request",
                                               buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6), registry=r)
            self.turn_reused = Counter("baton_turn_cache_reused_tokens", "Prompt positions a reservation took from "
                                       "the turn cache (their full-attention KV was not sent)", registry=r)
            self.turn_entries = Gauge("baton_turn_cache_entries", "Finished prompts held by the turn cache",
                                      registry=r)
            self.turn_evictions = Counter("baton_turn_cache_evictions", "Turn cache entries evicted", registry=r)
            self.prefilled_here = Counter("baton_decode_prefilled_here", "Prompts decode computed itself, on an "
                                          "idle decode (router.prefill_on_decode_tokens): no transfer", registry=r)
        if role == "registry":
            self.workers = Gauge("baton_workers", "Registered workers", ["role"], registry=r)
            self.expired = Counter("baton_worker_leases_expired", "Workers dropped on lease expiry", registry=r)

    def serve_from_env(self) -> int | None:
        """Expose /metrics on $BATON_PROMETHEUS_PORT if set; returns the port."""
        wanted = os.environ.get(PORT_ENV, "")
        if not wanted:
            return None
        server, _ = start_http_server(0 if wanted == "auto" else int(wanted), addr="127.0.0.1",
                                      registry=self.registry)
        port = server.server_port
        if os.environ.get(FILE_ENV):
            with open(os.environ[FILE_ENV], "w") as f:
                json.dump({"port": port, "pid": os.getpid()}, f)
        return port


def log_request(service: str, request_id: str, **fields) -> None:
    """One structured line per request and service, keyed by the request id across services."""
    request_log.info(json.dumps({"service": service, "request_id": request_id, **fields}, default=str))


class Stamps(dict):
    """When one request passed each stage in a service, in ms of the system's monotonic clock.
    CLOCK_MONOTONIC is shared by every process on a machine, so the stamps that router, prefill and
    decode log for one request line up into a hop-by-hop timeline (bench/overhead.py)."""

    def mark(self, stage: str) -> None:
        self[stage] = round(time.monotonic() * 1000, 3)
