"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from failfast.decode.engine import GenerationResult

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("failfast_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("failfast_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("failfast_generated_tokens", "tokens generated for finished requests",
                                        registry=r)
        self.rounds = Counter("failfast_verification_rounds",
                              "target verification rounds of finished requests (a batched forward counts per row)",
                              registry=r)
        self.drafted = Counter("failfast_drafted_tokens", "draft tokens the target verified", registry=r)
        self.accepted = Counter("failfast_accepted_tokens", "draft tokens the target accepted", registry=r)
        self.tokens_per_round = Gauge("failfast_tokens_per_target_forward",
                                      "generated tokens per verification round, over all finished requests",
                                      registry=r)
        self.acceptance = Gauge("failfast_acceptance_rate", "accepted / verified draft tokens, over all requests",
                                registry=r)
        self.queue_depth = Gauge("failfast_queue_depth", "requests waiting for a batch slot", registry=r)
        self.running = Gauge("failfast_running_requests", "requests in the running batch", registry=r)
        self.latency = Histogram("failfast_request_latency_seconds", "time from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("failfast_time_to_first_token_seconds", "time from arrival to the first streamed text",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self._totals = {"tokens": 0, "rounds": 0, "drafted": 0, "accepted": 0}  # for the two ratios

    def finished(self, prompt_tokens: int, result: GenerationResult, latency_s: float,
                 first_text_s: float | None) -> None:
        s = result.stats
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(s.tokens)
        self.rounds.inc(s.rounds)
        self.drafted.inc(s.drafted)
        self.accepted.inc(s.accepted)
        t = self._totals
        t["tokens"] += s.tokens
        t["rounds"] += s.rounds
        t["drafted"] += s.drafted
        t["accepted"] += s.accepted
        self.tokens_per_round.set(t["tokens"] / t["rounds"] if t["rounds"] else 0.0)
        self.acceptance.set(t["accepted"] / t["drafted"] if t["drafted"] else 0.0)
        self.latency.observe(latency_s)
        if first_text_s is not None:
            self.first_token.observe(first_text_s)

    def batch(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.queue_depth.set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
