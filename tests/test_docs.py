"""The Python examples in README.md and docs/ must run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "optimize.md", ROOT / "docs" / "training.md", ROOT / "docs" / "runtime.md",
        ROOT / "docs" / "quantization.md", ROOT / "docs" / "llm.md"]


def blocks():
    from torchkiln.quantization import pt2e_flow

    # an example of a CPU int8 graph scheme needs torchao's pt2e flow (torchao 0.10, with torch 2.6, has none)
    no_pt2e = pytest.mark.skipif(pt2e_flow.missing() is not None, reason="no pt2e flow in this torchao")
    for doc in DOCS:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)):
            pt2e = re.search(r"int8-(static|dynamic|smoothquant)", code)
            yield pytest.param(code, id=f"{doc.name}-{i}", marks=[no_pt2e] if pt2e else [])


@pytest.mark.parametrize("code", list(blocks()))
def test_example_runs(code):
    exec(compile(code, "<doc>", "exec"), {})
