"""tools/figures.py: every picture it draws is committed and shown in its chapter, the
pictures that need no model draw from this chapter's code, and chapter 29's run of a tiny
random model reached the state its picture claims (the ones that run SmolLM2 are drawn by
`python tools/figures.py`, a few seconds each, and not here)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import figures  # noqa: E402

FIGURES = ROOT / "docs" / "figures"


def test_every_figure_is_committed_and_shown_in_its_chapter() -> None:
    drawn = sorted(FIGURES.glob("*.svg"))
    assert {p.name.split("_")[0] for p in drawn} == set(figures.FIGURES), drawn
    for path in drawn:
        [chapter] = ROOT.glob(f"docs/{path.name.split('_')[0]}_*.md")
        assert f"](figures/{path.name})" in chapter.read_text(), f"{chapter} does not show {path}"


def test_the_pictures_without_a_model_draw_the_state_they_reached(tmp_path: Path) -> None:
    pool = figures.ch03_pool(tmp_path).read_text()
    # Request A's third page is page 5, after B's three: its row jumps from slot 7 to 20.
    assert "page 5" in pool and "page 8" in pool and "dummy" in pool
    assert ">20<" in pool and ">23<" in pool
    mask = figures.ch04_mask(tmp_path).read_text()
    assert "request B: 6 cached + 4 new" in mask and "q at 9" in mask


def test_the_mask_is_the_causal_triangle_shifted_by_the_cached_prefix() -> None:
    weights, reqs = figures.attention_weights()
    first = 0
    for req in reqs:
        for j in range(req.extend_len):
            seen = (weights[first + j, : req.device_len] > 0).tolist()
            assert seen == [key <= req.cached_len + j for key in range(req.device_len)]
        first += req.extend_len


def test_the_windowed_run_keeps_a_window_of_pages_while_the_full_pages_grow() -> None:
    """What the chapter 29 picture claims, from the run it draws: every full page a token
    needs is in use, each running request holds at most the pages over its window (and one
    more where the newest straddles), and everything is given back at the end."""
    layout, ps, window_pages, steps = figures.windowed_run()
    assert [len(g.layers) for g in layout.groups] == [4, 1] and len(layout.shared) == 5
    assert layout.window == 8 and window_pages >= 2 * (8 // ps + 2)
    for step in steps[2:-1]:  # after the prompt's two chunks, before the end
        tokens = step["tokens"].values()
        assert step["full"] == sum(-(-t // ps) for t in tokens)
        assert step["windowed"] <= len(tokens) * (8 // ps + 1)
    assert max(s["full"] for s in steps) > 3 * max(s["windowed"] for s in steps)
    assert steps[-1] == {"full": 0, "windowed": 0, "tokens": {}}
