"""SGLang code keyed on the literal names EAGLE / EAGLE3, against the list of
what each site means for EAGLE_TREE (``spec_plugins.sglang_ext.name_keyed_features``;
issue 36, item 6).

The scan reads every ``.py`` file under SGLang 0.5.23's installed ``srt``
folder with ``ast`` (no import). A site: a string constant whose value,
upper-cased, is EAGLE or EAGLE3 (docstrings excepted), or an attribute named
EAGLE or EAGLE3; keyed by (file under ``srt``, the enclosing ``Class.def``,
or at module level the assigned name, else ``<module>``). Calls of
``is_eagle()`` / ``is_eagle3()`` are not sites: EAGLE_TREE answers them.
Runs in ``.venv-sglang`` (``TRITON_INTERPRET=1``); faked: ``torchvision``
(``spec_plugins.sglang_ext._testing``).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing, config  # noqa: E402
from spec_plugins.sglang_ext import name_keyed_features as nkf  # noqa: E402
from spec_plugins.sglang_ext.algorithm import EagleTreeSpecAlgo  # noqa: E402

pytestmark = pytest.mark.sglang

ALGORITHM_NAMES = {"EAGLE", "EAGLE3"}


def sglang_srt_root() -> Path:
    return Path(importlib.util.find_spec("sglang").origin).parent / "srt"


def docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip


def is_name_literal(node: ast.AST, skipped: set[int]) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in ALGORITHM_NAMES
    return (
        isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.upper() in ALGORITHM_NAMES
        and id(node) not in skipped
    )  # fmt: skip


def name_keyed_sites(root: Path) -> dict[tuple[str, str], list[int]]:
    """(file, scope) -> line numbers of the name literals there."""
    sites: dict[tuple[str, str], list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped, file = docstrings(tree), path.relative_to(root).as_posix()

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{scope}.{child.name}" if scope else child.name
                elif not scope and isinstance(child, (ast.Assign, ast.AnnAssign)):
                    targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                    inner = ",".join(ast.unparse(target) for target in targets)
                if is_name_literal(child, skipped):
                    sites.setdefault((file, inner or "<module>"), []).append(child.lineno)
                visit(child, inner)

        visit(tree, "")
    return sites


def test_every_name_keyed_site_in_sglang_is_listed():
    found = name_keyed_sites(sglang_srt_root())
    listed = [(site.file, site.scope) for site in nkf.SITES]
    assert len(listed) == len(set(listed)), "a site is listed twice"
    unlisted = sorted(set(found) - set(listed))
    stale = sorted(set(listed) - set(found))
    assert not unlisted and not stale, (
        "SGLang's code keyed on EAGLE / EAGLE3 differs from name_keyed_features.SITES:\n"
        + "".join(f"  not listed: {file} {scope} (lines {found[(file, scope)]})\n" for file, scope in unlisted)
        + "".join(f"  stale entry: {file} {scope}\n" for file, scope in stale)
    )


def test_every_listed_feature_has_a_verdict_for_eagle_tree():
    for site in nkf.SITES:
        assert site.features, site
        for feature in site.features:
            assert feature.verdict in nkf.VERDICTS and feature.note, (site.scope, feature)
            assert (feature.refusal is not None) == (feature.verdict == nkf.REFUSED), (site.scope, feature)
            if site.file == "speculative/spec_info.py" and feature.verdict == nkf.GETS:
                method = site.scope.split(".")[-1]
                assert method in vars(EagleTreeSpecAlgo), f"EagleTreeSpecAlgo does not override {method}"


# The server arguments that turn each refused option on (with the tiny checkpoints).
REFUSED_OPTION_ARGS = {
    "--speculative-adaptive": {"speculative_adaptive": True},
    "--pp-size": {"pp_size": 2},
    "--enable-unified-memory": {"enable_unified_memory": True},
    "--enable-attn-tp-input-scattered": {"enable_attn_tp_input_scattered": True, "tp_size": 2},
    "--enable-amd-monokernel": {"enable_amd_monokernel": True},
}


def test_every_refusal_has_a_startup_case():
    assert sorted(REFUSED_OPTION_ARGS) == sorted(f.refusal.option for f in nkf.refused_features())


@pytest.mark.parametrize("option", sorted(REFUSED_OPTION_ARGS))
def test_refused_option_fails_startup_naming_it(option, tmp_path, monkeypatch):
    monkeypatch.delenv(config.VARIANT_ENV, raising=False)
    ckpt = _testing.write_tiny_checkpoint_configs(tmp_path)
    with pytest.raises(ValueError, match=f"EAGLE_TREE \\(EAGLE3 head\\) does not support {option}"):
        _testing.resolved_server_args(
            model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE",
            speculative_draft_model_path=ckpt["eagle3_head"], attention_backend=config.BACKEND_TORCH,
            **REFUSED_OPTION_ARGS[option],
        )  # fmt: skip


def test_input_scattered_attention_is_refused_only_with_eagle3_heads(tmp_path, monkeypatch):
    """As SGLang turns it off for EAGLE3 only: an EAGLE head keeps it."""
    from sglang.srt.arg_groups.overrides import resolved_view

    monkeypatch.delenv(config.VARIANT_ENV, raising=False)
    ckpt = _testing.write_tiny_checkpoint_configs(tmp_path)
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend=config.BACKEND_TORCH, **REFUSED_OPTION_ARGS["--enable-attn-tp-input-scattered"],
    )  # fmt: skip
    assert resolved_view(server_args).enable_attn_tp_input_scattered
