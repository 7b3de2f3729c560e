"""The grammar worker: a process that compiles JSON schemas for the scheduler (grammar_pool.py).

`python -m minisgl.scheduler.grammar_worker MODEL VOCAB_SIZE EOS_IDS` reads schemas from
stdin and writes, for each, its compiled grammar (xgrammar's JSON) or why there is none to
stdout, in frames of a length and the bytes. Its first frame is our vocabulary as xgrammar
sees it, which the scheduler needs to read grammars back, and which says it is ready.

It lowers its CPU priority before it imports anything: torch and xgrammar take seconds of a
core to load, and a worker starts again whenever one is killed for a compile too long.
This module imports nothing heavy at its top for that reason.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import struct
import sys
from typing import IO

MAX_GRAMMAR_BYTES = 64 << 20  # a compiled grammar larger than this is refused


def write_frame(out: IO[bytes], data: bytes) -> None:
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def read_frame(inp: IO[bytes]) -> bytes:
    head = inp.read(4)
    if len(head) < 4:
        raise EOFError("the other end closed the pipe")
    (n,) = struct.unpack(">I", head)
    data = inp.read(n)
    if len(data) < n:
        raise EOFError("the other end closed the pipe mid-frame")
    return data


def lower_priority() -> None:
    """Run only on cycles no one else wants (this thread, and the threads it starts later)."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


def worker_main(model_path: str, vocab_size: int, eos_token_ids: list[int]) -> None:
    """A schema in, its grammar (or why not) out, until stdin closes."""
    from minisgl.scheduler.grammar import Grammars

    if sys.platform == "linux":  # killed with the scheduler, whose child it is
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints goes to the log, not into the pipe
    grammars = Grammars(model_path, vocab_size, frozenset(eos_token_ids))
    info = grammars._load().compile_builtin_json_grammar().tokenizer_info
    write_frame(out, info.serialize_json().encode())
    while True:
        try:
            schema = read_frame(sys.stdin.buffer).decode()
        except EOFError:
            return
        try:
            grammar = grammars.compile(schema)
        except ValueError as e:
            write_frame(out, b"E" + str(e).encode())
            continue
        if grammar.memory_size_bytes > MAX_GRAMMAR_BYTES:
            mb, limit = grammar.memory_size_bytes >> 20, MAX_GRAMMAR_BYTES >> 20
            too_big = f"the JSON schema's grammar takes {mb} MiB; the limit is {limit} MiB"
            write_frame(out, b"E" + too_big.encode())
            continue
        write_frame(out, b"G" + grammar.serialize_json().encode())


if __name__ == "__main__":
    lower_priority()
    path, vocab, eos = sys.argv[1:4]
    logging.basicConfig(
        level="WARNING", format="%(asctime)s grammar worker %(levelname)s %(message)s"
    )
    worker_main(path, int(vocab), [int(t) for t in eos.split(",") if t])
