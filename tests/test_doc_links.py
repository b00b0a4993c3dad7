"""Every relative link in README.md and docs/*.md resolves (issue #40).

A link ``[text](target)`` outside code (fenced blocks and inline code) whose
target is not a URL must name an existing file or folder, relative to the
file it is in; ``target#anchor`` (or ``#anchor`` alone) must also name a
heading of that Markdown file, by GitHub's anchor rule: the heading's text,
lower-cased, inline code marks and punctuation other than ``-`` and ``_``
dropped, spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ...
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)\)")  # [text](target); images (![...]) aside
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code."""
    return [(number, m[1]) for number, line in prose_lines(text) for m in LINK.finditer(INLINE_CODE.sub("", line))]


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m[2])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def problems(files: list[Path], root: Path = ROOT) -> list[str]:
    out = []
    for path in files:
        where = path.relative_to(root)
        for number, target in links(path.read_text()):
            if EXTERNAL.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                out.append(f"{where}:{number}: {target}: no such file")
                continue
            if anchor:
                if dest.suffix != ".md" or dest.is_dir():
                    out.append(f"{where}:{number}: {target}: an anchor into a file that is not Markdown")
                elif anchor not in anchors(dest.read_text()):
                    out.append(f"{where}:{number}: {target}: no heading #{anchor} in {dest.name}")
    return out


def test_every_relative_link_in_readme_and_docs_resolves():
    files = doc_files()
    assert len(files) >= 5 and all(p.is_file() for p in files), files  # README and the docs exist
    assert sum(len(links(p.read_text())) for p in files) >= 20, "the check found (almost) no links"
    found = problems(files)
    assert not found, "links that do not resolve:\n" + "\n".join(found)


def test_slugs_follow_githubs_rule():
    assert slug("The main job: `bash ci/main_job.sh`") == "the-main-job-bash-cimain_jobsh"
    assert slug("In vLLM (`spec_plugins/vllm_ext/`)") == "in-vllm-spec_pluginsvllm_ext"
    assert slug("Earlier: the heads before #15") == "earlier-the-heads-before-15"
    assert anchors("# A\n## A\n```\n# B\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_the_check_finds_bad_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "results" / "run1").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some part: `x`\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "# R\n"
        "[ok](docs/a.md) [ok anchor](docs/a.md#some-part-x) [ok folder](results/run1) [own](#r)\n"
        "[web](https://example.com/x#y) `[in code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[missing](docs/b.md)\n"
        "[bad anchor](docs/a.md#no-such-part)\n"
        "[bad own anchor](#nothing)\n")
    (tmp_path / "docs" / "c.md").write_text("[up](../README.md#r) [gone](../results/run2)\n")
    assert problems(doc_files(tmp_path), tmp_path) == [
        "README.md:7: docs/b.md: no such file",
        "README.md:8: docs/a.md#no-such-part: no heading #no-such-part in a.md",
        "README.md:9: #nothing: no heading #nothing in README.md",
        "docs/c.md:1: ../results/run2: no such file",
    ]
