"""Incremental detokenization and the tokenizer worker, on SmolLM2's byte-level tokenizer.

Streaming one token at a time must give, concatenated, exactly the text of decoding the
whole sequence, never a replacement character for half of a UTF-8 character, and stop
strings cut the text right before them even when they straddle tokens. The worker checks
prompts against the scheduler's limits and turns tokens into text deltas; its sockets are
real ipc pipes in a temporary folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq
from helpers import SMOL, need

from minisgl.core import SamplingParams
from minisgl.engine.limits import UNLIMITED, EngineLimits
from minisgl.message.backend import (
    AbortMsg,
    SchedulerOutput,
    SchedulerStats,
    TokenMsg,
    UserMsg,
)
from minisgl.message.frontend import AcceptedMsg, DeltaMsg, RejectedMsg, TokenizeMsg
from minisgl.message.transport import Reader, address
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl.tokenizer.tokenizer import Tokenizer
from minisgl.tokenizer.worker import TokenizerWorker

EOS = 2  # <|im_end|>

TEXTS = {
    "ascii": "Hello, world! How are you today?",
    "accented": "Zoë's naïve café: ça va très bien, él está aquí, Ångström.",
    "cjk": "日本語のテキストと中文文本。한국어도 있어요.",
    "emoji": "Emoji: 😀🎉👍🏽 and flags 🇫🇷🇯🇵, done ✓",
    "mixed": "def f(x):\n    return x ** 2  # ∑ “quoted” — 42€\n\n\tend",
    "spaces": "   many   spaces\n\n\nand lines  ",
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(need(SMOL))


def run(
    tok: Tokenizer,
    ids: list[int],
    stop: list[str] = (),  # type: ignore[assignment]
    prompt: str = "Say:",
    skip_special_tokens: bool = True,
) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Feed `ids` one at a time; returns the deltas, the final flush and the detokenizer."""
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), list(stop), skip_special_tokens)
    deltas = [detok.add(t) for t in ids]
    return deltas, detok.finish(), detok


# ---- streaming equals decoding the whole -------------------------------------------------


@pytest.mark.parametrize("name", TEXTS)
def test_deltas_add_up_to_the_whole_decode(tok, name):
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    deltas, rest, _ = run(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids) == TEXTS[name]
    assert rest == ""  # nothing held back without stop strings
    so_far = ""
    for i, delta in enumerate(deltas):
        assert "\ufffd" not in delta, f"a half character sent after token {i}: {delta!r}"
        so_far += delta
        assert TEXTS[name].startswith(so_far)


def test_multibyte_characters_do_span_tokens(tok):
    # The UTF-8 cases above are only tests if some character is split across tokens.
    for name in ("cjk", "emoji"):
        ids = tok.encode(TEXTS[name], add_special_tokens=False)
        assert any("\ufffd" in tok.decode([t]) for t in ids), name


def test_each_first_token_keeps_its_leading_space(tok):
    # " world" after a prompt: decoded alone or inside the text, it starts with a space.
    ids = tok.encode(" world is round", add_special_tokens=False)
    deltas, _, _ = run(tok, ids, prompt="Hello")
    assert deltas[0] == " world"
    assert "".join(deltas) == " world is round"


def test_a_character_cut_short_at_the_end_is_not_sent_half(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    assert "\ufffd" in tok.decode(ids[:-1])
    deltas, rest, _ = run(tok, ids[:-1])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + rest == "ok"


# ---- stop strings -------------------------------------------------------------------------


def test_stop_string_cuts_the_text_before_it(tok):
    ids = tok.encode("The answer is 42. Next question", add_special_tokens=False)
    deltas, rest, detok = run(tok, ids, stop=["."])
    assert "".join(deltas) + rest == "The answer is 42"
    assert detok.stopped
    # The token that completed the stop string is where it stopped; later ones add nothing.
    at = [i for i in range(len(ids)) if "." in tok.decode(ids[: i + 1])][0]
    assert all(d == "" for d in deltas[at:])
    assert detok.add(ids[0]) == "" and detok.finish() == ""


def test_stop_string_across_tokens_is_caught(tok):
    ids = tok.encode("Hello world, goodbye world", add_special_tokens=False)
    stop = "lo wo"
    assert all(stop not in tok.decode([t]) for t in ids), "the stop string must straddle tokens"
    deltas, rest, detok = run(tok, ids, stop=[stop])
    assert "".join(deltas) + rest == "Hel"
    assert detok.stopped


def test_the_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("Hello world, goodbye world", add_special_tokens=False)
    deltas, rest, _ = run(tok, ids, stop=["goodbye", "", "lo w"])
    assert "".join(deltas) + rest == "Hel"
    # " world" completes two stop strings at once; the text ends where the first one begins.
    deltas, rest, _ = run(tok, ids, stop=["world", "lo w"])
    text = "".join(deltas) + rest
    assert text == "Hel", (
        f"BUG: stop strings 'world' and 'lo w' both complete at ' world'; got {text!r}, not "
        "'Hel': detokenizer.py _release cuts at each stop string in list order, and cutting "
        "at 'world' first removes the earlier 'lo w'; cut once, at the smallest match index"
    )


def held_back(text: str, stops: list[str]) -> int:
    """The specification: the longest tail of the text that begins some stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_possible_stop_prefix_is_held_back_then_released(tok):
    ids = tok.encode("We must STOP now, STO and ST", add_special_tokens=False)
    stops = ["STOP!", "now."]
    deltas, rest, detok = run(tok, ids, stop=stops)
    sent = ""
    held_any = False
    for i, delta in enumerate(deltas):
        sent += delta
        text = tok.decode(ids[: i + 1])
        held = held_back(text, stops)
        held_any |= held > 0
        assert sent == text[: len(text) - held], (i, sent, text)
    assert held_any, "this text must end in a stop-string prefix at some token"
    assert not detok.stopped
    assert rest == "ST"  # the end of the request releases what was held
    assert sent + rest == tok.decode(ids)


def test_stop_string_inside_the_prompt_does_not_count(tok):
    ids = tok.encode(" and then", add_special_tokens=False)
    deltas, rest, detok = run(tok, ids, stop=["STOP"], prompt="Please STOP")
    assert "".join(deltas) + rest == " and then"
    assert not detok.stopped


# ---- special tokens -----------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
def test_special_tokens(tok, skip):
    ids = [*tok.encode("Hi", add_special_tokens=False), EOS, 1]
    ids += tok.encode(" there", add_special_tokens=False)
    deltas, rest, _ = run(tok, ids, skip_special_tokens=skip)
    text = "".join(deltas) + rest
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip
    assert text == ("Hi there" if skip else "Hi<|im_end|><|im_start|> there")


# ---- the worker ---------------------------------------------------------------------------

FREE = SamplingParams(max_tokens=UNLIMITED)  # as the API sends a request without max_tokens
LIMITS = EngineLimits(
    max_seq_len=40, num_pages=25, page_size=4, max_running_req=8, vocab_size=49152
)


class Pipes:
    """The test's ends of the worker's sockets: it writes to "scheduler" and "api"."""

    def __init__(self, ipc_dir: Path) -> None:
        self.ctx = zmq.Context()
        self.scheduler = Reader(self.ctx, address(ipc_dir, "scheduler"))
        self.api = Reader(self.ctx, address(ipc_dir, "api"))

    def take(self, reader: Reader, n: int) -> list[Any]:
        out = [reader.recv(timeout_ms=10_000) for _ in range(n)]
        assert None not in out, out
        assert reader.recv(timeout_ms=100) is None, "one message too many"
        return out

    def close(self) -> None:
        self.scheduler.socket.close(linger=0)
        self.api.socket.close(linger=0)
        self.ctx.term()


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[TokenizerWorker, Pipes]]:
    need(SMOL)
    pipes = Pipes(tmp_path)
    w = TokenizerWorker(str(SMOL), str(tmp_path), LIMITS)
    yield w, pipes
    for r in (w.from_api, w.from_scheduler, w.to_api, w.to_scheduler):
        r.socket.close(linger=0)
    pipes.close()


def test_worker_accepts_what_fits(worker):
    w, pipes = worker
    prompts = [[1], list(range(LIMITS.max_seq_len - 1)), [0, LIMITS.vocab_size - 1]]
    for uid, ids in enumerate(prompts):
        w.handle_api(TokenizeMsg(uid, FREE, input_ids=ids))
    assert pipes.take(pipes.api, 3) == [AcceptedMsg(i, len(ids)) for i, ids in enumerate(prompts)]
    pipes.take(pipes.scheduler, 3)


@pytest.mark.parametrize(
    "limits,ids,code",
    [
        (LIMITS, [], None),
        (LIMITS, list(range(50)), "context_length_exceeded"),
        (LIMITS, list(range(40)), "context_length_exceeded"),
        (
            replace(LIMITS, max_seq_len=1000, num_pages=10, page_size=1),
            [1] * 12,
            "context_length_exceeded",
        ),
        (LIMITS, [5, 49152], None),
        (LIMITS, [-1], None),
    ],
    ids=["empty", "longer-than-context", "no-room-to-generate", "kv-cache", "id-big", "id-neg"],
)
def test_worker_refuses_with_the_schedulers_words(tmp_path, limits, ids, code):
    """The worker refuses what the scheduler would, with the same message, and marks a prompt
    that is too long with OpenAI's code."""
    pipes = Pipes(tmp_path)
    w = TokenizerWorker(str(need(SMOL)), str(tmp_path), limits)
    try:
        w.handle_api(TokenizeMsg(3, FREE, input_ids=ids))
        with pytest.raises(ValueError) as e:
            limits.check_prompt(ids)
        assert pipes.take(pipes.api, 1) == [RejectedMsg(3, str(e.value), code)]
        assert pipes.scheduler.recv(timeout_ms=100) is None
    finally:
        for r in (w.from_api, w.from_scheduler, w.to_api, w.to_scheduler):
            r.socket.close(linger=0)
        pipes.close()


def test_worker_holds_max_tokens_to_the_context(worker):
    w, pipes = worker
    room = LIMITS.max_seq_len - 2
    w.handle_api(TokenizeMsg(1, SamplingParams(max_tokens=room), input_ids=[1, 2]))
    w.handle_api(TokenizeMsg(2, SamplingParams(max_tokens=room + 1), input_ids=[1, 2]))
    accepted, refused = pipes.take(pipes.api, 2)
    assert accepted == AcceptedMsg(1, 2)
    assert refused.uid == 2 and refused.code == "context_length_exceeded", refused
    assert "lower max_tokens" in refused.message
    pipes.take(pipes.scheduler, 1)


def test_worker_accepts_a_prompt_and_forwards_the_tokens(worker, tok):
    w, pipes = worker
    params = SamplingParams(max_tokens=3)
    w.handle_api(TokenizeMsg(1, params, prompt="Hello"))
    messages = [{"role": "user", "content": "Hi"}]
    w.handle_api(TokenizeMsg(2, params, messages=messages))
    ids = tok.encode("Hello")
    chat = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert pipes.take(pipes.api, 2) == [AcceptedMsg(1, len(ids)), AcceptedMsg(2, len(chat))]
    assert pipes.take(pipes.scheduler, 2) == [UserMsg(1, ids, params), UserMsg(2, chat, params)]


@pytest.mark.parametrize(
    "msg",
    [
        TokenizeMsg(1, FREE, prompt=""),
        TokenizeMsg(1, FREE, input_ids=[]),
        TokenizeMsg(1, FREE, prompt="word " * 60),
        TokenizeMsg(1, FREE, input_ids=[10**6]),
        TokenizeMsg(1, FREE, messages=[{"role": "tool", "content": "x"}] * 40),
    ],
    ids=["empty", "empty-ids", "too-long", "outside-vocab", "too-long-chat"],
)
def test_worker_rejects_without_bothering_the_scheduler(worker, msg):
    w, pipes = worker
    w.handle_api(msg)
    (reply,) = pipes.take(pipes.api, 1)
    assert isinstance(reply, RejectedMsg) and reply.uid == 1 and reply.message
    assert pipes.scheduler.recv(timeout_ms=100) is None


STATS = SchedulerStats(1, 0, 100, 5, 0, 0)


def tokens_out(w: TokenizerWorker, uid: int, ids: list[int], last: str | None) -> None:
    """The scheduler's tokens for one request; `last` is the finish reason of the last one."""
    msgs = []
    for i, t in enumerate(ids):
        done = last is not None and i == len(ids) - 1
        msgs.append(TokenMsg(uid, t, done, last if done else None, 0, logprob=-0.5))
    w.handle_scheduler(SchedulerOutput(msgs, STATS))


def test_worker_turns_tokens_into_deltas(worker, tok):
    w, pipes = worker
    w.handle_api(TokenizeMsg(4, SamplingParams(logprobs=True, max_tokens=UNLIMITED), prompt="Hi"))
    pipes.take(pipes.api, 1)
    pipes.take(pipes.scheduler, 1)
    ids = tok.encode(" café 😀", add_special_tokens=False)
    tokens_out(w, 4, ids, "length")
    replies = pipes.take(pipes.api, len(ids) + 1)
    *deltas, stats = replies
    assert stats == STATS
    assert all(isinstance(d, DeltaMsg) and d.uid == 4 for d in deltas)
    assert "".join(d.text for d in deltas) == " café 😀"
    assert [d.token for d in deltas] == ids
    assert [d.token_text for d in deltas] == [tok.decode([t]) for t in ids]
    assert [d.finished for d in deltas] == [False] * (len(ids) - 1) + [True]
    assert deltas[-1].finish_reason == "length"
    # Finished: a late token for it is dropped.
    tokens_out(w, 4, ids[:1], None)
    assert pipes.take(pipes.api, 1) == [STATS]


def test_worker_ends_a_request_at_its_stop_string(worker, tok):
    w, pipes = worker
    w.handle_api(TokenizeMsg(5, FREE, prompt="The capital of France is", stop=["."]))
    pipes.take(pipes.api, 1)
    pipes.take(pipes.scheduler, 1)
    ids = tok.encode(" Paris. It is", add_special_tokens=False)  # " Paris", ".", ...
    tokens_out(w, 5, ids[:2], None)
    first, stopped, _ = pipes.take(pipes.api, 3)
    assert (first.text, first.finished) == (" Paris", False)
    assert (stopped.text, stopped.finished, stopped.finish_reason) == ("", True, "stop")
    assert pipes.take(pipes.scheduler, 1) == [AbortMsg(5)], "the scheduler must stop too"
    tokens_out(w, 5, ids[2:], None)  # already in flight: ignored
    assert pipes.take(pipes.api, 1) == [STATS]


def test_worker_stop_string_on_the_last_token_is_a_stop(worker, tok):
    w, pipes = worker
    w.handle_api(TokenizeMsg(6, SamplingParams(max_tokens=2), prompt="France:", stop=["."]))
    pipes.take(pipes.api, 1)
    pipes.take(pipes.scheduler, 1)
    ids = tok.encode(" Paris.", add_special_tokens=False)
    assert len(ids) == 2
    tokens_out(w, 6, ids, "length")  # the scheduler ends it for max_tokens at the same token
    first, last, _ = pipes.take(pipes.api, 3)
    assert first.text + last.text == " Paris" and last.finished
    assert last.finish_reason == "stop", (
        f"BUG: finish_reason {last.finish_reason!r} for a request cut at its stop string on "
        "its last allowed token: worker.py handle_token only sets 'stop' when the scheduler "
        "did not also finish it; check `detok.stopped` first"
    )


def test_worker_forwards_aborts_of_live_requests_only(worker):
    w, pipes = worker
    w.handle_api(AbortMsg(99))  # unknown: nothing to stop
    assert pipes.scheduler.recv(timeout_ms=100) is None
    w.handle_api(TokenizeMsg(7, FREE, prompt="Hi"))
    pipes.take(pipes.api, 1)
    pipes.take(pipes.scheduler, 1)
    w.handle_api(AbortMsg(7))
    assert pipes.take(pipes.scheduler, 1) == [AbortMsg(7)]
    tokens_out(w, 7, [42], None)  # a token already on its way: dropped
    assert pipes.take(pipes.api, 1) == [STATS]


def test_worker_passes_on_a_scheduler_refusal(worker):
    w, pipes = worker
    w.handle_api(TokenizeMsg(8, FREE, prompt="Hi"))
    pipes.take(pipes.api, 1)
    pipes.take(pipes.scheduler, 1)
    refusal = TokenMsg(8, -1, True, None, 0, error="no room")
    w.handle_scheduler(SchedulerOutput([refusal], STATS))
    assert pipes.take(pipes.api, 2) == [RejectedMsg(8, "no room"), STATS]
