"""Chapter 14: processes and messages. Messages are dataclasses that travel as msgpack over
one-way ZMQ pipes; the scheduler runs in a process of its own and speaks only through them.

We play the other processes by hand: encode a message, start the scheduler worker, wait for
its ready message, send it a request and read its tokens back.

Run from the repo root: python examples/ch14_processes.py
"""

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time

import msgpack
import torch
import zmq

from minisgl.core import SamplingParams
from minisgl.message.backend import SchedulerOutput, UserMsg
from minisgl.message.codec import decode, encode
from minisgl.message.frontend import ReadyMsg
from minisgl.message.transport import Reader, Writer, address
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.io import run_scheduler_worker
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL = "models/SmolLM2-135M-Instruct"


def codec_demo(msg: UserMsg, failures: list[str]) -> None:
    """A dataclass becomes a msgpack map tagged with its type's name."""
    data = encode(msg)
    print(f"UserMsg with {len(msg.input_ids)} token ids -> {len(data)} bytes of msgpack")
    print(f"  first bytes: {data[:24]!r}")
    print(f"  the same message pickled would be {len(pickle.dumps(msg))} bytes (we never use it)")
    back = decode(data)
    print(f"  decoded: {back}")
    if back != msg:
        failures.append("decode(encode(msg)) != msg")
    plain = msgpack.unpackb(data)  # any msgpack reader sees plain maps, lists and numbers
    print(f"  as plain msgpack: keys {list(plain)}, _t={plain['_t']!r}")
    if plain["_t"] != "UserMsg" or plain["sampling_params"]["_t"] != "SamplingParams":
        failures.append("the wire data is not a plain tagged map")
    try:
        decode(encode({"_t": "Popen", "args": ["sh"]}))
        failures.append("an unknown type was decoded")
    except ValueError as e:
        print(f"  an unknown type is refused: ValueError: {e}")


def scheduler_demo(tok: Tokenizer, msg: UserMsg, failures: list[str]) -> None:
    """The scheduler in its own process; the pipes are ipc:// files in a private folder."""
    config = SchedulerConfig(
        model_path=MODEL,
        dtype=torch.float32,
        device="cpu",
        max_seq_len_override=256,
        num_page_override=512,
    )
    ipc_dir = tempfile.mkdtemp(prefix="minisgl-ch14-")  # mode 0700
    ctx = zmq.Context()
    ready = Reader(ctx, address(ipc_dir, "ready"))  # we read these two pipes, so we bind them
    from_scheduler = Reader(ctx, address(ipc_dir, "detokenizer"))
    proc = mp.get_context("spawn").Process(
        target=run_scheduler_worker, args=(config, ipc_dir, "WARNING"), daemon=True
    )
    t0 = time.perf_counter()
    proc.start()
    try:
        hello = None
        while hello is None and proc.is_alive():
            hello = ready.recv(timeout_ms=200)
        if not isinstance(hello, ReadyMsg):
            raise SystemExit(f"the scheduler exited with code {proc.exitcode} before it was ready")
        print(f"\nscheduler pid {proc.pid} ready after {time.perf_counter() - t0:.1f}s")
        print(f"  ReadyMsg info: {hello.info}")
        mode = oct(os.stat(ipc_dir).st_mode & 0o777)
        print(f"  {ipc_dir} (mode {mode}) holds {sorted(os.listdir(ipc_dir))}")

        to_scheduler = Writer(ctx, address(ipc_dir, "scheduler"))
        to_scheduler.send(msg)
        tokens = []
        finish_reason = None
        while finish_reason is None:
            out = from_scheduler.recv(timeout_ms=60_000)
            if not isinstance(out, SchedulerOutput):
                raise SystemExit("no reply from the scheduler within 60 s")
            for t in out.tokens:
                print(f"  TokenMsg uid={t.uid} token={t.token} finished={t.finished}")
                tokens.append(t.token)
                if t.finished:
                    finish_reason = t.finish_reason
        s = out.stats
        print(f"  stats: running={s.running} queued={s.queued} pages in use={s.kv_pages_in_use}")
        text = tok.decode(tokens)
        print(f"{tok.decode(msg.input_ids)!r} -> {text!r} ({len(tokens)} tokens, {finish_reason})")
        if len(tokens) != 8 or finish_reason != "length" or "Paris" not in text:
            failures.append(f"expected 8 tokens mentioning Paris, got {text!r} ({finish_reason})")
    finally:
        proc.terminate()
        proc.join(10)
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
    print(f"scheduler exit code {proc.exitcode} (terminated); {ipc_dir} removed")


def main() -> None:
    failures: list[str] = []
    tok = Tokenizer(MODEL)
    ids = tok.encode("The capital of France is")
    msg = UserMsg(uid=7, input_ids=ids, sampling_params=SamplingParams(max_tokens=8))
    codec_demo(msg, failures)
    scheduler_demo(tok, msg, failures)
    if failures:
        raise SystemExit("; ".join(failures))


# A spawned process imports this file again to find its target: only the parent runs main().
if __name__ == "__main__":
    main()
