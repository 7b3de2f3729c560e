"""Chapter 15: the incremental detokenizer. Tokens arrive one at a time; the text we send
must never hold half a character, and must never show a stop string or anything after it.

Run from the repo root: python examples/ch15_detokenizer.py
"""

from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl.tokenizer.tokenizer import Tokenizer

MODEL = "models/SmolLM2-135M-Instruct"
tok = Tokenizer(MODEL)
prompt = tok.encode("Repeat after me:")
failures = []

# 1. Accents, an emoji, CJK and an emoji with a skin-tone modifier: byte-level tokens split
# them into pieces that are not characters on their own.
text = "Café 🎉 東京 naïve 👍🏽 done"
ids = tok.encode(text, add_special_tokens=False)
detok = IncrementalDetokenizer(tok, prompt, stop=[])
deltas = []
print(f"{text!r}: {len(ids)} tokens\n  token  alone       delta")
for t in ids:
    alone = tok.decode([t])
    delta = detok.add(t)
    deltas.append(delta)
    print(f"  {t:>5}  {alone!r:<10}  {delta!r}")
deltas.append(detok.finish())
joined = "".join(deltas)
broken = sum("\ufffd" in tok.decode([t]) for t in ids)
print(f"tokens that decode alone to U+FFFD: {broken} of {len(ids)}")
print(f"deltas holding U+FFFD: {sum(chr(0xFFFD) in d for d in deltas)}; joined: {joined!r}")
if broken == 0 or any("\ufffd" in d for d in deltas) or joined != text:
    failures.append("the deltas should join to the text with no U+FFFD")

# 2. A stop string. Text that might be its start is held back; when it completes, the text is
# cut before it and the request is over (the worker then aborts it in the scheduler).
stop = "</answer>"
out = "x <y and y<z</answer> more text"
ids = tok.encode(out, add_special_tokens=False)
detok = IncrementalDetokenizer(tok, prompt, stop=[stop])
sent = []
print(f"\nstop={stop!r}, the model writes {out!r}\n  token        delta      held back")
for t in ids:
    delta = detok.add(t)
    sent.append(delta)
    print(f"  {tok.decode([t])!r:<11}  {delta!r:<9}  {detok.text[detok.sent :]!r}")
    if detok.stopped:
        break
sent.append(detok.finish())
result = "".join(sent)
print(f"stopped={detok.stopped}; the client sees {result!r}")
if not detok.stopped or result != out[: out.index(stop)]:
    failures.append(f"expected the text cut before {stop!r}, got {result!r}")

if failures:
    raise SystemExit("; ".join(failures))
