"""/metrics: the server's counters, gauges and latency histograms, through prometheus-client.

Every name starts with `minisgl:` (as vLLM's start with `vllm:`), and says its unit:
`_seconds`, `_tokens`, `_pages`; counters end in `_total`. Each server has a registry of
its own, so that several servers in one process (tests start them) never share a count.

The gauges are what the scheduler last reported (it sends its numbers after every step
that changed something); until its first report, the server shows an idle scheduler with
the KV cache it announced at start-up.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minisgl.message.backend import SchedulerStats
from minisgl.speculative.metrics import speculative_metrics  # [ch26]

# Latencies from a GPU's milliseconds to a loaded CPU's tens of seconds, about three
# buckets per factor of ten, so that a p99 read from the buckets is within ~2x anywhere.
CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no `_created` timestamp beside every counter and histogram

FIRST_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0,
)  # fmt: skip
PER_TOKEN_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0,
)  # fmt: skip


class Metrics:
    def __init__(self, kv_pages_total: int = 0) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("minisgl:requests", "Requests accepted.", registry=r)
        # An error rate is failed over accepted requests: both count requests that reached the
        # engine. Refusals at the door (a bad body, an unknown path or model) are counted apart.
        self.failed_requests = Counter(
            "minisgl:failed_requests", "Accepted requests that ended in an error.", registry=r
        )
        self.error_responses = Counter(
            "minisgl:error_responses",
            "HTTP answers with an error status, by status code.",
            ["status"],
            registry=r,
        )
        self.aborted_requests = Counter(
            "minisgl:aborted_requests",
            "Requests stopped unfinished: the client left, a sibling choice was refused,"
            " or the server failed or stopped.",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "minisgl:prompt_tokens", "Prompt tokens of accepted requests.", registry=r
        )
        self.generation_tokens = Counter(
            "minisgl:generation_tokens", "Tokens generated.", registry=r
        )
        self.ttft = Histogram(
            "minisgl:time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "minisgl:time_per_output_token_seconds",
            "Per request: the time after its first token, over the tokens after the first.",
            buckets=PER_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "minisgl:e2e_request_latency_seconds",
            "From a request's arrival to its last token.",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.open_requests = Gauge(
            "minisgl:num_requests_open",
            "Requests the API server holds for their clients: queued, running or streaming.",
            registry=r,
        )
        self.stats = SchedulerStats(0, 0, kv_pages_total, 0, 0, 0)
        r.register(_SchedulerCollector(self))

    def render(self) -> bytes:
        """The Prometheus text exposition format (content type CONTENT_TYPE)."""
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    """The scheduler's last report, read at every scrape: its running totals as counters,
    its state now as gauges."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        s = self.metrics.stats
        yield CounterMetricFamily(
            "minisgl:cached_tokens",
            "Prompt tokens served from the prefix cache.",
            value=s.cached_tokens_total,
        )
        yield CounterMetricFamily(
            "minisgl:preemptions", "Requests preempted for KV space.", value=s.preemptions_total
        )
        yield GaugeMetricFamily(
            "minisgl:num_requests_running", "Requests in the scheduler.", value=s.running
        )
        yield GaugeMetricFamily(
            "minisgl:num_requests_waiting", "Requests queued for prefill.", value=s.queued
        )
        yield GaugeMetricFamily(
            "minisgl:kv_pages_capacity", "Pages in the KV cache.", value=s.kv_pages_total
        )
        yield GaugeMetricFamily(
            "minisgl:kv_pages_used", "KV pages held by running requests.", value=s.kv_pages_in_use
        )
        yield from speculative_metrics(s)  # [ch26]
