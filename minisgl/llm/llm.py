"""LLM: the offline API. Give it prompts, get completions; the scheduler does the rest."""

from __future__ import annotations

import itertools
import weakref  # [ch21]
from typing import Any

import torch
from tqdm import tqdm

from minisgl.core import SamplingParams
from minisgl.engine.config import check_model_files
from minisgl.llm.logprobs import add_logprobs  # [ch25]
from minisgl.message.backend import (
    StopMsg,  # [ch21]
    UserMsg,
)
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.kv_blocks import start_kv_events  # [ch27]
from minisgl.scheduler.ranks import share_messages, start_followers, stop_followers  # [ch21]
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer


class LLM:
    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype | None = None,
        device: str = "auto",
        **kwargs: Any,  # any other SchedulerConfig field: max_running_req, page_size, ...
    ) -> None:
        self.tokenizer = Tokenizer(model_path)
        config = SchedulerConfig(model_path, dtype=dtype, device=device, **kwargs)
        check_model_files(config)  # before any rank starts
        config, self._followers = start_followers(config)  # this process is rank 0  # [ch21]
        weakref.finalize(self, stop_followers, self._followers, 0.0)  # if never shut down  # [ch21]
        self.scheduler = Scheduler(config, self.tokenizer.eos_token_ids)
        self.scheduler.spec.together = True  # `generate` returns once every answer is in  # [ch26]
        self.kv_events = start_kv_events(config, self.scheduler)  # [ch27]
        self.engine = self.scheduler.engine
        self._uids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Complete every prompt; returns [{"text", "token_ids", "finish_reason", ...}] in order."""
        # >>> ch25
        # With `logprobs` (and `prompt_logprobs`) asked for, a result also has "logprobs": per
        # token, {"logprob", "top": {token id: logprob}} (and "prompt_logprobs": the same for
        # every prompt token, None for the first).
        # <<< ch25
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        msgs = [UserMsg(next(self._uids), self._token_ids(p), sp) for p, sp in zip(prompts, params)]
        for i, msg in enumerate(msgs):  # check them all before any starts: all or nothing
            try:
                self.scheduler.validate(msg)
                self.scheduler.grammar_pool.compile_now(msg.sampling_params)  # [ch25]
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        msgs = share_messages(msgs)  # the other ranks add them too, and step  # [ch21]
        for msg in msgs:
            self.scheduler.add_request(msg)

        results = {
            m.uid: {"token_ids": [], "finish_reason": None, "cached_tokens": 0} for m in msgs
        }
        bar = tqdm(total=len(msgs), desc="generate", disable=not use_tqdm)
        remaining = len(msgs)
        while remaining:
            for out in self.scheduler.step():
                # >>> ch25 a grammar that compiled above, forgotten and compiled again, failed
                if out.error is not None:
                    raise ValueError(out.error)
                # <<< ch25
                result = results[out.uid]
                result["token_ids"].append(out.token)
                result["cached_tokens"] = out.cached_tokens
                add_logprobs(result, out)  # [ch25]
                if out.finished:
                    result["finish_reason"] = out.finish_reason
                    remaining -= 1
                    bar.update()
            if self.kv_events is not None:  # one message a step  # [ch27]
                self.kv_events.publish()  # [ch27]
            if remaining:  # every step of every rank follows one share: nothing new  # [ch21]
                share_messages([])  # [ch21]
        bar.close()
        outputs = [results[m.uid] for m in msgs]
        for out in outputs:
            out["text"] = self.tokenizer.decode(out["token_ids"])
        return outputs

    def _token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt is a string or a list of token ids")
        return list(prompt)

    def shutdown(self) -> None:
        share_messages([StopMsg()])  # the other ranks leave their loops  # [ch21]
        self.scheduler.shutdown()
        if self.kv_events is not None:  # [ch27]
            self.kv_events.close()  # [ch27]
        stop_followers(self._followers)  # [ch21]
