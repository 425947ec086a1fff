"""Where the tests find Kimi's vocabulary (read from ../shared/, never committed), and the mark
that skips a test module without it."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "kimi-tokenizer"
needs_vocabulary = pytest.mark.skipif(
    not (SHARED / "tiktoken.model").is_file(),
    reason=f"the Kimi vocabulary is not at {SHARED} (it is read from ../shared/, never committed)",
)
