"""Messages between processes: the msgpack codec, the ipc pipes, and the scheduler's loop.

The codec must round-trip every message type (the SamplingParams inside a request too),
refuse types it does not know, and never fall back to pickle. The pipes are real ZMQ ipc
sockets in a temporary folder. The scheduler loop `serve` runs in a thread against a real
Scheduler on SmolLM2 in fp32; its answers are compared with Hugging Face greedy decoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from helpers import SMOL, hf_greedy, need

from minisgl.core import SamplingParams
from minisgl.engine.limits import EngineLimits
from minisgl.message import backend, frontend
from minisgl.message.backend import (
    AbortMsg,
    FlushCacheMsg,  # [ch27]
    SchedulerOutput,
    SchedulerStats,
    StopMsg,  # [ch21]
    TokenMsg,
    UserMsg,
)
from minisgl.message.codec import decode, encode
from minisgl.message.dashboard import DashboardSnapshot, WatchMsg  # [ch30]
from minisgl.message.frontend import (
    AcceptedMsg,
    DeltaMsg,
    ReadyMsg,
    RejectedMsg,
    TokenizeMsg,
)
from minisgl.message.logprobs import PromptLogprobs, TokenLogprob  # [ch25]
from minisgl.message.transport import AsyncReader, AsyncWriter, Reader, Writer, address
from minisgl.scheduler import io
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

PARAMS = SamplingParams(
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    max_tokens=12,
    ignore_eos=True,
    stop_token_ids=[2, 7],
    seed=2**62,
    presence_penalty=0.5,
    frequency_penalty=-1.5,
    repetition_penalty=1.3,
    logprobs=True,
)
STATS = SchedulerStats(
    running=3,
    queued=1,
    kv_pages_total=512,
    kv_pages_in_use=40,
    cached_tokens_total=17,
    preemptions_total=2,
)
LIMITS = EngineLimits(
    max_seq_len=256, num_pages=512, page_size=1, max_running_req=256, vocab_size=49152
)

MESSAGES = [
    UserMsg(7, [1, 2, 3, 49151], PARAMS),
    UserMsg(8, [5], SamplingParams()),
    AbortMsg(7),
    TokenMsg(7, 42, False, None, 0),
    TokenMsg(7, 2, True, "stop", 3, logprob=-0.125),
    TokenMsg(9, -1, True, None, 0, error="the prompt is empty"),
    STATS,
    SchedulerOutput([TokenMsg(1, 5, False, None, 0), TokenMsg(2, 6, True, "length", 4)], STATS),
    SchedulerOutput([], STATS),
    TokenizeMsg(1, PARAMS, prompt="Héllo, 世界 🌍", stop=["\n\n", "🌍"], skip_special_tokens=False),
    TokenizeMsg(2, SamplingParams(), messages=[{"role": "user", "content": "Ça va? 😀"}]),
    TokenizeMsg(3, SamplingParams(max_tokens=1), input_ids=[1, 2, 3]),
    AcceptedMsg(1, 31),
    RejectedMsg(1, "the prompt has 300 tokens; this model's context is 256 tokens"),
    DeltaMsg(1, "caf\u00e9 ", 1234, " café", -0.5, False, None, 0),
    DeltaMsg(1, "", None, None, None, True, "stop", 12),
    ReadyMsg("scheduler", {"limits": LIMITS.to_dict(), "device": "cpu"}),
    ReadyMsg("tokenizer"),
    StopMsg(),  # rank 0 to the other ranks: no fields at all  # [ch21]
    # >>> ch25 logit_bias's integer keys, a schema, and the logprobs' nested messages
    UserMsg(10, [1, 2], SamplingParams(logit_bias={7: -100.0, 49151: 2.5}, json_schema="{}")),
    TokenMsg(
        10,
        8,
        False,
        None,
        0,
        logprob=-0.5,
        top_ids=[8, 3],
        top_logprobs=[-0.5, -1.25],
        prompt_logprobs=PromptLogprobs([1, 2], [-3.0], [[4, 2]], [[-0.5, -3.0]]),
    ),
    PromptLogprobs([5], [], [], []),
    DeltaMsg(
        10,
        "é",
        8,
        "é",
        -0.5,
        False,
        None,
        0,
        token_bytes=[195, 169],
        top_logprobs=[TokenLogprob("é", -0.5, [195, 169]), TokenLogprob("\ufffd", -1.5, [195])],
        prompt_text="Hi",
        prompt_logprobs=[TokenLogprob("Hi", None, [72, 105])],
    ),
    TokenLogprob("a", -0.25, [97], [TokenLogprob("b", -1.0, [98])]),
    TokenizeMsg(11, SamplingParams(), prompt="Hi", echo=True),
    # <<< ch25
    FlushCacheMsg(),  # the API server to the scheduler: no fields at all  # [ch27]
    # >>> ch30 the live page's lease, and a snapshot: plain containers, the grid as bytes
    WatchMsg(3.0, text=True),
    DashboardSnapshot(
        7,
        1.5,
        {"model": "m"},
        {"running": 1},
        {"kind": ["decode"], "ms": [None]},
        [{"id": 3, "state": "decoding"}],
        [],
        [],
        {"free": 2, "grid": b"frcl"},
        {"nodes": [{"id": 0, "parent": None}]},
        [["decode", 3, 4, 1, 1]],
    ),
    # <<< ch30
]


def message_types() -> set[type]:
    # What the codec decodes: the dataclasses the message modules define or import.
    return {
        cls
        for module in (backend, frontend)
        for cls in vars(module).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls)
    } - {SamplingParams}


# ---- the codec ----------------------------------------------------------------------------


def test_examples_cover_every_message_type():
    assert message_types() <= {type(m) for m in MESSAGES}


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    back = decode(encode(msg))
    assert type(back) is type(msg)
    assert back == msg
    for f in dataclasses.fields(msg):  # nested dataclasses come back as themselves
        assert type(getattr(back, f.name)) is type(getattr(msg, f.name))


def test_nested_sampling_params_and_tokens():
    back = decode(encode(MESSAGES[0]))
    assert isinstance(back.sampling_params, SamplingParams)
    assert back.sampling_params == PARAMS and back.sampling_params.seed == 2**62
    out = decode(encode(MESSAGES[7]))
    assert all(isinstance(t, TokenMsg) for t in out.tokens)
    assert isinstance(out.stats, SchedulerStats)


def plain(obj: Any) -> bool:
    if isinstance(obj, dict):
        # Field names are strings; a logit_bias maps token ids (ints) to floats.
        return all(isinstance(k, str | int) and plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(map(plain, obj))
    return obj is None or isinstance(obj, bool | int | float | str | bytes)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_wire_bytes_are_plain_msgpack(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    assert not data.startswith(b"\x80"), "a pickle protocol header"
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert plain(raw), raw
    assert raw["_t"] == type(msg).__name__


def test_ready_message_carries_the_engine_limits():
    # The tokenizer worker learns what a prompt must fit from the scheduler's ready message.
    info = decode(encode(ReadyMsg("scheduler", {"limits": LIMITS.to_dict()}))).info
    assert EngineLimits.from_dict(info["limits"]) == LIMITS
    assert msgpack.unpackb(encode(LIMITS.to_dict())) == dataclasses.asdict(LIMITS)


def test_unknown_types_are_refused():
    for name in ("Popen", "Req", "LLM", "Scheduler", "object", "os.system"):
        with pytest.raises(ValueError, match="unknown message type"):
            decode(msgpack.packb({"_t": name, "args": ["rm", "-rf", "/"]}))
    # Also when hidden inside a message we do know.
    inner = {"_t": "UserMsg", "uid": 1, "input_ids": [1], "sampling_params": {"_t": "Evil"}}
    with pytest.raises(ValueError, match="unknown message type"):
        decode(msgpack.packb(inner))


def test_pickle_is_not_decoded():
    import pickle

    with pytest.raises(Exception):  # noqa: B017 - any refusal will do, as long as it is one
        decode(pickle.dumps(AbortMsg(1)))


def test_objects_that_are_not_plain_data_are_not_encoded():
    with pytest.raises(TypeError):
        encode(AbortMsg(object()))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode({"a set": {1, 2}})


# ---- the pipes ----------------------------------------------------------------------------


def test_address_is_an_ipc_path(tmp_path):
    assert address(tmp_path, "scheduler") == f"ipc://{tmp_path / 'scheduler'}"


def test_reader_and_writers_over_ipc(tmp_path):
    ctx = zmq.Context()
    reader = Reader(ctx, address(tmp_path, "pipe"))
    writers = [Writer(ctx, address(tmp_path, "pipe")) for _ in range(2)]
    try:
        assert (tmp_path / "pipe").exists(), "the binding end creates the socket file"
        assert reader.recv(timeout_ms=50) is None
        assert reader.recv_all() == []
        for i, msg in enumerate(MESSAGES):
            writers[i % 2].send(msg)
        got = [reader.recv(timeout_ms=10_000)]  # blocks until the first one arrives
        deadline = time.monotonic() + 10
        while len(got) < len(MESSAGES) and time.monotonic() < deadline:
            got += reader.recv_all()  # never blocks: whatever is there now
        assert len(got) == len(MESSAGES)
        # One writer's messages keep their order; the two writers' may interleave.
        assert [m for m in got if m in MESSAGES[0::2]] == MESSAGES[0::2]
        assert [m for m in got if m in MESSAGES[1::2]] == MESSAGES[1::2]
        assert reader.recv(timeout_ms=50) is None
    finally:
        for s in (reader, *writers):
            s.socket.close(linger=0)
        ctx.term()


def test_async_reader_and_writer_over_ipc(tmp_path):
    async def talk() -> list[Any]:
        ctx = zmq.asyncio.Context()
        reader = AsyncReader(ctx, address(tmp_path, "api"))
        writer = AsyncWriter(ctx, address(tmp_path, "api"))
        try:
            await writer.send(MESSAGES[0])
            writer.send_nowait(AbortMsg(7))
            return [await asyncio.wait_for(reader.recv(), 10) for _ in range(2)]
        finally:
            reader.socket.close(linger=0)
            writer.socket.close(linger=0)
            ctx.term()

    assert asyncio.run(talk()) == [MESSAGES[0], AbortMsg(7)]


# ---- the scheduler's loop -----------------------------------------------------------------

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(need(SMOL))


@pytest.fixture(scope="module")
def scheduler(tok: Tokenizer) -> Iterator[Scheduler]:
    config = SchedulerConfig(
        str(SMOL),
        dtype=torch.float32,
        device="cpu",
        max_seq_len_override=MAX_SEQ_LEN,
        num_page_override=256,
        max_running_req=4,
    )
    s = Scheduler(config, tok.eos_token_ids)
    yield s
    s.shutdown()


@dataclasses.dataclass
class Loop:
    to_scheduler: Writer
    from_scheduler: Reader

    def send(self, msg: Any) -> None:
        self.to_scheduler.send(msg)

    def next(self, timeout_s: float = 120.0) -> SchedulerOutput:
        out = self.from_scheduler.recv(timeout_ms=int(timeout_s * 1000))
        assert out is not None, f"no output from the scheduler for {timeout_s} s"
        assert isinstance(out, SchedulerOutput) and isinstance(out.stats, SchedulerStats)
        return out

    def outputs(self, until: Any) -> list[SchedulerOutput]:
        """SchedulerOutputs as they come, until `until(tokens so far)` holds."""
        outs: list[SchedulerOutput] = []
        tokens: list[TokenMsg] = []
        while not until(tokens):
            outs.append(self.next())
            tokens += outs[-1].tokens
        return outs


def finished(*uids: int):
    return lambda tokens: {t.uid for t in tokens if t.finished} >= set(uids)


@pytest.fixture
def loop(scheduler: Scheduler, tmp_path: Path, monkeypatch) -> Iterator[Loop]:
    """`io.serve` in a thread; it stops when it sees its 'parent' change, as in a worker."""
    stopping = threading.Event()
    monkeypatch.setattr(io, "os", types.SimpleNamespace(getppid=lambda: int(stopping.is_set())))
    ctx = zmq.Context()
    inbox = Reader(ctx, address(tmp_path, "scheduler"))
    outbox = Writer(ctx, address(tmp_path, "detokenizer"))
    from_scheduler = Reader(ctx, address(tmp_path, "detokenizer"))
    to_scheduler = Writer(ctx, address(tmp_path, "scheduler"))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            io.serve(scheduler, inbox, outbox)
        except BaseException as e:  # reported by the test, not lost in the thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield Loop(to_scheduler, from_scheduler)
    finally:
        stopping.set()
        thread.join(30)
        for s in (inbox, outbox, from_scheduler, to_scheduler):
            s.socket.close(linger=0)
        ctx.term()
    assert not thread.is_alive(), "serve did not return after its parent went away"
    assert not errors, errors
    assert not scheduler.has_work


def test_serve_generates_the_hf_greedy_tokens(loop, tok):
    prompts = {1: tok.encode("The capital of France is"), 2: tok.encode("def fibonacci(n):")}
    for uid, ids in prompts.items():
        loop.send(UserMsg(uid, ids, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)))
    outs = loop.outputs(finished(*prompts))
    tokens = [t for out in outs for t in out.tokens]
    for uid, ids in prompts.items():
        mine = [t for t in tokens if t.uid == uid]
        assert [t.token for t in mine] == hf_greedy(SMOL, ids, 6)
        assert [t.finished for t in mine] == [False] * 5 + [True]
        assert mine[-1].finish_reason == "length"
        assert all(t.error is None and t.logprob is not None and t.logprob <= 0 for t in mine)
    stats = outs[-1].stats
    assert stats.running == 0 and stats.queued == 0 and stats.kv_pages_in_use == 0, stats
    assert stats.kv_pages_total == 256


@pytest.mark.parametrize(
    "ids,words",
    [([], "empty"), ([1, 10**9], "vocabulary"), (list(range(100, 100 + MAX_SEQ_LEN)), "64")],
    ids=["empty", "outside-vocab", "too-long"],
)
def test_serve_refuses_an_invalid_request_and_keeps_going(loop, tok, ids, words):
    loop.send(UserMsg(5, ids, SamplingParams(max_tokens=2)))
    (refusal,) = [t for out in loop.outputs(finished(5)) for t in out.tokens]
    assert refusal.uid == 5 and refusal.finished and refusal.error
    assert words in refusal.error, refusal.error
    # The loop is still alive and still right.
    ids = tok.encode("Hello")
    loop.send(UserMsg(6, ids, SamplingParams(max_tokens=2, ignore_eos=True)))
    tokens = [t for out in loop.outputs(finished(6)) for t in out.tokens]
    assert [t.token for t in tokens] == hf_greedy(SMOL, ids, 2)


def test_serve_aborts_and_frees_the_pages(loop, tok):
    ids = tok.encode("Once upon a time")
    loop.send(UserMsg(9, ids, SamplingParams(max_tokens=40, ignore_eos=True)))
    loop.outputs(lambda tokens: len(tokens) >= 2)
    loop.send(AbortMsg(9))
    # The abort is answered by an output whose stats show the request gone.
    late: list[TokenMsg] = []
    for _ in range(10):
        out = loop.next()
        late += out.tokens
        if out.stats.running == 0:
            break
    assert out.stats.running == 0 and out.stats.kv_pages_in_use == 0, out.stats
    assert len(late) <= 2, f"tokens after the abort: {late}"
    assert all(t.uid == 9 and not t.finished for t in late)
