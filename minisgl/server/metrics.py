"""Counters and histograms for /metrics, written out in the Prometheus text format."""

from __future__ import annotations

import bisect

from minisgl.message.backend import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(_LATENCY_BUCKETS, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip([*map(str, _LATENCY_BUCKETS), "+Inf"], self.counts):
            total += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {total}"]
        return lines


class Metrics:
    def __init__(self, kv_pages_total: int = 0) -> None:
        self.requests = 0
        self.failed_requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram("minisgl_time_to_first_token_seconds", "Time to first token.")
        self.tpot = Histogram(
            "minisgl_time_per_output_token_seconds", "Time per output token after the first."
        )
        # Until the scheduler's first report: idle, with the pool size it announced at start-up.
        self.stats = SchedulerStats(0, 0, kv_pages_total, 0, 0, 0)

    def render(self) -> str:
        s = self.stats
        values = [
            ("requests_total", "counter", "Requests accepted.", self.requests),
            (
                "failed_requests_total",
                "counter",
                "Requests refused with an error.",
                self.failed_requests,
            ),
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of accepted requests.",
                self.prompt_tokens,
            ),
            ("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
            (
                "cached_tokens_total",
                "counter",
                "Prompt tokens served from the prefix cache.",
                s.cached_tokens_total,
            ),
            (
                "preemptions_total",
                "counter",
                "Requests preempted for KV space.",
                s.preemptions_total,
            ),
            ("num_requests_running", "gauge", "Requests in the scheduler.", s.running),
            ("num_requests_waiting", "gauge", "Requests queued for prefill.", s.queued),
            ("kv_pages_total", "gauge", "Pages in the KV cache.", s.kv_pages_total),
            ("kv_pages_in_use", "gauge", "KV pages held by running requests.", s.kv_pages_in_use),
        ]
        lines = []
        for name, kind, help_text, value in values:
            lines += [
                f"# HELP minisgl_{name} {help_text}",
                f"# TYPE minisgl_{name} {kind}",
                f"minisgl_{name} {value}",
            ]
        lines += self.ttft.render() + self.tpot.render()
        return "\n".join(lines) + "\n"
