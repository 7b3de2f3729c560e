"""The speculative-decoding settings, checked where the engine's config is built."""

from __future__ import annotations

from typing import Any

DRAFTERS = ("off", "ngram")


def check_speculative(config: Any) -> None:
    """Raise ValueError naming the setting that is wrong (config: an EngineConfig)."""
    if config.speculative not in DRAFTERS:
        raise ValueError(
            f"speculative must be one of {', '.join(DRAFTERS)}, got {config.speculative!r}"
        )
    if config.num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {config.num_draft_tokens}")
    if config.speculative_max_bs < 1:
        raise ValueError(f"speculative_max_bs must be >= 1, got {config.speculative_max_bs}")


def add_speculative_options(p: Any) -> None:
    """The server's flags (p: the ConfigParser of server/args.py)."""
    p.config_option("speculative", choices=list(DRAFTERS), help="draft tokens, verify them")
    p.config_option("num_draft_tokens", type=int, help="the most drafts per request and step")
