"""What a user reads (exception messages, command-line help and descriptions,
printed and logged lines) names options and values, never this project's issue
tracker: "issue #51" tells a user of the package nothing. Read from the source
with ``ast`` (no engine needed), over the package and the kernel module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "spec_plugins", ROOT / "kernels"]
TRACKER = re.compile(r"#\d+|\bissues?\s+#?\d+", re.IGNORECASE)
TEXT_KEYWORDS = {"help", "description", "epilog", "usage", "msg", "message"}
TEXT_CALLS = {"print", "warn", "warning", "error", "info", "exception", "critical", "exit", "fail"}


def texts(node: ast.AST, module_doc: str | None):
    """The literal text in an expression: constants, f-string parts, ``__doc__``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value
        elif isinstance(sub, ast.Name) and sub.id == "__doc__" and module_doc:
            yield module_doc


def user_texts(path: Path):
    """(line, text) of every user-facing text in a source file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    doc = ast.get_docstring(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            parts = [node.exc]
        elif isinstance(node, ast.keyword) and node.arg in TEXT_KEYWORDS:
            parts = [node.value]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in TEXT_CALLS:
            parts = node.args
        else:
            continue
        for part in parts:
            for text in texts(part, doc):
                yield node.lineno, text


def tracker_references(paths) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {TRACKER.search(text)[0]!r} in {text[:120]!r}"
            for path in paths for line, text in user_texts(path) if TRACKER.search(text)]


def test_no_user_facing_text_cites_an_issue_number():
    paths = [p for src in SOURCES for p in sorted(src.rglob("*.py"))]
    assert len(paths) > 50
    found = tracker_references(paths)
    assert found == [], "\n".join(found)


def test_the_check_finds_a_cited_issue(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""A tool (issue #7)."""\nimport argparse\n'
                   'def f(x):\n    raise ValueError(f"x={x!r} is served on V1 only (issue #51)")\n'
                   'argparse.ArgumentParser(description=__doc__).add_argument("--a", help="see #15")\n')
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert len(tracker_references([bad])) == 3
    finally:
        ROOT = saved
