"""The Python examples in README.md and docs/ must run as written."""

import re
from pathlib import Path

import needs
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "optimize.md", ROOT / "docs" / "training.md", ROOT / "docs" / "runtime.md",
        ROOT / "docs" / "quantization.md", ROOT / "docs" / "llm.md"]


def blocks():
    for doc in DOCS:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)):
            pt2e = re.search(r"int8-(static|dynamic|smoothquant)", code)  # a CPU int8 graph scheme
            yield pytest.param(code, id=f"{doc.name}-{i}", marks=[needs.pt2e] if pt2e else [])


@pytest.mark.parametrize("code", list(blocks()))
def test_example_runs(code):
    exec(compile(code, "<doc>", "exec"), {})
