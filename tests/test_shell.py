"""`python -m minisgl --shell`: a chat in the terminal, driven through pipes.

Two shells start at once (loading the model is most of the cost): one answers a question
and quits on end of input, as after Ctrl-D; the other holds a conversation, clears it with
/reset and quits with /exit. Both must exit with 0 and leave no process or socket folder.
The model is greedy, so its answers are fixed: SmolLM2 knows that the capital of France is
Paris, answers "And of Italy?" with Rome only when it sees the question before it, and
without that context ("Say it again.") speaks of neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import SMOL, need

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
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
            )
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


def check_clean_exit(shell: Shell, tree: list[int], folders: set[Path]) -> None:
    try:
        code = shell.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the shell did not exit:\n{shell.report()}")
    assert code == 0, shell.report()
    deadline = time.monotonic() + 10
    while (left := [p for p in tree if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
    assert folders and not any(f.exists() for f in folders), folders


def test_shell_conversation_reset_exit_and_eof(tmp_path):
    need(SMOL)
    chat, eof = Shell(tmp_path / "chat.log"), Shell(tmp_path / "eof.log")
    try:
        trees, folders = {}, {}
        for shell in (chat, eof):
            shell.wait_prompts(1, START_TIMEOUT)
            assert "/reset" in shell.output and "/exit" in shell.output, "the help line"
            trees[shell] = [shell.proc.pid, *descendants(shell.proc.pid)]
            folders[shell] = ipc_dirs(shell.proc.pid)
            assert len(trees[shell]) >= 3 and len(folders[shell]) == 1, (trees, folders)

        # One question, then the end of the input: Ctrl-D.
        assert "Paris" in eof.say("What is the capital of France?"), eof.report()
        eof.proc.stdin.close()
        check_clean_exit(eof, trees[eof], folders[eof])

        first = chat.say("What is the capital of France?")
        assert "Paris" in first, first
        follow_up = chat.say("And of Italy?")  # only makes sense with the question before
        assert "Rome" in follow_up, follow_up
        assert "(conversation cleared)" in chat.say("/reset")
        fresh = chat.say("Say it again.")  # nothing to say again after /reset
        assert "Rome" not in fresh and "Paris" not in fresh, fresh
        chat.proc.stdin.write(b"/exit\n")
        chat.proc.stdin.flush()
        check_clean_exit(chat, trees[chat], folders[chat])
    finally:
        chat.stop()
        eof.stop()
