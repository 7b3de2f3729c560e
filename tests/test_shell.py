"""`python -m minisgl --shell`: a chat in the terminal, driven through pipes.

Three shells start at once (loading the model is most of the cost): one answers a question
and quits on end of input, as after Ctrl-D; one holds a conversation, has a reply stopped
by Ctrl-C, clears the conversation with /reset and quits with /exit; one is quit by Ctrl-C
at its prompt. Each must exit with 0 (130 after Ctrl-C) and leave no process or socket
folder. The model is greedy, so its answers are fixed: SmolLM2 knows that the capital of
France is Paris, answers "And of Italy?" with Rome only when it sees the question before
it, and without that context ("Say it again.") speaks of neither.

How much of a stopped reply a live shell shows depends on timing, so what the conversation
keeps after a Ctrl-C is checked in-process, against a stand-in for the frontend whose
replies, and whose Ctrl-C, come exactly when the test says.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import SMOL, need

from minisgl.message.frontend import DeltaMsg, RejectedMsg, TokenizeMsg
from minisgl.server.frontend import Frontend
from minisgl.server.metrics import Metrics
from minisgl.shell import run_shell

START_TIMEOUT = 180.0  # loading the model on a busy two-core machine
REPLY_TIMEOUT = 180.0
PROMPT = "\n> "  # what the shell prints before each input (after its help line or a reply)


class Shell:
    def __init__(self, log: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "minisgl",
            "--model",
            str(SMOL),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--shell",
            "--max-seq-len-override",
            "256",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = log
        with log.open("wb") as err:
            # As from a terminal: Ctrl-C at its default, whatever this test process inherited
            # (Python raises KeyboardInterrupt only when SIGINT is not ignored at start-up).
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )  # fmt: skip
        self._out = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 4096):
            with self._lock:
                self._out += chunk

    @property
    def output(self) -> str:
        with self._lock:
            return self._out.decode(errors="replace")

    def wait_prompts(self, n: int, timeout: float) -> None:
        """Wait until the shell has asked for input `n` times."""
        deadline = time.monotonic() + timeout
        while self.output.count(PROMPT) < n:
            if "Traceback (most recent call last)" in self.log.read_text(errors="replace"):
                pytest.fail(f"BUG: the shell raised an exception:\n{self.report()}")
            if self.proc.poll() is not None:
                pytest.fail(f"the shell exited with {self.proc.returncode}:\n{self.report()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no prompt #{n} after {timeout:.0f} s:\n{self.report()}")
            time.sleep(0.1)

    def say(self, line: str) -> str:
        """Send a line; return what the shell printed in answer (before its next prompt)."""
        n = self.output.count(PROMPT)
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        self.wait_prompts(n + 1, REPLY_TIMEOUT)
        return self.output.split(PROMPT)[n]

    def interrupt(self, line: str) -> str:
        """Send a line, press Ctrl-C once its reply streams; return what the shell printed."""
        n = self.output.count(PROMPT)
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + REPLY_TIMEOUT
        while len(self.output.split(PROMPT)[n].strip()) < 10:  # a few words of it
            if time.monotonic() > deadline or self.proc.poll() is not None:
                pytest.fail(f"no reply to {line!r}:\n{self.report()}")
            time.sleep(0.02)
        os.kill(self.proc.pid, signal.SIGINT)
        self.wait_prompts(n + 1, REPLY_TIMEOUT)
        return self.output.split(PROMPT)[n]

    def report(self) -> str:
        err = self.log.read_text(errors="replace")[-2000:]
        return f"stdout:\n{self.output[-2000:]}\nstderr:\n{err}"

    def stop(self) -> None:
        """The finalizer: SIGTERM (the launcher cleans up), SIGKILL if that is not enough."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            kids = [int(c) for c in children.read_text().split()]
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone too


def ipc_dirs(pid: int) -> set[Path]:
    """The minisgl-* folders of the unix sockets that this process has bound."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    dirs = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and "/minisgl-" in fields[7]:
            dirs.add(Path(fields[7]).parent)
    return dirs


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # user + system


def scheduler_pid(tree: list[int]) -> int:
    """The worker that names itself minisgl::scheduler (server/processes.py)."""
    titles = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in tree}
    (pid,) = [pid for pid, title in titles.items() if title.startswith(b"minisgl::scheduler")]
    return pid


def check_clean_exit(shell: Shell, tree: list[int], folders: set[Path], code: int = 0) -> None:
    try:
        exit_code = shell.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the shell did not exit:\n{shell.report()}")
    assert exit_code == code, shell.report()
    deadline = time.monotonic() + 10
    while (left := [p for p in tree if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
    assert folders and not any(f.exists() for f in folders), folders


def test_shell_conversation_ctrl_c_reset_exit_and_eof(tmp_path):
    need(SMOL)
    chat, eof, ctrl_c = (Shell(tmp_path / f"{name}.log") for name in ("chat", "eof", "ctrl_c"))
    try:
        trees, folders = {}, {}
        for shell in (chat, eof, ctrl_c):
            shell.wait_prompts(1, START_TIMEOUT)
            assert "/reset" in shell.output and "/exit" in shell.output, "the help line"
            trees[shell] = [shell.proc.pid, *descendants(shell.proc.pid)]
            folders[shell] = ipc_dirs(shell.proc.pid)
            assert len(trees[shell]) >= 3 and len(folders[shell]) == 1, (trees, folders)

        # Ctrl-C at the prompt quits, as it did before there were replies to stop.
        os.kill(ctrl_c.proc.pid, signal.SIGINT)
        check_clean_exit(ctrl_c, trees[ctrl_c], folders[ctrl_c], code=130)

        # One question, then the end of the input: Ctrl-D.
        assert "Paris" in eof.say("What is the capital of France?"), eof.report()
        eof.proc.stdin.close()
        check_clean_exit(eof, trees[eof], folders[eof])

        first = chat.say("What is the capital of France?")
        assert "Paris" in first, first
        follow_up = chat.say("And of Italy?")  # only makes sense with the question before
        assert "Rome" in follow_up, follow_up

        # Ctrl-C during a reply: the reply stops, its request is aborted (the scheduler falls
        # idle, where the story had over a hundred tokens to go), the conversation goes on.
        scheduler = scheduler_pid(trees[chat])
        stopped = chat.interrupt("Tell me a long story about a dragon.")
        assert stopped.rstrip().endswith("(stopped)"), stopped
        busy = cpu_seconds(scheduler)
        time.sleep(2.0)
        assert cpu_seconds(scheduler) - busy < 0.5, "the stopped reply is still computed"

        assert "(conversation cleared)" in chat.say("/reset")
        fresh = chat.say("Say it again.")  # nothing to say again after /reset
        assert "Rome" not in fresh and "Paris" not in fresh, fresh
        chat.proc.stdin.write(b"/exit\n")
        chat.proc.stdin.flush()
        check_clean_exit(chat, trees[chat], folders[chat])
    finally:
        for shell in (chat, eof, ctrl_c):
            shell.stop()


# ---- what the conversation keeps after a Ctrl-C, in-process -------------------------------


class ScriptedReply(asyncio.Queue):
    """A reply's deltas; once they run out, a Ctrl-C, as a user would press it, then nothing."""

    async def get(self) -> Any:
        if self.empty():
            os.kill(os.getpid(), signal.SIGINT)
        return await super().get()


class ScriptedFrontend(Frontend):
    """A Frontend without workers; reply i is `replies[i]`, a list of text pieces that ends
    with None when the reply finishes (without it, the user presses Ctrl-C), or with a
    worker's message (a RejectedMsg) that ends it."""

    def __init__(self, replies: list[list[str | RejectedMsg | None]]) -> None:
        self.replies = replies
        self.metrics = Metrics()
        self.uids = itertools.count()
        self.sent: list[list[dict[str, str]]] = []  # each request's messages
        self.aborted: list[int] = []

    async def receive_forever(self) -> None:
        await asyncio.Event().wait()

    async def open(self, msgs: list[TokenizeMsg]) -> tuple[asyncio.Queue, int]:
        (msg,) = msgs
        self.sent.append(msg.messages)
        queue = ScriptedReply()
        pieces = self.replies[len(self.sent) - 1]
        for i, text in enumerate(pieces):
            if isinstance(text, RejectedMsg):
                queue.put_nowait(RejectedMsg(msg.uid, text.message, text.code, text.status))
            elif text is not None:
                last = i + 2 == len(pieces) and pieces[-1] is None
                queue.put_nowait(DeltaMsg(msg.uid, text, 1, None, None, last, None, 0))
        return queue, 0

    async def close(self, uids: list[int], abort: bool) -> None:
        if abort:
            self.aborted += uids


class LiveTree:
    def dead(self) -> None:
        return None


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(monkeypatch, capsys):
    lines = ["Hi", "Tell me a story", "Go on", "Never mind", "And now?", "/exit"]
    frontend = ScriptedFrontend(
        [
            ["Hello", "!", None],
            ["Once", " upon"],  # Ctrl-C here: what was shown stays
            ["a", " time", None],
            [],  # Ctrl-C before any text: the line is taken back
            ["Yes", None],
        ]
    )
    read, write = os.pipe()
    os.write(write, "".join(f"{line}\n" for line in lines).encode())
    os.close(write)
    monkeypatch.setattr(sys, "stdin", os.fdopen(read))
    try:
        assert asyncio.run(run_shell(frontend, LiveTree())) == 0
    except KeyboardInterrupt:  # caught here, or it would end the whole test session
        pytest.fail("Ctrl-C during a reply ended the shell")

    assert frontend.aborted == [1, 3], "the stopped replies' requests are aborted"
    assert capsys.readouterr().out.count("(stopped)") == 2
    user = [{"role": "user", "content": line} for line in lines]
    said = [{"role": "assistant", "content": text} for text in ("Hello!", "Once upon", "a time")]
    assert frontend.sent == [
        user[:1],
        [user[0], said[0], user[1]],
        [user[0], said[0], user[1], said[1], user[2]],
        [user[0], said[0], user[1], said[1], user[2], said[2], user[3]],
        [user[0], said[0], user[1], said[1], user[2], said[2], user[4]],
    ]


def test_a_workers_error_is_shown_and_the_chat_goes_on(monkeypatch, capsys):
    # The tokenizer worker ends a request that hit a bug with a RejectedMsg of status 500.
    bug = RejectedMsg(0, "internal error while detokenizing the request (KeyError: 7)", status=500)
    frontend = ScriptedFrontend([["Hel", bug], ["Hi", None]])
    read, write = os.pipe()
    os.write(write, b"Hello\nAgain\n/exit\n")
    os.close(write)
    monkeypatch.setattr(sys, "stdin", os.fdopen(read))
    assert asyncio.run(run_shell(frontend, LiveTree())) == 0

    out = capsys.readouterr().out
    assert "Hel\nerror: internal error while detokenizing the request (KeyError: 7)\n" in out
    assert "Hi\n" in out
    assert frontend.aborted == [0], "the failed request is aborted"
    # A failed reply is not kept, nor is the line that asked for it.
    user = [{"role": "user", "content": line} for line in ("Hello", "Again")]
    assert frontend.sent == [user[:1], user[1:]]
