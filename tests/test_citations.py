"""What the repository ships cites only what ships with it (issue 28).

Docs, the README, the benches, the examples, the MLflow projects and the package's code, docstrings
and strings may cite ``docs/*.md`` and papers, never a file outside the repository: a team folder
beside the checkout (``../shared/``, its ``METRICS.md`` and ``STYLE.md``) or an absolute path of a
development machine (``/work/``) is a broken link for every user. The one exception is the README's
data paths (``../shared/data``: where the data folder lives, data rather than a citation). Pure
file reads, no process.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: What is scanned, as globs under the repository root.
SCANNED = ("README.md", "MLproject", "docs/*.md", "bench/**/*", "examples/**/*", "projects/**/*",
           "mlflow_llmeff/**/*")

#: What no scanned line may hold, and why.
FORBIDDEN = (
    (re.compile(r"\.\./shared/"), "a folder outside the repository"),
    (re.compile(r"/work/"), "an absolute path of a development machine"),
    (re.compile(r"\b(?:METRICS|STYLE)\.md\b"), "a team file outside the repository"),
)

#: The explicit exceptions: file -> substrings removed from its lines before the check.
ALLOWED = {"README.md": ("../shared/data",)}  # the data folder's place beside a checkout


def offending_lines(files: dict[str, str]) -> list[str]:
    """``file:line: why: text`` for every line of ``files`` (relative path -> text) that cites outside."""
    out = []
    for rel, text in files.items():
        for no, line in enumerate(text.splitlines(), 1):
            checked = line
            for allowed in ALLOWED.get(rel, ()):
                checked = checked.replace(allowed, "")
            out += [f"{rel}:{no}: {why}: {line.strip()}" for pat, why in FORBIDDEN if pat.search(checked)]
    return out


def shipped_files() -> dict[str, str]:
    """Relative path -> text of every scanned text file (``__pycache__`` and binary files left out)."""
    files = {}
    for pattern in SCANNED:
        for path in sorted(ROOT.glob(pattern)):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            files[path.relative_to(ROOT).as_posix()] = text
    return files


def test_the_scanner_names_file_and_line():
    files = {"docs/x.md": "ok line\nthe standard is `../shared/METRICS.md`\n",
             "mlflow_llmeff/m.py": '"""See METRICS.md, "Counting rules"."""\nx = 1  # /work/main/docs\n',
             "README.md": "llmeff train --dataset ../shared/data/corpus/t.txt\nsee ../shared/STYLE.md\n",
             "docs/y.md": "data in ../shared/data\nsee docs/metrics.md\n"}
    assert offending_lines(files) == [
        "docs/x.md:2: a folder outside the repository: the standard is `../shared/METRICS.md`",
        "docs/x.md:2: a team file outside the repository: the standard is `../shared/METRICS.md`",
        'mlflow_llmeff/m.py:1: a team file outside the repository: """See METRICS.md, "Counting rules"."""',
        "mlflow_llmeff/m.py:2: an absolute path of a development machine: x = 1  # /work/main/docs",
        "README.md:2: a folder outside the repository: see ../shared/STYLE.md",
        "README.md:2: a team file outside the repository: see ../shared/STYLE.md",
        # the data folder is allowed in the README only
        "docs/y.md:1: a folder outside the repository: data in ../shared/data",
    ]


def test_shipped_files_cite_nothing_outside_the_repository():
    files = shipped_files()
    # the scan reaches what it is meant to (a glob that matched nothing would pass vacuously)
    for rel in ("README.md", "docs/formulas.md", "docs/metrics.md", "bench/stability.py",
                "examples/plain_pytorch.py", "mlflow_llmeff/names.py", "mlflow_llmeff/calc/stability.py"):
        assert rel in files, rel
    bad = offending_lines(files)
    assert not bad, "cite docs/*.md or the paper instead:\n" + "\n".join(bad)


def test_cited_docs_pages_exist():
    files = shipped_files()
    cited = {(rel, m) for rel, text in files.items() for m in re.findall(r"\bdocs/[A-Za-z0-9_]+\.md", text)}
    assert {m for _, m in cited} >= {"docs/formulas.md", "docs/stability.md", "docs/time.md"}
    missing = sorted(f"{rel}: {m}" for rel, m in cited if not (ROOT / m).is_file())
    assert not missing, missing
