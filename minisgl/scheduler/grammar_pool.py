"""Grammars compiled off the step loop: in worker processes, within a time limit, kept.

Compiling a JSON schema into xgrammar's automaton takes from a millisecond to minutes:
bounded repetitions in a `pattern` multiply out, and so do thousands of `anyOf` branches.
Done in the scheduler's loop, one such compile would stop every other request for as long.
So a request with a schema does not join the prefill queue when it arrives: it waits here
while a worker process compiles its grammar, and the scheduler goes on stepping the others.
Once the grammar is in, the request joins the queue; if its compile runs past
`--grammar-compile-timeout` seconds, the worker is killed and the request is refused with
a 400 that names the limit. Grammars are kept by schema, failures too, so a schema sent
again costs nothing, however it went the first time.

Processes rather than threads, because xgrammar cannot be interrupted: a thread could stop
waiting for a compile past its limit, but not stop the compile, which would go on taking a
core. A worker runs at the lowest CPU priority there is (SCHED_IDLE: only on a core that
nothing else wants), so that even a compile within its limit takes nothing from the forward
passes where cores are few; under full load, grammars wait, plain requests do not. The
compiled grammar comes back serialized (xgrammar's JSON) and is read back in a thread of
the scheduler's process; xgrammar lets go of the GIL for that, as it does for compiling.

With tensor parallelism every rank compiles for itself, but only rank 0 decides when a
request's grammar is in or has failed, and tells the others in the same step: ranks pick
the same batches only if they admit the same requests at the same step. A rank told
before its own compile is done waits for it.

The worker program is grammar_worker.py.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from minisgl.distributed import broadcast_bytes, get_tp_info
from minisgl.scheduler import grammar_worker
from minisgl.scheduler.grammar import Grammars
from minisgl.scheduler.grammar_worker import read_frame, write_frame

if TYPE_CHECKING:
    import xgrammar

    from minisgl.core import SamplingParams
    from minisgl.scheduler.prefill import PendingReq

logger = logging.getLogger(__name__)
WORKERS = 2  # compiles at once; each worker holds xgrammar, torch and the vocabulary
KEPT = 256  # grammars kept, whatever their size,
KEPT_BYTES = 1 << 30  # and at most this much of them
IDLE_WAIT_S = 0.01  # how long a step with nothing else to do waits for a compile


class _Job:
    """One schema's compile: queued, running in a worker, or finished (grammar or error)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.started: float | None = None  # when a worker began it (its loading not counted)
        self.grammar: xgrammar.CompiledGrammar | None = None
        self.error: str | None = None
        self.size = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def finish(
        self, grammar: xgrammar.CompiledGrammar | None = None, error: str | None = None
    ) -> bool:
        """Settle the job, unless it was settled first (a cancel and an answer may race)."""
        with self._lock:
            if self.done.is_set():
                return False
            self.grammar, self.error = grammar, error
            self.size = grammar.memory_size_bytes if grammar is not None else 0
            self.done.set()
            return True


class GrammarPool:
    """The compiles, by schema, and the requests that wait for theirs, by uid."""

    def __init__(self, grammars: Grammars, timeout: float) -> None:
        self.grammars, self.timeout = grammars, timeout
        self.waiting: dict[int, tuple[PendingReq, _Job]] = {}
        self.jobs: OrderedDict[str, _Job] = OrderedDict()  # the least recently used first
        self.queue: queue.Queue[_Job | None] = queue.Queue()
        self.workers: list[_Worker] = []
        self.settled = threading.Condition()  # notified when any job finishes
        self.info: xgrammar.TokenizerInfo | None = None  # from the first worker to start

    def hold(self, pending: PendingReq) -> bool:
        """Keep the request until its grammar is compiled; False if it has no grammar."""
        schema = pending.sampling_params.json_schema
        if schema is None:
            return False
        self.waiting[pending.uid] = (pending, self._job(schema))
        return True

    def drop(self, uid: int) -> None:
        """The request was aborted; its grammar still compiles, for whoever sends it next."""
        self.waiting.pop(uid, None)

    def compile_now(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if it has one, and wait for it here (the offline
        API, which checks every request before it runs any); ValueError if it fails."""
        if params.json_schema is None:
            return
        job = self._job(params.json_schema)
        while not job.done.wait(IDLE_WAIT_S):
            if self._late(job):
                self._cancel(job, self._too_slow())
        if job.error is not None:
            raise ValueError(job.error)

    def admit(
        self, idle: bool
    ) -> list[tuple[PendingReq, xgrammar.CompiledGrammar | None, str | None]]:
        """The waiting requests whose grammar is settled: (request, grammar, None) or
        (request, None, why it failed). The same on every rank, at the same step: rank 0
        decides and tells the others. `idle`: nothing else to step, so wait a little."""
        if not self.waiting:
            return []
        tp = get_tp_info()
        decided = self._decide(idle) if tp.is_primary else []
        if tp.size > 1:
            shared = broadcast_bytes(msgpack.packb(decided) if tp.is_primary else None)
            decided = msgpack.unpackb(shared)
        settled = []
        for uid, error in decided:
            pending, job = self.waiting.pop(uid)
            if error is not None:
                self._cancel(job, error)  # on ranks 1..: stop their own compile of it
                settled.append((pending, None, error))
                continue
            job.done.wait()  # a rank behind rank 0 catches up
            if job.grammar is None:
                raise RuntimeError(
                    f"rank 0 compiled a grammar that rank {tp.rank} could not: {job.error}"
                )
            settled.append((pending, job.grammar, None))
        return settled

    def _decide(self, idle: bool) -> list[tuple[int, str | None]]:
        jobs = [job for _, job in self.waiting.values()]
        if idle and not any(job.done.is_set() for job in jobs):
            with self.settled:
                self.settled.wait(IDLE_WAIT_S)
        for job in jobs:
            if self._late(job):
                self._cancel(job, self._too_slow())
        return [(uid, job.error) for uid, (_, job) in self.waiting.items() if job.done.is_set()]

    def _late(self, job: _Job) -> bool:
        started = job.started
        return (
            not job.done.is_set()
            and started is not None
            and time.monotonic() - started > self.timeout
        )

    def _too_slow(self) -> str:
        return (
            f"the JSON schema did not compile within {self.timeout:g} s"
            " (--grammar-compile-timeout): simplify it, or raise the limit"
        )

    def _cancel(self, job: _Job, error: str) -> None:
        if job.finish(error=error):
            for worker in self.workers:
                worker.kill_if_running(job)

    def _job(self, schema: str) -> _Job:
        job = self.jobs.get(schema)
        if job is not None:
            self.jobs.move_to_end(schema)
            return job
        job = self.jobs[schema] = _Job(schema)
        self._forget_old()
        if not self.workers:
            self.workers = [_Worker(self) for _ in range(WORKERS)]
        self.queue.put(job)
        return job

    def _forget_old(self) -> None:
        """Drop the least recently used settled grammars beyond the count and the bytes."""
        total = sum(job.size for job in self.jobs.values())
        for schema, job in list(self.jobs.items()):
            if len(self.jobs) <= KEPT and total <= KEPT_BYTES:
                return
            if job.done.is_set():  # a request that waits for it holds the job itself
                del self.jobs[schema]
                total -= job.size

    def shutdown(self) -> None:
        for worker in self.workers:
            self.queue.put(None)
            worker.kill_if_running(None)


class _Worker:
    """One compiler process, and the thread that gives it jobs and reads back its grammars."""

    def __init__(self, pool: GrammarPool) -> None:
        self.pool = pool
        self.proc: subprocess.Popen | None = None
        self.running: _Job | None = None
        self.lock = threading.Lock()  # `running` and the process, against a cancel
        threading.Thread(target=self._serve, name="grammar-worker", daemon=True).start()

    def kill_if_running(self, job: _Job | None) -> None:
        """Kill the process if it compiles `job` (None: whatever it does)."""
        with self.lock:
            if self.proc is not None and (job is None or self.running is job):
                self.proc.kill()

    def _serve(self) -> None:
        while (job := self.pool.queue.get()) is not None:
            if job.done.is_set():  # cancelled while it queued
                continue
            job.finish(**self._run(job))
            with self.pool.settled:
                self.pool.settled.notify_all()

    def _run(self, job: _Job) -> dict[str, Any]:
        """The job's grammar or why there is none, as `_Job.finish` takes them."""
        try:
            reply = self._compile(job)
        except (OSError, EOFError) as e:  # the process died, or was killed
            logger.warning("a grammar worker ended: %s", e)
            return {"error": f"the grammar compiler exited ({self._end()}) compiling the schema"}
        finally:
            with self.lock:
                self.running = None
        try:
            return self._read_back(reply)
        except Exception as e:  # a grammar that does not read back fails its request only
            logger.exception("a compiled grammar could not be read back")
            return {"error": f"the compiled grammar could not be read back: {e}"}

    def _read_back(self, reply: bytes) -> dict[str, Any]:
        if reply[:1] == b"E":
            return {"error": reply[1:].decode()}
        import xgrammar

        assert self.pool.info is not None
        return {
            "grammar": xgrammar.CompiledGrammar.deserialize_json(reply[1:].decode(), self.pool.info)
        }

    def _end(self) -> str:
        """Make sure the process is gone; its exit code, in words."""
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return "it never started"
        proc.kill()
        return f"code {proc.wait()}"

    def _compile(self, job: _Job) -> bytes:
        proc = self.proc or self._start()
        assert proc.stdin is not None and proc.stdout is not None
        with self.lock:
            self.running, job.started = job, time.monotonic()
        write_frame(proc.stdin, job.schema.encode())
        return read_frame(proc.stdout)

    def _start(self) -> subprocess.Popen:
        g = self.pool.grammars
        eos = ",".join(map(str, g.eos_token_ids))
        cmd = [
            sys.executable,
            "-m",
            grammar_worker.__name__,
            str(g.model_path),
            str(g.vocab_size),
            eos,
        ]
        root = str(Path(__file__).resolve().parents[2])  # where `minisgl` is, for the child
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        with self.lock:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
        assert self.proc.stdout is not None
        info = read_frame(self.proc.stdout)  # ready: loaded, with our vocabulary as it sees it
        if self.pool.info is None:
            import xgrammar

            self.pool.info = xgrammar.TokenizerInfo.deserialize_json(info.decode())
        return self.proc
