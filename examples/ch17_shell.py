"""Chapter 17: the interactive shell. `python -m minisgl --model M --shell` starts the same
worker processes as the server and chats in the terminal; here a pipe plays the user.

Run from the repo root: python examples/ch17_shell.py
"""

import subprocess
import sys
import time

MODEL = "models/SmolLM2-135M-Instruct"
LINES = [
    "What is the capital of France?",
    "And of Italy?",  # only makes sense with the first question in the conversation
    "/reset",
    "And of Italy?",  # the same words, now without the conversation
    "/exit",
]

cmd = [sys.executable, "-m", "minisgl", "--model", MODEL, "--device", "cpu", "--dtype", "float32"]
cmd += ["--max-seq-len-override", "96", "--log-level", "warning", "--shell"]
print("$", " ".join(["python", *cmd[1:]]))
t0 = time.perf_counter()
try:
    done = subprocess.run(
        cmd, input="\n".join(LINES) + "\n", capture_output=True, text=True, timeout=300
    )
except subprocess.TimeoutExpired:
    raise SystemExit("the shell did not finish within 300 s") from None
print(f"exit code {done.returncode} after {time.perf_counter() - t0:.1f}s; the transcript:\n")

# The shell prints "> " and waits; a piped user types instantly, so we put each line back
# after the prompt that read it.
out = done.stdout
first, *rest = out.split("\n> ")
print(first + "".join(f"\n> {line}\n{part}" for line, part in zip(LINES, rest)).rstrip())

failures = []
if done.returncode != 0:
    failures.append(f"exit code {done.returncode}; stderr:\n{done.stderr[-2000:]}")
if len(rest) != len(LINES) or "(conversation cleared)" not in out:
    failures.append("expected one prompt per line and the /reset notice")
if "Paris" not in out:
    failures.append("the first answer should mention Paris")
if failures:
    raise SystemExit("\n".join(failures))
