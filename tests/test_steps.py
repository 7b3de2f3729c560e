"""tools/steps.py on a fake three-chapter repo built in tmp_path; no model needed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STEPS = Path(__file__).resolve().parent.parent / "tools" / "steps.py"
sys.path.insert(0, str(STEPS.parent))  # steps.py imports chapter_texts.py beside it
_spec = importlib.util.spec_from_file_location("steps", STEPS)
steps = importlib.util.module_from_spec(_spec)
sys.modules["steps"] = steps  # dataclasses look their module up while the class is built
_spec.loader.exec_module(steps)

MANIFEST = """
always = ["conftest.py", "missing_is_fine.py"]

[[chapter]]
id = "ch01"
title = "Core"
stage = 1
main = "examples/ch01.py"
files = ["minisgl/__init__.py", "minisgl/core.py"]
tests = ["tests/test_core.py"]

[[chapter]]
id = "ch02"
title = "Extra"
stage = 1
main = "examples/ch02.py"
files = ["minisgl/extra.py"]

[[chapter]]
id = "ch10"
title = "Later, numbered past ch9"
stage = 2
main = "examples/ch10.py"
files = ["minisgl/sub/__init__.py", "minisgl/sub/later.py"]
"""

CORE = """
def base():
    return "base"
# >>> ch02 the extra chapter adds a helper
def added():
    from .extra import EXTRA
    # >>> ch10
    from .sub.later import LATER
    return EXTRA + LATER
    # <<< ch10
    return EXTRA
# <<< ch02
NAMES = ["base"]
NAMES.append("added")  # [ch02]
"""

FILES = {
    "conftest.py": "",
    "minisgl/__init__.py": "",
    "minisgl/core.py": CORE,
    "minisgl/extra.py": "EXTRA = 'extra'\n",
    "minisgl/sub/__init__.py": "",
    "minisgl/sub/later.py": "LATER = '+later'\n",
    "tests/test_core.py": "from minisgl import core\n\ndef test_base():\n    assert core.base()\n",
    # The stripped ch02 helper and the ch02 module must both be out of reach in ch01's tree; the
    # module name is built at run time so that steps.py does not pull it in as "early".
    "examples/ch01.py": """
        import importlib
        from minisgl import core
        assert not hasattr(core, "added") and core.NAMES == ["base"], core.NAMES
        try:
            importlib.import_module("minisgl." + "extra")
        except ModuleNotFoundError:
            print("ch01: extra is out of reach")
        else:
            raise SystemExit("ch01 could import a later module")
    """,
    "examples/ch02.py": """
        from minisgl.core import NAMES, added
        assert NAMES == ["base", "added"] and added() == "extra", added()
        print("ch02:", added())
    """,
    "examples/ch10.py": "from minisgl.core import added\nprint('ch10:', added())\n",
}


def make_repo(root: Path, **changes: str) -> Path:
    (root / "tools").mkdir(parents=True)
    (root / "tools/chapters.toml").write_text(MANIFEST)
    for path, text in {**FILES, **changes}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text).lstrip())
    return root


def steps_cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(STEPS), *args, "--root", str(root)]
    cmd += ["--manifest", str(root / "tools/chapters.toml")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)


def line_of(out: str, chapter: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(chapter + " "))


def test_strip_regions_nested_and_single_lines() -> None:
    core = textwrap.dedent(CORE).lstrip()
    assert steps.strip(core, 1) == 'def base():\n    return "base"\nNAMES = ["base"]\n'
    ch02 = steps.strip(core, 2)
    assert "def added" in ch02 and 'NAMES.append("added")' in ch02
    assert "# >>> ch02" in ch02 and "LATER" not in ch02 and "# >>> ch10" not in ch02
    assert steps.strip(core, 10) == core  # from the last marker on, byte for byte
    assert steps.num("ch9") < steps.num("ch10")


def test_strip_ignores_marker_text_inside_strings() -> None:
    text = 's = """\n# >>> ch05\n"""\nt = "x  # [ch05]"\n'
    assert steps.strip(text, 1) == text


@pytest.mark.parametrize(
    "text, message",
    [
        ("# >>> ch02\nx = 1\n", "1: '# >>> ch02' is never closed"),
        ("x = 1\n# <<< ch02\n", "2: '# <<< ch02' closes nothing"),
        ("# >>> ch02\n# >>> ch03\n# <<< ch02\n", "3: '# <<< ch02' closes ch03 opened at line 2"),
        ("# >>> ch03\n# >>> ch02\n# <<< ch02\n# <<< ch03\n", "2: ch02 region inside a ch03"),
        ("x = 1  # >>> ch02\n", "1: region marker must be alone on its line"),
        ("# >>>ch02\n", "1: malformed region marker"),
    ],
)
def test_strip_reports_bad_markers(text: str, message: str) -> None:
    with pytest.raises(steps.StepsError) as e:
        steps.strip(text, 1, "f.py")
    assert f"f.py:{message}" in str(e.value)


def test_check_passes_and_counts(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    r = steps_cli(root, "check")
    assert r.returncode == 0, r.stdout + r.stderr
    ch01, ch02, ch10 = (line_of(r.stdout, c) for c in ("ch01", "ch02", "ch10"))
    assert "files 5 (+5 new, 0 modified, 0 early)" in ch01 and "tests ok" in ch01
    assert ch01.endswith("PASS")
    # ch02 brings extra.py and its main, drops ch01's main and test, changes core.py.
    assert "files 5 (+2 new, 1 modified, 0 early)" in ch02 and "no tests" in ch02
    assert "files 7 (+3 new, 1 modified, 0 early)" in ch10 and ch10.endswith("PASS")
    assert "3/3 chapters passed" in r.stdout and "introduced early: none" in r.stdout


def test_failing_main_fails_its_chapter(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo", **{"examples/ch02.py": "raise RuntimeError('boom')\n"})
    r = steps_cli(root, "check", "--no-tests")
    assert r.returncode == 1
    assert "FAIL: main exited 1" in line_of(r.stdout, "ch02")
    assert "RuntimeError: boom" in r.stdout and "failed: ch02" in r.stdout
    assert line_of(r.stdout, "ch01").endswith("PASS") and line_of(r.stdout, "ch10").endswith("PASS")
    only = steps_cli(root, "check", "--only", "ch01", "--no-tests")
    assert only.returncode == 0 and "ch02" not in only.stdout and "1/1 chapters" in only.stdout


def test_unbalanced_marker_is_reported(tmp_path: Path) -> None:
    broken = CORE.replace("# <<< ch02\n", "")
    root = make_repo(tmp_path / "repo", **{"minisgl/core.py": broken})
    r = steps_cli(root, "check")
    assert r.returncode == 2
    assert "minisgl/core.py:3: '# >>> ch02' is never closed" in r.stderr


def test_manifest_problems_are_all_reported(tmp_path: Path) -> None:
    root = make_repo(
        tmp_path / "repo",
        **{
            "minisgl/stray.py": "",
            "minisgl/extra.py": "EXTRA = 'extra'  # [ch02]\nX = 1  # [ch07]\n",
        },
    )
    manifest = (root / "tools/chapters.toml").read_text()
    manifest = manifest.replace('"minisgl/extra.py"]', '"minisgl/extra.py", "minisgl/gone.py"]')
    manifest = manifest.replace('tests = ["tests/test_core.py"]', 'tests = ["minisgl/core.py"]')
    (root / "tools/chapters.toml").write_text(manifest)
    r = steps_cli(root, "check")
    assert r.returncode == 2
    for problem in [
        "minisgl/core.py: listed twice (ch01 and ch01)",
        "minisgl/gone.py: listed by ch02 but does not exist",
        "minisgl/stray.py: not listed by any chapter",
        "minisgl/extra.py:1: marker for ch02 is pointless in a file that ch02 introduces",
        "minisgl/extra.py:2: marker names ch07, not in the manifest",
    ]:
        assert problem in r.stderr, r.stderr


def test_a_later_file_imported_early_is_counted(tmp_path: Path) -> None:
    main = "from minisgl.sub import later\nprint(later.LATER)\n"
    root = make_repo(tmp_path / "repo", **{"examples/ch01.py": main})
    r = steps_cli(root, "check", "--no-tests")
    assert r.returncode == 0, r.stdout
    # later.py and the package __init__.py above it both belong to ch10.
    assert "(+5 new, 0 modified, 2 early)" in line_of(r.stdout, "ch01")
    assert "ch01 <- minisgl/sub/later.py (ch10)" in r.stdout


def test_a_file_that_no_longer_parses_fails_its_chapter(tmp_path: Path) -> None:
    extra = "def f():\n    return 1  # [ch10]\n"
    root = make_repo(tmp_path / "repo", **{"minisgl/extra.py": extra})
    r = steps_cli(root, "check", "--no-tests")
    assert r.returncode == 1
    assert "FAIL: tree: minisgl/extra.py:1: stripped file does not parse" in line_of(
        r.stdout, "ch02"
    )


def test_tree_and_list(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    r = steps_cli(root, "tree", "ch02", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "  + minisgl/extra.py" in r.stdout and "  ~ minisgl/core.py" in r.stdout
    assert (tmp_path / "out/minisgl/core.py").read_text() == steps.strip(
        (root / "minisgl/core.py").read_text(), 2
    )
    assert not (tmp_path / "out/minisgl/sub").exists()
    again = steps_cli(root, "tree", "ch02", str(tmp_path / "out"))
    assert again.returncode == 2 and "not empty" in again.stderr
    listing = steps_cli(root, "list")
    assert listing.returncode == 0 and len(listing.stdout.splitlines()) == 3


def test_fences_counts_later_chapter_lines(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    # core.py: 13 lines, of which the ch02 region (9 lines, markers included; the ch10
    # region inside it counts once) and the tagged line.
    assert (10, 13, "minisgl/core.py") in steps.fences(root)
    cmd = [sys.executable, str(STEPS), "fences", "--root", str(root)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # Only files with later-chapter lines get a row; the total covers all 15 lines.
    assert r.stdout.splitlines() == ["   10    13  76.9% minisgl/core.py", "total 10/15 = 66.7%"]


def test_check_fails_over_the_fence_budget(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "repo")
    manifest = root / "tools/chapters.toml"
    manifest.write_text("fence_budget = 70\n" + MANIFEST)
    r = steps_cli(root, "check", "--no-tests")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "later-chapter lines: 10/15 = 66.67% of the package (budget 70%)" in r.stdout
    manifest.write_text("fence_budget = 60\n" + MANIFEST)
    r = steps_cli(root, "check", "--no-tests")
    assert r.returncode == 1 and "3/3 chapters passed" in r.stdout, r.stdout + r.stderr
    assert "FAIL: later-chapter lines are 66.67% of the package, over the manifest's" in r.stdout
    assert "fence_budget of 60%" in r.stdout and "(most: minisgl/core.py 10" in r.stdout


# ---- the chapter texts ---------------------------------------------------------------------

DOCS = {
    "docs/README.md": "[Core](ch01.md), [Extra](ch02.md), [Later](ch10.md)\n",
    "docs/ch01.md": """
        # Core
        New (the tree has 5 files: 5 new, 0 modified):

        <!-- example output -->
        ```
        ch01: extra is out of reach
        ```
    """,
    "docs/ch02.md": """
        The tree has its helper (the tree has 5 files: 1 new in the package, 1 changed).

        <!-- example output; vary: "took" -->
        ```
        ch02: extra
        ```
    """,
    "docs/ch10.md": """
        (the tree has 7 files)

        <!-- example output -->
        ```
        ...
        ch10: extra+later
        ```
    """,
}


def docs_repo(root: Path, **changes: str) -> Path:
    root = make_repo(root, **{**DOCS, **changes})
    manifest = root / "tools/chapters.toml"
    manifest.write_text('docs = "docs"\n' + manifest.read_text())
    return root


def test_the_texts_pass_when_they_say_what_is_so(tmp_path: Path) -> None:
    r = steps_cli(docs_repo(tmp_path / "repo"), "check", "--no-tests")
    assert r.returncode == 0, r.stdout + r.stderr
    assert all("refs ok  docs ok" in line_of(r.stdout, c) for c in ("ch01", "ch02", "ch10"))


def test_a_text_that_is_wrong_fails_its_chapter(tmp_path: Path) -> None:
    ch01 = DOCS["docs/ch01.md"].replace("5 new, 0 modified", "4 new, 0 modified")
    ch02 = DOCS["docs/ch02.md"].replace("ch02: extra", "ch02: extras")
    root = docs_repo(
        tmp_path / "repo",
        **{
            "docs/ch01.md": ch01,
            "docs/ch02.md": ch02,
            "docs/README.md": DOCS["docs/README.md"].replace("(ch10.md)", ""),
        },
    )
    r = steps_cli(root, "check", "--no-tests")
    assert r.returncode == 1
    assert "FAIL: docs: docs/ch01.md:2: says 4 new; the tree has 5" in line_of(r.stdout, "ch01")
    assert "docs/ch02.md:5: quotes 'ch02: extras'; the example printed 'ch02: extra'" in r.stdout
    assert "FAIL: docs: docs/README.md links no (ch10.md)" in line_of(r.stdout, "ch10")
    (root / "docs/ch10.md").unlink()
    r = steps_cli(root, "check", "--no-tests", "--only", "ch10")
    assert "FAIL: docs: docs/ch10.md: the chapter's text is missing" in line_of(r.stdout, "ch10")


def test_a_tree_that_names_a_later_chapter_fails(tmp_path: Path) -> None:
    # ch01's core.py names chapter 10 in a comment and reads `added`, which only ch02 defines.
    core = CORE.replace("def base():", "def base():  # see chapter 10\n    _ = NAMES.added_late")
    core += "NAMES.added_late = 1  # [ch02]\n"
    root = make_repo(tmp_path / "repo", **{"minisgl/core.py": core})
    r = steps_cli(root, "check", "--no-tests", "--only", "ch01")
    assert r.returncode == 1
    ch01 = line_of(r.stdout, "ch01")
    assert (
        "refs FAILED" in ch01 and "minisgl/core.py:1: names chapter 10, which comes later" in ch01
    )
    assert "minisgl/core.py:2: `added_late` is first defined by ch02" in r.stdout


def test_quotes_match_line_for_line_with_varying_lines_by_shape() -> None:
    texts = steps.texts
    doc = '<!-- example output; vary: "took" -->\n```\nstart\ntook 1.5s, pid 301\n...\nend\n```\n'
    [quote] = texts.quotes(doc)
    assert quote.line == 3 and quote.vary == ("took",)
    assert texts.quote_problems("d.md", [quote], "start\ntook 12.25s, pid 7\na\nb\nend\n") == []
    assert texts.quote_problems("d.md", [quote], "start\ntook 1.5s, pid 301\nend\n") == []
    assert texts.quote_problems("d.md", [quote], "start\ntook 1.5s, uid 301\nend\n") == [
        "d.md:4: quotes 'took 1.5s, pid 301'; the example printed 'took 1.5s, uid 301'"
    ]
    assert texts.quote_problems("d.md", [quote], "start\ntook 2s, pid 3\nen\n") == [
        "d.md:6: the example printed no line 'end' here"
    ]
    [loose] = texts.quotes('<!-- example output; vary: "op *" -->\n```\nop mm 5.1\nend\n```\n')
    assert texts.quote_problems("d.md", [loose], "op index_select\nend\n") == []
    assert texts.quote_problems("d.md", [loose], "mm\nend\n") == [
        "d.md:3: quotes 'op mm 5.1'; the example printed 'mm'"
    ]
    exact = texts.quotes("<!-- example output -->\n```\nstart\n```\n")
    assert texts.quote_problems("d.md", exact, "start\nmore\n") == [
        "d.md:4: the quote ends; the example printed 'more' next"
    ]
    assert texts.quote_problems("d.md", exact, "Start\n") == [
        "d.md:3: quotes 'start'; the example printed 'Start'"
    ]


def test_this_course_states_its_trees_as_they_are() -> None:
    """The facts `steps.py check` holds every chapter of this repo to that need no run."""
    root = STEPS.parent.parent
    m = steps.Manifest.load(root, root / "tools/chapters.toml")
    trees = [steps.build(m, i) for i in range(len(m.chapters))]
    first = steps.first_definitions(m, trees)
    problems = []
    for i, ch in enumerate(m.chapters):
        problems += steps.doc_problems(m, i, trees)[0]
        problems += steps.texts.later_references(trees[i].files, ch.num, first, ch.main)
    assert not problems, "\n".join(problems)


def test_counts_are_rewritten_to_the_trees_numbers() -> None:
    texts = steps.texts
    counts = texts.Counts(files=76, new=3, modified=7, new_in_package=1)
    text = "(the tree has 75 files: 2 new in the package, 6 changed)\nand (the tree has 9 files)"
    fixed = texts.fix_counts(text, counts)
    assert (
        fixed
        == "(the tree has 76 files: 1 new in the package, 7 changed)\nand (the tree has 76 files)"
    )
    assert texts.count_problems("d.md", fixed, counts) == []
    assert texts.count_problems("d.md", "(the tree has 76 files: 4 new, 7 modified)", counts) == [
        "d.md:1: says 4 new; the tree has 3 (76 files: 3 new (1 in the package), 7 modified; "
        "`python tools/steps.py counts --write` puts the tree's numbers in)"
    ]
