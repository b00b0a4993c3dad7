"""The architecture's file tree matches the checkout (issue #16).

The tree is the fenced block under ``## Files`` in docs/architecture.md
(README's "## Architecture" section until issue #40 moved it there). In it a
folder line (``name/``) opens a folder; the entries under it are indented by
two more spaces and start with the names they describe (``a.py, b.py``,
``sub/``, shell-style patterns such as ``*.sh``), then, after a gap of two or
more spaces, a description, which may run on over deeper-indented
continuation lines. This test holds the block to
the checkout: every Python module and package of the described folders is
named in its folder's part of the block, and every name there exists.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
HEADING = "\n## Files\n"  # the section of DOC that holds the block
CONTINUATION_INDENT = 16  # description lines sit in the description column, entries well left of it
UNDESCRIBED = ("tests",)  # folders the block sums up in words (their files are tests, not architecture)
ENTRY = re.compile(r"\s*([\w.*/-]+(?:, [\w.*/-]+)*)(?:\s|$)")  # "a.py, sub/" before the description
FILE_TOKEN = re.compile(r"[\w*]+\.py\b")


def architecture_block(readme: str) -> list[str]:
    section = readme.split(HEADING, 1)[1]
    block = section.split("```\n", 2)[1]
    return [line for line in block.splitlines() if line.strip() and not line.strip().startswith("---")]


def parse(lines: list[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(names, mentions): per folder (a repository path), the names its entries
    start with, and every ``*.py`` token in its entries' text."""
    names: dict[str, set[str]] = {}
    mentions: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []  # (indent of the folder line, folder path)
    current = None  # folder the last entry belongs to
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if indent >= CONTINUATION_INDENT:
            mentions.setdefault(current, set()).update(FILE_TOKEN.findall(line))
            continue
        match = ENTRY.match(line)
        assert match, f"docs/architecture.md: cannot read the names of {line!r}"
        entry = match.group(1).split(", ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        current = parent
        names.setdefault(parent, set()).update(entry)
        mentions.setdefault(parent, set()).update(FILE_TOKEN.findall(line))
        folders = [n for n in entry if n.endswith("/")]
        if len(folders) == 1 and len(entry) == 1:  # a folder line opens that folder
            path = f"{parent}/{folders[0][:-1]}".lstrip("/")
            stack.append((indent, path))
            current = path
            names.setdefault(path, set())
    return names, mentions


def python_children(folder: Path) -> tuple[list[str], list[str]]:
    """(modules, packages) directly in ``folder``: .py files other than
    __init__ / __main__, and subfolders holding .py files."""
    modules = sorted(p.name for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    packages = sorted(p.name for p in folder.iterdir() if p.is_dir() and any(p.rglob("*.py"))
                      and p.name != "__pycache__")
    return modules, packages


def covered(name: str, patterns: set[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def problems(readme: str, root: Path = ROOT) -> list[str]:
    names, mentions = parse(architecture_block(readme))
    out = []
    for folder, listed in names.items():
        if not folder:
            continue
        path = root / folder
        if not path.is_dir():
            out.append(f"{folder}/ is in the architecture doc but not in the checkout")
            continue
        for name in sorted(listed):
            if not any(path.glob(name.rstrip("/"))):
                out.append(f"{folder}/{name} is in the architecture doc but not in the checkout")
        if folder.split("/")[0] in UNDESCRIBED:
            continue
        modules, packages = python_children(path)
        patterns = listed | mentions.get(folder, set())
        out += [f"{folder}/{m} is not in the architecture doc" for m in modules if not covered(m, patterns)]
        out += [f"{folder}/{p}/ is not in the architecture doc" for p in packages if f"{p}/" not in listed]
    for top in ("kernels", "spec_plugins", "ci"):
        if top not in names:
            out.append(f"{top}/ is not in the architecture doc")
    return out


def test_readme_architecture_matches_the_files():
    found = problems(DOC.read_text())
    assert not found, "docs/architecture.md vs the checkout:\n" + "\n".join(found)


SAMPLE = """# x

## Files

```
kernels/               the package
  a.py, b.py           two modules
  sub/                 a subpackage
    c.py                   one module, and the tools:
                           *_tool.py
spec_plugins/          (empty here)
ci/                    (empty here)
```
"""


def test_the_check_finds_missing_and_stale_names(tmp_path):
    for name in ("kernels/a.py", "kernels/b.py", "kernels/__init__.py", "kernels/sub/c.py", "kernels/sub/x_tool.py",
                 "kernels/sub/y_tool.py", "spec_plugins/", "ci/"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if name.endswith("/") else path.write_text("")
    assert problems(SAMPLE, tmp_path) == []
    (tmp_path / "kernels" / "new.py").write_text("")
    (tmp_path / "kernels" / "b.py").unlink()
    (tmp_path / "kernels" / "pkg2").mkdir()
    (tmp_path / "kernels" / "pkg2" / "m.py").write_text("")
    (tmp_path / "kernels" / "sub" / "d.py").write_text("")
    assert problems(SAMPLE, tmp_path) == [
        "kernels/b.py is in the architecture doc but not in the checkout",
        "kernels/new.py is not in the architecture doc",
        "kernels/pkg2/ is not in the architecture doc",
        "kernels/sub/d.py is not in the architecture doc",
    ]
