"""The server's Prometheus metrics (`Metrics`, a registry of its own, kept by the engine thread)
and the middleware that counts requests by route and status (`CountRequests`)."""

from __future__ import annotations

from functools import partial

from serve.engine import Status


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        histogram = partial(Histogram, buckets=buckets, registry=r)
        self.requests = counter(
            "leyline_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"]
        )
        self.turns = counter("leyline_turns", "Turns the engine ended, by outcome", ["outcome"])
        self.prompt_tokens = counter(
            "leyline_prompt_tokens",
            "Prompt tokens of finished turns, by where their KV came from",
            ["source"],
        )
        self.completion_tokens = counter("leyline_completion_tokens", "Generated tokens")
        self.hit_rate = gauge(
            "leyline_cache_hit_rate", "(reused + spliced) / prompt tokens over all finished turns"
        )
        self.queue_depth = gauge("leyline_queue_depth", "Turns waiting for admission")
        self.running = gauge("leyline_running_turns", "Turns running")
        self.free_pages = gauge("leyline_free_pages", "Free KV pages in the pool")
        self.sessions = gauge("leyline_sessions", "Open engine sessions")
        self.sessions_closed = counter(
            "leyline_sessions_closed", "Named sessions the server closed, by reason", ["reason"]
        )
        self.ttft = histogram("leyline_ttft_seconds", "Arrival to first token")
        self.step = histogram("leyline_step_seconds", "One engine step")
        self.latency = histogram("leyline_turn_seconds", "Arrival to the turn's end")
        self._prompt = self._cached = 0

    def gauges(self, engine, requests) -> None:
        """The engine's gauges after a step (`requests`: those submitted, not yet ended)."""
        running = sum(1 for r in requests if r.status in (Status.PREFILL, Status.DECODE))
        self.running.set(running)
        self.queue_depth.set(len(requests) - running)
        self.free_pages.set(engine.pool.free_count())
        self.sessions.set(len(engine.sessions))

    def turn_done(self, job) -> None:
        st = job.request.stats
        self.prompt_tokens.labels("reused").inc(st.reused_tokens)
        self.prompt_tokens.labels("spliced").inc(st.spliced_tokens)
        self.prompt_tokens.labels("prefilled").inc(st.prefilled_tokens)
        self.completion_tokens.inc(len(job.request.output))
        self._prompt += st.prompt_tokens
        self._cached += st.reused_tokens + st.spliced_tokens
        self.hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)
        if st.first_token_s is not None:
            self.ttft.observe(st.first_token_s - job.arrived)
        if st.finished_s is not None:
            self.latency.observe(st.finished_s - job.arrived)


class CountRequests:
    """ASGI middleware counting requests by route and status (pure ASGI: streaming and
    disconnects pass through untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}  # an exception before any answer is a 500

        async def send_(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status["code"])).inc()
