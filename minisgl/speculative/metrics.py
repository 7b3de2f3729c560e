"""What speculative decoding shows on /metrics: drafts proposed, drafts accepted, and the
accept length, the tokens a request gains from one verify forward.

The speed-up follows the accept length: a verify costs about one decode step on a GPU, so a
request that gains 3 tokens per verify decodes about 3x faster, and one that gains 1 (every
draft rejected) paid for its drafts for nothing. The acceptance rate, accepted over
drafted, says whether the drafter guesses well; the histogram says how the gains spread.
The scheduler keeps the running totals (speculative/step.py) and sends them with its stats;
the server reads them at every scrape. With speculation off there is nothing to show.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from minisgl.message.backend import SchedulerStats


def speculative_metrics(s: SchedulerStats) -> Iterator[Metric]:
    """The counters and the histogram of the scheduler's last report; none while it is off."""
    if s.spec_accepted_lengths is None:
        return
    yield CounterMetricFamily(
        "minisgl:spec_draft_tokens", "Draft tokens proposed.", value=s.spec_drafted_total
    )
    yield CounterMetricFamily(
        "minisgl:spec_accepted_tokens",
        "Draft tokens the model accepted.",
        value=s.spec_accepted_total,
    )
    # lengths[n]: verifies that accepted n drafts, so the request gained n + 1 tokens. The
    # buckets are 1 .. k + 1 tokens, k the most drafts: fixed for the server's lifetime.
    lengths, buckets, seen = s.spec_accepted_lengths, [], 0
    for n, count in enumerate(lengths):
        seen += count
        buckets.append((floatToGoString(n + 1), seen))
    buckets.append(("+Inf", seen))
    yield HistogramMetricFamily(
        "minisgl:spec_accept_length_tokens",
        "Per request and verify forward that checked its drafts: the tokens it gained,"
        " the accepted drafts and the model's own next token.",
        buckets=buckets,
        sum_value=sum((n + 1) * count for n, count in enumerate(lengths)),
    )
