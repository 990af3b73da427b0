"""The server's Prometheus metrics (GET /metrics), in a registry of its own per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..result import Result

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
PASS_BUCKETS = (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dynatree_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("dynatree_queue_rejected", "requests answered 429 because the queue was full",
                                registry=r)
        self.prompt_tokens = Counter("dynatree_prompt_tokens", "prompt tokens of decoded requests", registry=r)
        self.completion_tokens = Counter("dynatree_completion_tokens", "tokens generated", registry=r)
        self.finished = Counter("dynatree_decodes", "decodes finished, by reason", ["reason"], registry=r)
        self.queue_depth = Gauge("dynatree_queue_depth", "requests waiting for the model", registry=r)
        self.running = Gauge("dynatree_running", "decodes running (0 or 1)", registry=r)
        self.tokens_per_pass = Histogram("dynatree_tokens_per_pass", "tokens committed per target pass, per request",
                                         buckets=PASS_BUCKETS, registry=r)
        self.latency = Histogram("dynatree_request_seconds", "submission to last token", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.ttft = Histogram("dynatree_time_to_first_token_seconds", "submission to first token (queue included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("dynatree_queue_seconds", "time waiting in the queue", buckets=LATENCY_BUCKETS,
                                    registry=r)

    def observe(self, result: Result, queue_s: float, ttft_s: float | None, total_s: float, reason: str) -> None:
        """One finished decode."""
        stats = result.stats
        self.prompt_tokens.inc(result.prompt_tokens)
        self.completion_tokens.inc(stats.new_tokens)
        self.finished.labels(reason).inc()
        if stats.tokens_per_iter is not None:
            self.tokens_per_pass.observe(stats.tokens_per_iter)
        self.queue_wait.observe(queue_s)
        self.latency.observe(total_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def text(self) -> bytes:
        return generate_latest(self.registry)
