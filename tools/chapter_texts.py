"""What a chapter's text and tree say, checked against what they are, for `steps.py check`.

A reader trusts a chapter only while what it states stays true as the code moves on, so
`steps.py check` holds every chapter to these, where the manifest names a docs folder:

- Its text, DOCS/<the main's file name>.md, says "the tree has N files", perhaps followed by
  ": M new, K modified" (or "changed", or "M new in the package"): the numbers `steps.py
  list` prints.
- A block right after a line `<!-- example output -->` is what the chapter's main printed
  in this run, line for line. A line `...` stands for any lines. Lines that differ from
  run to run (times, process ids, ports) are named by a part of them in the marker,
  `<!-- example output; vary: "wall time", "pid" -->`, and compared by shape only: each
  number (or other word holding a digit) stands for any other, runs of spaces for any. A
  part that ends in `*` (`"aten::*"`) names lines whose rest may differ in any way: a
  quoted line holding the part matches a printed line holding it. The quotes are of runs
  on a CPU: where a GPU is at hand, `check` does not compare them.
- DOCS/README.md links every chapter's text.
- No file of the tree's package or example names a later chapter: neither "chapter 26" in
  chapter 12's tree, nor a field or function that no chapter up to it defines but a later
  one does (`reads_fp8_kv` in chapter 7's registry).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from dataclasses import dataclass

COUNTS = re.compile(r"the tree has (\d+) files([^)]{0,200})")  # up to the parenthesis' end
COUNT_ITEMS = {  # what a number after "the tree has N files:" counts
    "new in the package": re.compile(r"(\d+) new in the package"),
    "new": re.compile(r"(\d+) new(?! in the package)"),
    "modified": re.compile(r"(\d+) (?:modified|changed)"),
}
MARKER = re.compile(r"<!-- example output(.*?)-->")
VARIES = re.compile(
    r"[\w.]*\d[\w.]*(?:[+-]\d[\w.]*)?"
)  # a number (1e-05 too), a pid, a port, a hex id, a temporary name
MENTION = re.compile(r"\b(?:[Cc]hapters?\s+|ch)(\d+)\b((?:(?:,\s*|\s+and\s+|\s+or\s+)\d+\b)*)")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Names that later chapters' code shares with a library an earlier chapter calls (FlashInfer's
# norm kernels and its plan arguments, which chapter 20's kernels take by the same names): in
# the earlier tree they are the library's.
LIBRARY_NAMES = frozenset({"fused_add_rmsnorm", "sm_scale"})


@dataclass(frozen=True)
class Counts:
    files: int
    new: int
    modified: int
    new_in_package: int


def count_problems(doc: str, text: str, counts: Counts) -> list[str]:
    """The text's "the tree has N files" sentences against the tree's counts."""
    found = list(COUNTS.finditer(text))
    if not found:
        return [f'{doc}: says nowhere "the tree has {counts.files} files"']
    actual = {
        "new": counts.new,
        "modified": counts.modified,
        "new in the package": counts.new_in_package,
    }
    problems = []
    for m in found:
        line = text.count("\n", 0, m.start()) + 1
        stated = [("files", int(m[1]), counts.files)]
        stated += [
            (what, int(x[1]), actual[what])
            for what, p in COUNT_ITEMS.items()
            if (x := p.search(m[2]))
        ]
        problems += [
            f"{doc}:{line}: says {n} {what}; the tree has {real} ({counts_line(counts)}; "
            "`python tools/steps.py counts --write` puts the tree's numbers in)"
            for what, n, real in stated
            if n != real
        ]
    return problems


def fix_counts(text: str, counts: Counts) -> str:
    """The text with the numbers of its "the tree has N files" sentences made the tree's."""
    actual = {
        "new": counts.new,
        "modified": counts.modified,
        "new in the package": counts.new_in_package,
    }

    def fix(m: re.Match[str]) -> str:
        tail = m[2]
        for what, p in COUNT_ITEMS.items():
            if x := p.search(tail):  # the number leads the item: replace just it
                tail = tail[: x.start()] + str(actual[what]) + tail[x.start() + len(x[1]) :]
        return f"the tree has {counts.files} files{tail}"

    return COUNTS.sub(fix, text)


def counts_line(c: Counts) -> str:
    return (
        f"{c.files} files: {c.new} new ({c.new_in_package} in the package), {c.modified} modified"
    )


@dataclass(frozen=True)
class Quote:
    line: int  # of the block's first line in the text
    lines: tuple[str, ...]
    vary: tuple[str, ...]  # a line holding one of these is compared by shape


def quotes(text: str) -> list[Quote]:
    """The blocks of the text marked as the example's output."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        m = MARKER.fullmatch(line.strip())
        if not m:
            continue
        start = i + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        if start >= len(lines) or not lines[start].startswith("```"):
            out.append(Quote(i + 1, (), ()))  # a marker without its block: reported below
            continue
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("```")), None)
        body = tuple(lines[start + 1 : end if end is not None else len(lines)])
        out.append(Quote(start + 2, body, tuple(re.findall(r'"([^"]+)"', m[1]))))
    return out


def shape(line: str) -> re.Pattern[str]:
    """A quoted line as a pattern: each run of letters, digits and dots holding a digit stands
    for any such run, and each run of spaces for any spaces."""
    parts, at = [], 0
    for m in VARIES.finditer(line.strip()):
        parts += [re.escape(line.strip()[at : m.start()]), r"[\w.+-]+"]
        at = m.end()
    parts.append(re.escape(line.strip()[at:]))
    return re.compile(r"\s*" + re.sub(r"(\\ )+", r"\\s+", "".join(parts)) + r"\s*")


def quote_problems(doc: str, quoted: list[Quote], output: str) -> list[str]:
    """Each quoted block against the example's output of this run; the first difference."""
    printed = output.rstrip().split("\n") if output.strip() else []
    printed = [line.rstrip() for line in printed]
    problems = []
    for q in quoted:
        if not q.lines:
            problems.append(f"{doc}:{q.line}: '<!-- example output -->' is not followed by a block")
            continue
        problem = _first_difference(q, printed)
        if problem:
            problems.append(f"{doc}:{problem}")
    return problems


def _first_difference(q: Quote, printed: list[str]) -> str:
    def same(doc_line: str, out_line: str) -> bool:
        loose = [v[:-1] for v in q.vary if v.endswith("*") and v[:-1] in doc_line]
        if loose:
            return loose[0] in out_line
        if any(v in doc_line for v in q.vary):
            return shape(doc_line).fullmatch(out_line) is not None
        return doc_line.rstrip() == out_line

    at, skipping = 0, False  # the next printed line to match; whether `...` came before
    for n, doc_line in enumerate(q.lines):
        if doc_line.strip() == "...":
            skipping = True
            continue
        if skipping:
            hit = next((j for j in range(at, len(printed)) if same(doc_line, printed[j])), None)
            if hit is None:
                return f"{q.line + n}: the example printed no line {doc_line!r} here"
            at, skipping = hit, False
        elif at >= len(printed) or not same(doc_line, printed[at]):
            there = repr(printed[at]) if at < len(printed) else "nothing more"
            return f"{q.line + n}: quotes {doc_line!r}; the example printed {there}"
        at += 1
    if not skipping and at < len(printed):
        return f"{q.line + len(q.lines)}: the quote ends; the example printed {printed[at]!r} next"
    return ""


def readme_problems(readme: str, readme_name: str, doc_names: list[str]) -> dict[str, str]:
    """{chapter text: problem} for the chapter texts README does not link."""
    return {d: f"{readme_name} links no ({d})" for d in doc_names if f"]({d})" not in readme}


# ---- later chapters' names in an earlier tree ----------------------------------------------


@functools.cache  # the same file text comes back in every later tree
def definitions(text: str) -> frozenset[str]:
    """Every name a module binds: functions, classes, arguments, variables, attributes."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return frozenset(names)


def _distinctive(name: str) -> bool:
    # snake_case with an underscore inside, or CamelCase: not a word like `view` or `step`,
    # which a library's objects have too.
    inner = name.strip("_")
    camel = (
        inner[:1].isupper()
        and any(c.islower() for c in inner)
        and any(c.isupper() for c in inner[1:])
    )
    return "_" in inner or camel


@functools.cache
def uses(text: str) -> tuple[tuple[int, str], ...]:
    """(line, name) of the distinctive names a module reads: in its code, and in its comments
    and docstrings where they are quoted in backticks or are CamelCase."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((node.lineno, node.arg))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            quoted = " ".join(re.findall(r"`([^`]*)`", tok.string))
            words = IDENT.findall(quoted) + [w for w in IDENT.findall(tok.string) if w[0].isupper()]
            found += [(tok.start[0], w) for w in words]
    return tuple((line, name) for line, name in found if _distinctive(name))


@functools.cache
def mentions(text: str) -> tuple[tuple[int, int], ...]:
    """(line, chapter number) of every "chapter N", "chapters N and M" or "chN" in a text."""
    out = []
    for m in MENTION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out += [(line, int(n)) for n in [m[1], *re.findall(r"\d+", m[2])]]
    return tuple(out)


def later_references(
    files: dict[str, str], num: int, first: dict[str, tuple[int, str]], main: str
) -> list[str]:
    """A tree's mentions of chapters after `num` and its uses of names that only later
    chapters define (`first`: name -> the number and id of the first chapter defining it)."""
    problems = []
    for path in sorted(files):
        if not (path.startswith("minisgl/") or path == main) or not path.endswith(".py"):
            continue
        text = files[path]
        try:
            used = uses(text)
        except SyntaxError:
            continue  # the tree's own check reports it
        for line, n in mentions(text):
            if n > num:
                problems.append(f"{path}:{line}: names chapter {n}, which comes later")
        if not path.startswith("minisgl/"):
            continue
        seen = set()
        for line, name in used:
            later = first.get(name)
            if later and later[0] > num and name not in LIBRARY_NAMES and name not in seen:
                seen.add(name)
                problems.append(f"{path}:{line}: `{name}` is first defined by {later[1]}")
    return problems
