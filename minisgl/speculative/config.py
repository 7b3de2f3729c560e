"""The speculative-decoding settings: part of the engine's config, checked where it is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DRAFTERS = ("off", "ngram", "suffix", "draft")


@dataclass(kw_only=True)
class SpeculativeConfig:
    """Speculative decoding: "off", "ngram" (prompt lookup), "suffix" (this and earlier
    requests' text) or "draft" (a smaller model)."""

    speculative: str = "off"
    draft_model: str | None = None  # with "draft": a smaller model folder, the same vocabulary
    num_draft_tokens: int = 8  # the most drafts a request proposes per step
    speculative_max_bs: int = 8  # larger batches do not speculate; smaller: the costs decide
    speculative_always: bool = False  # verify all drafts, even where steps measured say no

    def check_speculative(self, tp_size: int) -> None:
        """Raise ValueError naming the setting that is wrong."""
        if self.speculative not in DRAFTERS:
            raise ValueError(
                f"speculative must be one of {', '.join(DRAFTERS)}, got {self.speculative!r}"
            )
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.speculative_max_bs < 1:
            raise ValueError(f"speculative_max_bs must be >= 1, got {self.speculative_max_bs}")
        if self.speculative != "draft":
            if self.draft_model is not None:
                raise ValueError(
                    f"draft_model is used only with speculative 'draft', not {self.speculative!r}"
                )
            return
        if not self.draft_model:
            raise ValueError("speculative 'draft' needs draft_model: a smaller model's folder")
        if tp_size > 1:
            raise ValueError(
                "a draft model runs on one device: speculative 'draft' needs tp_size 1"
            )


def check_draft_model(config: Any) -> None:
    """With a draft model (config: an EngineConfig): a draft is a token id that the model reads
    as the same text, so the draft model must share the model's tokenizer; the size of the
    vocabulary is what can be checked."""
    if config.speculative != "draft":
        return
    if not (Path(config.draft_model) / "config.json").is_file():
        raise ValueError(f"draft_model {config.draft_model} is not a model folder (no config.json)")
    from minisgl.models.config import ModelConfig  # torch: only where a draft model is asked for

    draft = ModelConfig.from_path(config.draft_model).vocab_size
    target = ModelConfig.from_path(config.model_path).vocab_size
    if draft != target:
        raise ValueError(
            f"draft_model {config.draft_model} has a vocabulary of {draft} tokens, the model "
            f"{target}: a draft model must share the model's tokenizer"
        )


def add_speculative_options(p: Any) -> None:
    """The server's flags (p: the ConfigParser of server/args.py)."""
    p.config_option("speculative", choices=list(DRAFTERS), help="draft tokens, verify them")
    p.config_option("num_draft_tokens", type=int, help="the most drafts per request and step")
    p.config_option("draft_model", help="with --speculative draft: a smaller model folder")
    p.config_option(
        "speculative_max_bs",
        type=int,
        help="larger decode batches take plain steps (default 8); smaller ones speculate "
        "where the step times measured at their size say it pays",
    )
    p.config_option(
        "speculative_always",
        action="store_true",
        help="verify every draft, even where the measured step times say it does not pay",
    )
