"""Build and run every chapter's tree of the course, so that each chapter stays a runnable program.

Usage:
    python tools/steps.py check [--only ch05 ...] [--no-tests] [--keep] [--timeout S]
    python tools/steps.py tree ch05 DIR
    python tools/steps.py list
    python tools/steps.py counts [--write]
    python tools/steps.py fences
All take --root DIR (default: the repo holding this file); all but `fences` also take
--manifest PATH (default: ROOT/tools/chapters.toml). `fences` counts, for every .py file
under ROOT/minisgl, the lines that belong to a later chapter than the file's own (inside a
region, its marker lines included, or tagged), and the package's total and share of them.

Manifest (TOML; every path is relative to ROOT; every file is listed exactly once):
    always = ["pyproject.toml", "tests/conftest.py"]  # in every tree, when present

    [[chapter]]
    id = "ch01"                  # "ch" + number; chapters must be listed in increasing order
    title = "Config and tokenizer"
    stage = 1
    main = "examples/ch01_config_tokenizer.py"   # run from the tree's root, in this tree only
    files = ["minisgl/__init__.py", "minisgl/models/config.py"]  # introduced here, kept later
    tests = ["tests/test_config.py"]             # run with pytest, in this chapter's tree only

    docs = "docs"  # optional: each chapter's text is DOCS/<main's file name>.md, checked too
    fence_budget = 6.0  # optional: `check` fails where later-chapter lines (see `fences`)
                        # are more than this share of the package's lines, in per cent

Every .py file under minisgl/ must be listed by some chapter. Package __init__.py files are
pulled into a tree with their folder; list each in the chapter that first needs the package.

Markers (comments only, so they never change how the finished program runs; .py files only):
  - A comment line "# >>> ch12 optional words" opens a region that a line "# <<< ch12" closes
    (any indentation; regions may nest, the inner one for a later chapter). The whole region,
    marker lines included, is left out of the trees of chapters before ch12; from ch12 on the file
    is kept byte for byte, markers and all.
  - A line ending in the comment "# [ch12]" (as in "x = 1  # [ch12]") is left out before ch12.
    Use it on one-line statements only; the stripped file must still parse.
A marker must name a chapter of the manifest that comes after the one introducing its file.

A file imported (statically, anywhere in the module, TYPE_CHECKING blocks included) by a tree
but introduced by a later chapter is copied in anyway and counted as "introduced early".

`check` also fails a chapter whose tree names a later chapter ("chapter 26", or a name only a
later chapter defines), and, with `docs`, one whose text states what its tree and example
do not bear out (chapter_texts.py says what is checked and how to mark a quoted output).
"""

from __future__ import annotations

import argparse
import ast
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import chapter_texts as texts

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REGION = re.compile(r"# (>>>|<<<) (ch\d+)(?: .*)?")
LINE = re.compile(r"(?:^|\s)# \[(ch\d+)\]$")
LOOSE_LINE = re.compile(r"(?:^|\s)# \[ch\d+\]")  # the same marker with text after it
CHAPTER_ID = re.compile(r"ch(\d+)")


class StepsError(Exception):
    """Problems in the manifest or the markers; each message is a "file:line: what" line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def num(chapter_id: str) -> int:
    # Compare ids by number so that ch9 < ch10 whatever the zero padding.
    m = CHAPTER_ID.fullmatch(chapter_id)
    if not m:
        raise StepsError([f"bad chapter id {chapter_id!r}: expected ch + number, e.g. ch07"])
    return int(m[1])


@dataclass(frozen=True)
class Marker:
    line: int  # 1-based; a region's span is [line, end]
    chapter: str
    end: int | None = None  # None for a single-line marker


@functools.cache
def parse_markers(text: str, path: str = "<text>") -> tuple[tuple[Marker, ...], tuple[str, ...]]:
    """Return (markers, problems) of a Python source. Cached: trees reuse the same texts."""
    if "# >>>" not in text and "# <<<" not in text and "[ch" not in text:
        return (), ()
    lines = text.split("\n")
    markers: list[Marker] = []
    problems: list[str] = []
    stack: list[tuple[int, str]] = []
    try:  # tokenize, so that marker-like text inside a string is never taken for a marker
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        return (), (f"{path}: cannot tokenize: {e}",)
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        comment = tok.string.rstrip()
        where = f"{path}:{row}"
        parent = stack[-1][1] if stack else None
        if comment.startswith(("# >>>", "# <<<")):
            m = REGION.fullmatch(comment)
            if not m:
                problems.append(f"{where}: malformed region marker {comment!r}")
            elif lines[row - 1][:col].strip():
                problems.append(f"{where}: region marker must be alone on its line")
            elif m[1] == ">>>":
                if parent and num(m[2]) <= num(parent):
                    problems.append(f"{where}: {m[2]} region inside a {parent} region is pointless")
                stack.append((row, m[2]))
            elif not stack:
                problems.append(f"{where}: '# <<< {m[2]}' closes nothing")
            elif stack[-1][1] != m[2]:
                problems.append(
                    f"{where}: '# <<< {m[2]}' closes {parent} opened at line {stack[-1][0]}"
                )
            else:
                start, chapter = stack.pop()
                markers.append(Marker(start, chapter, row))
        elif LOOSE_LINE.search(comment) and not LINE.search(comment):
            problems.append(f"{where}: a '# [chNN]' marker must end its line: {comment!r}")
        elif m := LINE.search(comment):
            chapter = m[1]
            if parent and num(chapter) <= num(parent):
                problems.append(f"{where}: [{chapter}] inside a {parent} region is pointless")
            markers.append(Marker(row, chapter))
    problems += [f"{path}:{row}: '# >>> {ch}' is never closed" for row, ch in stack]
    return tuple(markers), tuple(problems)


def strip(text: str, upto: int, path: str = "<text>") -> str:
    """Leave out what chapters after number `upto` add; everything else stays byte-identical."""
    markers, problems = parse_markers(text, path)
    if problems:
        raise StepsError(list(problems))
    drop: set[int] = set()
    for mk in markers:
        if num(mk.chapter) > upto:
            drop.update(range(mk.line, (mk.end or mk.line) + 1))
    if not drop:
        return text
    return "\n".join(line for i, line in enumerate(text.split("\n"), 1) if i not in drop)


def fences(root: Path) -> list[tuple[int, int, str]]:
    """(later-chapter lines, lines, path) of every .py file under ROOT/minisgl."""
    rows = []
    for p in sorted((root / "minisgl").rglob("*.py")):
        text = p.read_text()
        markers, _ = parse_markers(text, str(p))
        lines: set[int] = set()
        for mk in markers:
            lines.update(range(mk.line, (mk.end or mk.line) + 1))
        rows.append((len(lines), text.count("\n"), p.relative_to(root).as_posix()))
    return rows


def print_fences(root: Path) -> None:
    rows = fences(root)
    for fence, n, path in sorted([r for r in rows if r[0]], reverse=True):
        print(f"{fence:5d} {n:5d} {100 * fence / n:5.1f}% {path}")
    fence, total = sum(r[0] for r in rows), sum(r[1] for r in rows)
    print(f"total {fence}/{total} = {100 * fence / max(total, 1):.1f}%")


def fence_problem(m: Manifest) -> tuple[str, str]:
    """(the share of later-chapter lines as a line to print, why it is over budget or '')."""
    rows = fences(m.root)
    fence, total = sum(r[0] for r in rows), sum(r[1] for r in rows)
    share = 100 * fence / max(total, 1)
    line = f"later-chapter lines: {fence}/{total} = {share:.2f}% of the package"
    if m.fence_budget is None:
        return line, ""
    line += f" (budget {m.fence_budget:g}%)"
    if share <= m.fence_budget:
        return line, ""
    most = ", ".join(f"{p} {f}" for f, _, p in sorted(rows, reverse=True)[:5])
    why = (
        f"later-chapter lines are {share:.2f}% of the package, over the manifest's fence_budget"
        f" of {m.fence_budget:g}%: move a later chapter's code out of an earlier file into a"
        f" module of the chapter's own (most: {most}; `steps.py fences` lists them all)"
    )
    return line, why


@dataclass
class Chapter:
    id: str
    title: str
    stage: int
    main: str
    files: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)

    @property
    def num(self) -> int:
        return num(self.id)


@dataclass
class Manifest:
    root: Path
    always: list[str]
    chapters: list[Chapter]
    docs: str | None = None  # the folder of the chapter texts, when they are checked
    fence_budget: float | None = None  # the most later-chapter lines, in % of the package
    owner: dict[str, Chapter] = field(default_factory=dict)  # file -> chapter listing it

    @staticmethod
    def load(root: Path, path: Path) -> Manifest:
        data = tomllib.loads(path.read_text())
        try:
            chapters = [Chapter(**c) for c in data.get("chapter", [])]
        except TypeError as e:  # a missing or unknown key in a [[chapter]] table
            raise StepsError([f"{path}: {e}"]) from e
        m = Manifest(root, list(data.get("always", [])), chapters, data.get("docs"))
        m.fence_budget = data.get("fence_budget")
        for ch in chapters:
            for f in [*ch.files, ch.main, *ch.tests]:
                m.owner.setdefault(f, ch)
        return m

    def validate(self) -> None:
        problems: list[str] = []
        seen: dict[str, str] = {}
        for where, files in [("always", self.always)] + [
            (ch.id, [*ch.files, ch.main, *ch.tests]) for ch in self.chapters
        ]:
            for f in files:
                if f in seen:
                    problems.append(f"{f}: listed twice ({seen[f]} and {where})")
                seen[f] = where
                if not (self.root / f).is_file() and where != "always":
                    problems.append(f"{f}: listed by {where} but does not exist")
        ids = [ch.id for ch in self.chapters]
        for a, b in zip(ids, ids[1:], strict=False):
            if num(a) >= num(b):
                problems.append(f"manifest: chapters must be in order, but {a} comes before {b}")
        package = self.root / "minisgl"
        for p in sorted(package.rglob("*.py")) if package.is_dir() else []:
            rel = p.relative_to(self.root).as_posix()
            if rel not in seen and "__pycache__" not in p.parts:
                problems.append(f"{rel}: not listed by any chapter of the manifest")
        for f, where in seen.items():
            if not f.endswith(".py") or not (self.root / f).is_file():
                continue
            markers, marker_problems = parse_markers(read(self.root / f), f)
            problems += marker_problems
            own = self.owner[f].num if f in self.owner else 0
            for mk in markers:
                if num(mk.chapter) not in {num(i) for i in ids}:
                    problems.append(
                        f"{f}:{mk.line}: marker names {mk.chapter}, not in the manifest"
                    )
                elif num(mk.chapter) <= own:
                    why = f"is pointless in a file that {where} introduces"
                    problems.append(f"{f}:{mk.line}: marker for {mk.chapter} {why}")
        if problems:
            raise StepsError(problems)


@functools.cache
def read(path: Path) -> str:
    return path.read_bytes().decode()  # bytes, so that CRLF and the like survive untouched


@functools.cache  # most files are the same text in many trees
def imports(path: str, text: str) -> frozenset[str]:
    """Dotted names of the minisgl modules a file may import; for `from a import b`, b too."""
    tree = ast.parse(text, path)
    parts = tuple(Path(path).with_suffix("").parts)
    package = parts[:-1]  # a file's package; for __init__.py that is its own folder
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level and package[:1] != ("minisgl",):
                continue
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            base += node.module.split(".") if node.module else []
            names.add(".".join(base))
            names.update(".".join([*base, a.name]) for a in node.names)
    return frozenset(n for n in names if n.split(".")[0] == "minisgl")


@dataclass
class Tree:
    files: dict[str, str]  # path -> stripped text
    early: set[str]
    problems: list[str]


def build(m: Manifest, index: int) -> Tree:
    ch = m.chapters[index]
    wanted = [f for f in m.always if (m.root / f).is_file()]
    wanted += [f for c in m.chapters[: index + 1] for f in c.files] + [ch.main, *ch.tests]
    tree = Tree({}, set(), [])
    while wanted:
        f = wanted.pop()
        if f in tree.files:
            continue
        text = read(m.root / f)
        pulled = [p.as_posix() + "/__init__.py" for p in Path(f).parents if p != Path(".")]
        if f.endswith(".py"):
            try:
                text = strip(text, ch.num, f)
                names = imports(f, text)
            except StepsError as e:
                tree.problems += e.problems
            except SyntaxError as e:
                tree.problems.append(f"{f}:{e.lineno}: stripped file does not parse: {e.msg}")
            else:
                for name in names:
                    stem = name.replace(".", "/")
                    pulled += [stem + ".py", stem + "/__init__.py"]
        tree.files[f] = text
        for p in pulled:
            if p not in tree.files and (m.root / p).is_file():
                if p in m.owner and m.owner[p].num > ch.num:
                    tree.early.add(p)
                wanted.append(p)
    return tree


def diff(tree: Tree, previous: Tree | None) -> tuple[list[str], list[str]]:
    """(new, modified): files that appeared since the previous tree, and changed ones."""
    old = previous.files if previous else {}
    new = sorted(f for f in tree.files if f not in old and f not in tree.early)
    return new, sorted(f for f in tree.files if f in old and old[f] != tree.files[f])


def describe(tree: Tree, previous: Tree | None) -> str:
    new, mod = diff(tree, previous)
    return (
        f"files {len(tree.files)} (+{len(new)} new, {len(mod)} modified, {len(tree.early)} early)"
    )


def write(m: Manifest, tree: Tree, out: Path) -> None:
    for f, text in tree.files.items():
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        (out / f).write_bytes(text.encode())
    if (m.root / "models").is_dir():  # examples load models/... relative to their cwd
        (out / "models").symlink_to((m.root / "models").resolve(), target_is_directory=True)


@dataclass
class Run:
    ok: bool
    why: str
    seconds: float
    output: str  # stdout, then stderr
    stdout: str


def run(cmd: list[str], tree_dir: Path, timeout: float, what: str) -> Run:
    # PYTHONPATH is the tree alone, so the repo's own minisgl can never fill in a stripped module.
    env = {**os.environ, "PYTHONPATH": str(tree_dir), "PYTHONDONTWRITEBYTECODE": "1"}
    # One torch thread unless told otherwise, as in tests/conftest.py: next to a busy core,
    # two threads wait for each other at every op and a main runs several times slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.monotonic()
    # A session of its own, so a timeout also ends the processes the main started.
    # stdout apart from stderr: a text quotes what a main prints, not a library's warnings.
    pipe = subprocess.PIPE
    with subprocess.Popen(cmd, cwd=tree_dir, env=env, stdout=pipe, stderr=pipe,
                          start_new_session=True) as p:  # fmt: skip
        try:
            out, err = p.communicate(timeout=timeout)
            why = f"{what} exited {p.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            why = f"{what} timed out after {timeout:g}s"
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    ok, seconds = p.returncode == 0, time.monotonic() - start
    return Run(ok, "" if ok else why, seconds, stdout + stderr, stdout)


def isolated(tree_dir: Path) -> str:
    """Say why `import minisgl` in the tree would not load the tree's own package, or ''."""
    probe = (
        "import importlib.util as u, json; s = u.find_spec('minisgl'); "
        "print(json.dumps(s and [s.origin, list(s.submodule_search_locations or [])]))"
    )
    r = run([sys.executable, "-c", probe], tree_dir, 60, "probe")
    if not r.ok:
        return r.why
    spec = json.loads(r.output.strip().splitlines()[-1])
    places = [p for p in ([spec[0]] + spec[1] if spec else []) if p]
    outside = [p for p in places if not Path(p).resolve().is_relative_to(tree_dir.resolve())]
    return f"minisgl would be imported from outside the tree: {outside[0]}" if outside else ""


def first_definitions(m: Manifest, trees: list[Tree]) -> dict[str, tuple[int, str]]:
    """Each name the package binds -> (number, id) of the first chapter whose tree binds it."""
    first: dict[str, tuple[int, str]] = {}
    for ch, tree in zip(m.chapters, trees):
        for f, text in tree.files.items():
            if f.startswith("minisgl/") and f.endswith(".py") and not tree.problems:
                for name in texts.definitions(text):
                    first.setdefault(name, (ch.num, ch.id))
    return first


def counts_of(trees: list[Tree], i: int) -> texts.Counts:
    new, modified = diff(trees[i], trees[i - 1] if i else None)
    in_package = sum(f.startswith("minisgl/") for f in new)
    return texts.Counts(len(trees[i].files), len(new), len(modified), in_package)


def write_counts(m: Manifest, write: bool) -> int:
    """Say, or with `write` fix, the file counts each chapter's text states wrongly."""
    trees, wrong = [build(m, i) for i in range(len(m.chapters))], 0
    for i, ch in enumerate(m.chapters):
        path = m.root / doc_of(m, ch)
        if not path.is_file():
            continue
        text = path.read_text()
        problems = texts.count_problems(doc_of(m, ch), text, counts_of(trees, i))
        if problems and texts.COUNTS.search(text):
            wrong += 1
            print(f"{doc_of(m, ch)}: {texts.counts_line(counts_of(trees, i))}")
            if write:
                path.write_text(texts.fix_counts(text, counts_of(trees, i)))
    print(f"{wrong} chapter texts {'rewritten' if write else 'state other counts'}")
    return 1 if wrong and not write else 0


def doc_of(m: Manifest, ch: Chapter) -> str:
    return f"{m.docs}/{Path(ch.main).stem}.md"


def doc_problems(m: Manifest, i: int, trees: list[Tree]) -> tuple[list[str], list[texts.Quote]]:
    """What the chapter's text states about its tree that is not so; its quoted outputs."""
    ch = m.chapters[i]
    doc = doc_of(m, ch)
    if not (m.root / doc).is_file():
        return [f"{doc}: the chapter's text is missing"], []
    text = read(m.root / doc)
    problems = texts.count_problems(doc, text, counts_of(trees, i))
    readme = m.root / m.docs / "README.md"  # type: ignore[operator]
    links = texts.readme_problems(read(readme) if readme.is_file() else "", f"{m.docs}/README.md",
                                  [Path(doc).name])  # fmt: skip
    problems += list(links.values())
    quoted = texts.quotes(text)
    if not quoted:
        problems.append(
            f"{doc}: marks no quote of the example's output ('<!-- example output -->')"
        )
    return problems, quoted


def has_gpu() -> bool:
    """Whether the examples would run on an NVIDIA GPU here (as the Makefile asks it)."""
    if not shutil.which("nvidia-smi"):
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return r.returncode == 0 and "GPU" in r.stdout


def check(m: Manifest, only: list[str], tests: bool, keep: bool, timeout: float) -> int:
    width = max(len(ch.title) for ch in m.chapters)
    failed: list[str] = []
    early: list[str] = []
    trees = [build(m, i) for i in range(len(m.chapters))]
    first = first_definitions(m, trees)
    # The texts quote runs on a CPU; where a GPU is at hand the examples run there and print
    # what they print on it, so the quotes are not compared.
    quotes = not has_gpu()
    for i, ch in enumerate(m.chapters):
        tree, prev = trees[i], trees[i - 1] if i else None
        if only and ch.id not in only:
            continue
        out = Path(tempfile.mkdtemp(prefix=f"minisgl-{ch.id}-"))
        write(m, tree, out)
        steps: list[str] = []
        fail = f"tree: {tree.problems[0]}" if tree.problems else isolated(out)
        tail = "\n".join(tree.problems)
        printed = None  # what the main printed, when it ran and passed
        pytest = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *ch.tests]
        for what, cmd in [("main", [sys.executable, ch.main]), ("tests", pytest)]:
            if fail or (what == "tests" and not (tests and ch.tests)):
                continue
            r = run(cmd, out, timeout, what)
            steps.append(f"{what} {'ok' if r.ok else 'FAILED'} {r.seconds:.1f}s")
            fail, tail = r.why, "\n".join(r.output.rstrip().splitlines()[-30:])
            if what == "main" and r.ok:
                printed = r.stdout
        if not tests or not ch.tests:
            steps.append("tests skipped" if not tests else "no tests")
        facts = [("refs", texts.later_references(tree.files, ch.num, first, ch.main))]
        if m.docs:
            problems, quoted = doc_problems(m, i, trees)
            if printed is not None and quotes:
                problems += texts.quote_problems(doc_of(m, ch), quoted, printed)
            facts.append(("docs" if quotes else "docs (quotes not compared on a GPU)", problems))
        for what, problems in facts:
            steps.append(f"{what} {'FAILED' if problems else 'ok'}")
            if problems and not fail:
                fail, tail = f"{what}: {problems[0]}", "\n".join(problems)
        verdict = f"FAIL: {fail}" if fail else "PASS"
        print(
            f"{ch.id:<5} {ch.title:<{width}}  {describe(tree, prev)}  {'  '.join(steps)}  {verdict}"
        )
        if fail:
            failed.append(ch.id)
            print("\n".join("    " + line for line in tail.splitlines()))
        early += [f"{ch.id} <- {f} ({m.owner[f].id})" for f in sorted(tree.early)]
        if keep:
            print(f"      tree kept in {out}")
        else:
            shutil.rmtree(out)
        sys.stdout.flush()
    ran = len(only) if only else len(m.chapters)
    print(f"\n{ran - len(failed)}/{ran} chapters passed; failed: {' '.join(failed) or 'none'}")
    print("introduced early: " + (", ".join(early) if early else "none"))
    share, over = fence_problem(m)
    print(share)
    if over:
        print(f"FAIL: {over}")
    return 1 if failed or over else 0


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    common.add_argument("--manifest", type=Path, help="default: ROOT/tools/chapters.toml")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", parents=[common], help="build and run every chapter's tree")
    c.add_argument("--only", nargs="+", action="extend", default=[], metavar="CHAPTER")
    c.add_argument("--no-tests", action="store_true")
    c.add_argument("--keep", action="store_true", help="keep the temporary trees")
    c.add_argument("--timeout", type=float, default=600, help="seconds for a main or its tests")
    t = sub.add_parser("tree", parents=[common], help="write one chapter's tree into DIR")
    t.add_argument("chapter")
    t.add_argument("dir", type=Path)
    sub.add_parser("list", parents=[common], help="list the chapters")
    counts = sub.add_parser("counts", parents=[common], help="the file counts the texts state")
    counts.add_argument("--write", action="store_true", help="put the trees' numbers in")
    f = sub.add_parser("fences", help="later-chapter lines per file of minisgl/, and in all")
    f.add_argument("--root", type=Path, default=common.get_default("root"))
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.command == "fences":  # needs no manifest
        print_fences(root)
        return 0
    try:
        m = Manifest.load(root, args.manifest or root / "tools/chapters.toml")
        m.validate()
        ids = [ch.id for ch in m.chapters]
        wanted = [args.chapter] if args.command == "tree" else getattr(args, "only", [])
        if unknown := [c for c in wanted if c not in ids]:
            raise StepsError([f"unknown chapter {', '.join(unknown)}; chapters: {' '.join(ids)}"])
    except (StepsError, OSError, tomllib.TOMLDecodeError, TypeError) as e:
        print(f"steps.py: {e}", file=sys.stderr)
        return 2
    if args.command == "check":
        return check(m, args.only, not args.no_tests, args.keep, args.timeout)
    if args.command == "counts":
        if not m.docs:
            print("steps.py: the manifest names no docs folder", file=sys.stderr)
            return 2
        return write_counts(m, args.write)
    if args.command == "list":
        width, previous = max(len(ch.title) for ch in m.chapters), None
        for i, ch in enumerate(m.chapters):
            tree = build(m, i)
            print(f"{ch.id:<5} stage {ch.stage}  {ch.title:<{width}}  {describe(tree, previous)}")
            previous = tree
        return 0
    i = ids.index(args.chapter)
    if args.dir.exists() and any(args.dir.iterdir()):
        print(f"steps.py: {args.dir} exists and is not empty", file=sys.stderr)
        return 2
    tree, previous = build(m, i), build(m, i - 1) if i else None
    args.dir.mkdir(parents=True, exist_ok=True)
    write(m, tree, args.dir)
    new, modified = diff(tree, previous)
    print(f"{m.chapters[i].id} {m.chapters[i].title}: {describe(tree, previous)} in {args.dir}")
    for f in sorted(tree.files):
        mark = "+" if f in new else "~" if f in modified else "!" if f in tree.early else " "
        print(f"  {mark} {f}" + (f"  (early: {m.owner[f].id})" if f in tree.early else ""))
    print("  (+ new, ~ modified, ! introduced early)")
    print("\n".join(tree.problems), file=sys.stderr)
    return 1 if tree.problems else 0


if __name__ == "__main__":
    sys.exit(main())
