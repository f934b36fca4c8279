"""Grids' class labels in scripts Pillow's default font lacks: the font that has them is found, or a warning says
which characters show as boxes and how to get a font that has them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from fastddpm import grid as grid_module
from fastddpm.grid import label_font_file, label_rows

CAT = "\u732b"  # 猫, "cat": no glyph in DejaVu Sans, nor in Pillow's default font


def _font_with_a_glyph_for(ch: str, path) -> str:
    """A TrueType font of one glyph (a filled square) mapped to `ch`, as a CJK font on a user's machine has."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    def square(size: int):
        pen = TTGlyphPen(None)
        if size:
            pen.moveTo((100, 0)), pen.lineTo((100, size)), pen.lineTo((100 + size, size)), pen.lineTo((100 + size, 0))
            pen.closePath()
        return pen.glyph()

    fb = FontBuilder(1000, isTTF=True)
    fb.setupGlyphOrder([".notdef", "glyph"])
    fb.setupCharacterMap({ord(ch): "glyph"})
    fb.setupGlyf({".notdef": square(0), "glyph": square(800)})
    fb.setupHorizontalMetrics({".notdef": (1000, 0), "glyph": (1000, 100)})
    fb.setupHorizontalHeader(ascent=900, descent=-100)
    fb.setupNameTable({"familyName": "TestCJK", "styleName": "Regular"})
    fb.setupOS2(sTypoAscender=900, usWinAscent=900, usWinDescent=100)
    fb.setupPost()
    fb.save(str(path))
    return str(path)


@pytest.fixture
def fresh_lookup():
    label_font_file.cache_clear()
    yield
    label_font_file.cache_clear()


def _strip(text: str) -> np.ndarray:
    return label_rows(np.zeros((30, 30, 3), dtype=np.uint8), [text], row_pitch=30, first_row=0)


def test_a_class_name_in_a_script_dejavu_lacks_is_drawn_in_a_font_that_has_it(tmp_path, monkeypatch, fresh_lookup):
    """A class named in Chinese was drawn as boxes whatever fonts the machine had."""
    monkeypatch.setattr(grid_module.shutil, "which", lambda name: None)  # no fontconfig: the known places
    monkeypatch.setattr(grid_module, "KNOWN_FONT_FILES", ())
    with pytest.warns(UserWarning):
        boxes = _strip(CAT)  # no font has it: the box
    label_font_file.cache_clear()
    font = _font_with_a_glyph_for(CAT, tmp_path / "cjk.ttf")
    monkeypatch.setattr(grid_module, "KNOWN_FONT_FILES", ("/nowhere/font.ttc", str(tmp_path / "bad.ttf"), font))
    (tmp_path / "bad.ttf").write_bytes(b"not a font")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert label_font_file(frozenset(CAT)) == font
        drawn = _strip(CAT)
    assert not np.array_equal(drawn, boxes)
    # the square glyph is drawn: a solid block of dark pixels in the label strip
    assert (drawn[:, :, 0] < 128).sum() > 50
    # Latin, Greek and Cyrillic stay in DejaVu Sans, without a search
    assert label_font_file(frozenset("Ünïβж")).endswith("DejaVuSans.ttf")


def test_class_names_no_font_here_has_are_named_in_a_warning_with_the_fix(monkeypatch, fresh_lookup):
    monkeypatch.setattr(grid_module.shutil, "which", lambda name: None)
    monkeypatch.setattr(grid_module, "KNOWN_FONT_FILES", ())
    with pytest.warns(UserWarning, match=f"no font on this machine has the characters '{CAT}' of the class names: "
                                         "the grid's labels show them as boxes; install a font that has them "
                                         r"\(CJK: fonts-noto-cjk"):
        assert label_font_file(frozenset("Ab" + CAT)).endswith("DejaVuSans.ttf")
