"""scripts/check_docs_commands.py: which documented commands it finds and skips (the
conventions in its docstring), and a quick subset of the real docs run through it: a data
command and a server started, found healthy and stopped. The full run is documented in the
README, not run here."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def docs_check():
    spec = importlib.util.spec_from_file_location(
        "check_docs_commands", ROOT / "scripts" / "check_docs_commands.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


DOC = """# Title

```bash
latentserve data multiplication --k 4 \\
    --n 10 --out a.txt   # a comment
pip install something
latentserve serve --port 8123 &
latentserve generate --prompt "What is # this?" --max-tokens 4  # skip: why not
python -m benchmarks.detok
latentserve train cot --data a.txt --out x --device cuda
latentserve demo [--num-questions 4] [--models-dir models [--x "[y]"]]
pip install -q -e . && latentserve demo --max-tokens 8
latentserve serve --model PATH
latentserve train cot --mode nocot ...
python -m benchmarks.head_gpu --tiny /tmp/h.json
```

<!-- skip: needs upstream checkpoints -->
```
latentserve convert coconut --base gpt2-dir --checkpoint c --out o
```
"""


def test_commands_and_skips_are_found(docs_check, tmp_path):
    md = tmp_path / "doc.md"
    md.write_text(DOC)
    got = [(c.line, c.text, c.skip, c.background) for c in docs_check.extract(md)]
    assert got == [
        (4, "latentserve data multiplication --k 4 --n 10 --out a.txt", None, False),
        (7, "latentserve serve --port 8123", None, True),
        (8, 'latentserve generate --prompt "What is # this?" --max-tokens 4', "why not",
         False),
        (9, "python -m benchmarks.detok", None, False),
        (10, "latentserve train cot --data a.txt --out x --device cuda", "gpu", False),
        (11, "latentserve demo", None, False),  # a usage line runs without [options]
        (12, "latentserve demo --max-tokens 8", None, False),  # the part after &&
        (13, "latentserve serve --model PATH", "placeholder", False),
        (14, "latentserve train cot --mode nocot ...", "placeholder", False),
        (15, "python -m benchmarks.head_gpu --tiny /tmp/h.json", None, False),
        (20, "latentserve convert coconut --base gpt2-dir --checkpoint c --out o",
         "needs upstream checkpoints", False),
    ]


def test_a_quick_subset_of_the_real_docs_runs(docs_check):
    lines = []
    results = docs_check.check([ROOT / "docs" / "training.md"], timeout=240,
                               match="--n 8000", report=lines.append)
    results += docs_check.check([ROOT / "docs" / "training.md"], timeout=240,
                                match="serve --port 8123", report=lines.append)
    assert [(r.command.text, r.status) for r in results] == [
        ("latentserve data multiplication --k 4 --n 8000 --out 4x4_train.txt", "ok"),
        ("latentserve serve --port 8123 --max-model-len 1024", "ok"),
    ], "\n".join(lines)
