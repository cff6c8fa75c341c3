"""Every ```python block of README.md and docs/*.md runs as written, in a scratch folder (a block
that writes files leaves none in the repository). A block whose first line starts with
``# continues`` runs after the blocks before it in the same document, in their namespace (a
document's walk through one RL step); a program whose first block starts with ``# needs CUDA``
runs where CUDA is present. The blocks run in this process: each would spend seconds importing
Megatron-Core in a fresh one."""
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
CONTINUES = "# continues"
NEEDS_CUDA = "# needs CUDA"


def programs():
    """Per program (a block and the blocks that continue it): its id, doc:line, and its blocks."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            code, line = match.group(1), text.count("\n", 0, match.start()) + 2  # the block's first line
            where = f"{doc.relative_to(ROOT)}:{line}"
            if code.startswith(CONTINUES):
                assert found and found[-1][0].startswith(str(doc.relative_to(ROOT))), f"{where}: nothing to continue"
                found[-1][1].append((where, code))
            else:
                found.append((where, [(where, code)]))
    return found


def test_the_docs_have_python_blocks():
    assert sum(len(blocks) for _, blocks in programs()) >= 15


@pytest.mark.parametrize("blocks", [pytest.param(blocks, id=where) for where, blocks in programs()])
def test_python_blocks_run(blocks, tmp_path, monkeypatch, capsys):
    if blocks[0][1].startswith(NEEDS_CUDA) and not torch.cuda.is_available():
        pytest.skip("the blocks need CUDA")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for where, code in blocks:
        exec(compile(code, where, "exec"), namespace)
    assert capsys.readouterr().out, "the example prints nothing: print what its comments show"
