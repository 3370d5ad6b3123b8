"""The docs' worked examples run as written (each page's python blocks, in order, in a fresh process)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


@pytest.mark.slow  # trains a model for 300 steps (CI runs the slow tier in its own step)
def test_own_model_page_trains_saves_restores_and_decodes(tmp_path):
    blocks = _python_blocks(ROOT / "docs" / "site" / "own-model.md")
    assert len(blocks) == 4, "the page's four steps: model, training, orbax, decoding"
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(blocks)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("loss after 300 steps: ")
    decoded, counted = (line.split(": ", 1)[1] for line in lines[-2:])
    assert decoded == counted, "the model learned to count and decoding continues the sequence"
