"""The tree contract the kernel module owns: one table of mask modes with
the one mask allocator (``spec_tree_kernels.modes``), one tree shape type
(``spec_tree_kernels.tree_shape.TreeShape``) and one head-kind rule
(``spec_tree_kernels.head_kinds``), which the adapters import. The source
scans at the end fail when a second definition comes back."""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

import pytest
import torch

import spec_tree_kernels as stk
from spec_tree_kernels import tree_shape
from spec_tree_kernels.head_kinds import (
    EAGLE3_CONFIG_KEYS,
    VLLM_METHODS,
    HeadKind,
    head_kind,
    head_kind_of_architectures,
)
from spec_tree_kernels.modes import (
    MAX_BITPACKED_NODES,
    MAX_TREE_NODES,
    MODES,
    OWN_MODES,
    TREE_ATTENTION_MODE_NAMES,
    TREE_ATTENTION_MODES,
    TreeMaskMode,
    empty_tree_mask,
    mask_bytes_per_request,
    mask_dtype,
    max_nodes,
)
from spec_tree_kernels.tree_shape import TreeShape

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_covers_every_mode_and_matches_the_allocator():
    assert set(MODES) == set(TreeMaskMode)
    for mode, support in MODES.items():
        assert max_nodes(mode) == support.max_nodes == (MAX_BITPACKED_NODES if mode == TreeMaskMode.QLEN_ONLY_BITPACKING
                                                        else MAX_TREE_NODES)
        if support.dtype is not None:
            assert empty_tree_mask(mode, 2, 8, 10, "cpu").dtype == support.dtype
        for nodes in (1, 8, 9, 17, 32):
            buf = empty_tree_mask(mode, 1, nodes, 100, "cpu")
            assert tuple(buf.shape) == support.shape(1, nodes, 100) and buf.dtype == mask_dtype(mode, nodes)
            assert buf.numel() * buf.element_size() == mask_bytes_per_request(mode, nodes, 100)
            zeroed = empty_tree_mask(mode, 3, nodes, 7, "cpu", zeroed=True)
            assert tuple(zeroed.shape) == support.shape(3, nodes, 7)
            assert not zeroed.view(torch.uint8).any()
    assert [mask_dtype(TreeMaskMode.QLEN_ONLY_BITPACKING, t) for t in (8, 9, 17)] == [
        torch.uint8, torch.uint16, torch.uint32]
    assert TREE_ATTENTION_MODES == (TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY)
    assert TREE_ATTENTION_MODE_NAMES == tuple(m.name for m in TREE_ATTENTION_MODES)
    assert OWN_MODES == (TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER)


def test_tree_attention_reads_exactly_the_tables_modes():
    from spec_tree_kernels.attention import tree_attention

    q = torch.zeros(1, 2, 1, 4)
    cache = torch.zeros(1, 4, 1, 4)
    table, ctx = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for mode in TreeMaskMode:
        mask = empty_tree_mask(mode, 1, 2, 0, "cpu").zero_()
        if mode == TreeMaskMode.PARENT_POINTER:
            mask[0, 0] = torch.tensor([-1, 0])
            mask[0, 1] = torch.tensor([0, 1])
        if mode in TREE_ATTENTION_MODES:
            tree_attention(q, cache, cache, table, ctx, mask, mode, impl="torch")
        else:
            with pytest.raises(ValueError, match="supports mask modes"):
                tree_attention(q, cache, cache, table, ctx, mask, mode, impl="torch")


def test_the_adapters_use_the_table():
    from spec_plugins.sglang_ext import config as sglang_config

    from spec_plugins.vllm_ext import config as vllm_config

    assert sglang_config.OUR_BACKEND_MODES == TREE_ATTENTION_MODES
    assert sglang_config.OUR_BACKEND_DEFAULT_MODE == TREE_ATTENTION_MODES[0]
    assert sglang_config.VARIANTS == ("EAGLE", "EAGLE3")
    assert vllm_config.ALLOWED_MASK_MODES == TREE_ATTENTION_MODE_NAMES
    assert vllm_config.VLLM_METHODS == VLLM_METHODS == ("eagle", "eagle3")


def test_one_tree_shape_type():
    from spec_plugins import budget, tree_drafting
    from spec_plugins.sglang_ext import config as sglang_config
    from spec_plugins.vllm_ext import config as vllm_config

    assert stk.TreeShape is TreeShape
    for module in (tree_drafting, budget, vllm_config, sglang_config):
        assert module.TreeShape is TreeShape, module.__name__
    assert stk.validate_tree_shape is stk.api.validate_tree_shape is tree_shape.validate_tree_shape
    assert stk.pool_size is tree_shape.pool_size and stk.parent_list_width is tree_shape.parent_list_width
    assert vllm_config.DEFAULT_SHAPE == TreeShape(5, 4, 8)
    assert vllm_config.parse_tree_settings({"topk": 1, "num_steps": 3}).shape == TreeShape(3, 1, 4)
    assert budget.parse_menu("none,3,1,4")[1] == TreeShape(3, 1, 4)
    # SGLang's flag-level check hands back the shape it validated
    assert sglang_config.validate_tree(5, 4, 8, TreeMaskMode.ANCESTOR_BITMASK) == TreeShape(5, 4, 8)


def test_tree_shape_spelling_and_validation():
    assert TreeShape.parse("5,4,8") == TreeShape(5, 4, 8)
    assert TreeShape.parse(" 3, 1, 4").as_tuple() == (3, 1, 4)
    for bad in ("5,4", "5,4,8,1", "a,b,c", ""):
        with pytest.raises(ValueError, match="must be num_steps,topk,num_draft_tokens"):
            TreeShape.parse(bad)
    with pytest.raises(ValueError, match="shape '2,2,8': num_draft_tokens=8 needs 7 draft nodes .* only draft 6"):
        TreeShape.parse("2,2,8")
    with pytest.raises(ValueError, match="topk must be a positive int"):
        TreeShape(5, 0, 8)
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        TreeShape(True, 1, 2)
    with pytest.raises(AttributeError):
        TreeShape(5, 4, 8).topk = 2  # frozen: a dict key of the budget's tables
    # the command-line type: the same spelling and checks, the plain triple the tools key runs by
    from spec_plugins.cli_types import parse_shape

    assert parse_shape("5,4,8") == (5, 4, 8) and type(parse_shape("5,4,8")) is tuple
    with pytest.raises(argparse.ArgumentTypeError, match="e.g. 5,4,8"):
        parse_shape("5,4")
    with pytest.raises(argparse.ArgumentTypeError, match="only draft 6"):
        parse_shape("2,2,8")


def test_head_kinds_detection_and_spellings():
    assert [k.value for k in HeadKind] == ["eagle1", "eagle3"]
    assert [k.vllm_method for k in HeadKind] == ["eagle", "eagle3"]
    assert [k.sglang_algorithm for k in HeadKind] == ["EAGLE", "EAGLE3"]
    for name, kind in (("eagle1", HeadKind.EAGLE1), ("eagle", HeadKind.EAGLE1), ("EAGLE", HeadKind.EAGLE1),
                       ("eagle3", HeadKind.EAGLE3), ("EAGLE3", HeadKind.EAGLE3)):
        assert HeadKind.parse(name) is kind
    with pytest.raises(ValueError, match="eagle"):
        HeadKind.parse("medusa")
    assert head_kind_of_architectures(["LlamaForCausalLMEagle3"]) is HeadKind.EAGLE3
    assert head_kind_of_architectures(["Eagle3DeepseekV2ForCausalLM"]) is HeadKind.EAGLE3
    assert head_kind_of_architectures(["LlamaForCausalLM"]) is HeadKind.EAGLE1
    assert head_kind_of_architectures(None) is HeadKind.EAGLE1
    # our own record wins over the architectures
    assert head_kind({"architectures": ["LlamaForCausalLM"], "spec_plugins": {"kind": "eagle3"}}) is HeadKind.EAGLE3
    assert head_kind({"architectures": ["LlamaForCausalLMEagle3"]}) is HeadKind.EAGLE3
    assert head_kind({"architectures": ["LlamaForCausalLM"]}) is HeadKind.EAGLE1
    # fields only EAGLE-3 heads carry (the rule the vLLM adapter had on its own)
    assert EAGLE3_CONFIG_KEYS == ("eagle_config", "draft_vocab_size")
    for key in EAGLE3_CONFIG_KEYS:
        assert head_kind({"architectures": ["LlamaForCausalLM"], key: {}}) is HeadKind.EAGLE3
    assert head_kind({"eagle_config": {}, "spec_plugins": {"kind": "eagle1"}}) is HeadKind.EAGLE1


def test_shipped_heads_detected_alike_by_every_consumer():
    from spec_plugins.heads import SHIPPED, HeadConfig, head_path
    from spec_plugins.sglang_ext.config import detect_variant
    from spec_plugins.vllm_ext.config import head_method

    for name in SHIPPED:
        cfg = json.loads((head_path(name) / "config.json").read_text())
        kind = HeadKind(name)
        assert head_kind(cfg) is kind
        assert HeadConfig.from_engine_config(cfg).kind == kind.value
        assert detect_variant(cfg["architectures"]) == kind.sglang_algorithm
        assert head_method(str(head_path(name))) == kind.vllm_method


def test_vllm_head_method_is_the_kernel_rule(tmp_path):
    from spec_plugins.vllm_ext.config import head_method

    for cfg in ({"architectures": ["LlamaForCausalLM"]}, {"architectures": ["LlamaForCausalLMEagle3"]},
                {"architectures": ["LlamaForCausalLM"], "draft_vocab_size": 32000},
                {"architectures": ["LlamaForCausalLM"], "eagle_config": {}},
                {"architectures": ["Eagle3DeepseekV2ForCausalLM"]}):
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert head_method(str(tmp_path)) == head_kind(cfg).vllm_method


# ------------------------------------------------------- one definition each


def _sources():
    for folder in ("kernels", "spec_plugins", "ci"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _definitions() -> dict[str, list[str]]:
    """Top-level and nested def / class names -> where each is defined."""
    found: dict[str, list[str]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_contract_is_defined_once():
    found = _definitions()
    once = {
        "TreeShape": "kernels/tree_shape.py", "validate_tree_shape": "kernels/tree_shape.py",
        "pool_size": "kernels/tree_shape.py", "parent_list_width": "kernels/tree_shape.py",
        "parse_shape_numbers": "kernels/tree_shape.py",
        "empty_tree_mask": "kernels/modes.py", "mask_dtype": "kernels/modes.py", "ModeSupport": "kernels/modes.py",
        "HeadKind": "kernels/head_kinds.py", "head_kind": "kernels/head_kinds.py",
        "head_kind_of_architectures": "kernels/head_kinds.py", "resolve_impl": "kernels/api.py",
        # the two draft pools, named for what they are (once both "draft_pool")
        "synthetic_pool": "spec_plugins/synthetic_trees.py", "expand_head_pool": "spec_plugins/tree_drafting.py",
    }
    for name, where in once.items():
        places = found.get(name, [])
        assert len(places) == 1 and places[0].startswith(where + ":"), (name, places)
    assert "draft_pool" not in found, found.get("draft_pool")


def test_one_head_kind_rule():
    """Only ``head_kinds`` tells EAGLE-3 from EAGLE-1 by looking at a config
    (an architecture naming eagle3, the EAGLE-3-only fields)."""
    rule = re.compile(r"""["'](eagle3|eagle_config|draft_vocab_size)["']\s+(not\s+)?in\b""", re.IGNORECASE)
    places = [f"{path.relative_to(ROOT)}:{number}" for path in _sources()
              for number, line in enumerate(path.read_text().splitlines(), 1) if rule.search(line)]
    assert places and all(p.startswith("kernels/head_kinds.py:") for p in places), places


def _allocates_by_mode(func: ast.AST) -> list[int]:
    """Lines where ``func`` returns a fresh tensor from a branch on a TreeMaskMode."""
    lines = []
    for branch in ast.walk(func):
        if not isinstance(branch, ast.If) or "TreeMaskMode." not in ast.unparse(branch.test):
            continue
        for node in ast.walk(branch):
            call = node.value if isinstance(node, ast.Return) else None
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("empty", "zeros", "ones", "full")
                    and ast.unparse(call.func.value) == "torch"):
                lines.append(node.lineno)
    return lines


def test_one_mask_allocator():
    """Mask buffers come from ``modes.empty_tree_mask`` (shaped by ``MODES``):
    no function anywhere allocates one per mode in its own branches."""
    per_mode = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                per_mode += [f"{path.relative_to(ROOT)}:{line} ({node.name})" for line in _allocates_by_mode(node)]
    assert per_mode == []
    assert _allocates_by_mode(ast.parse(
        "def f(mode):\n    if mode == TreeMaskMode.QLEN_ONLY:\n        return torch.zeros(4, dtype=torch.bool)\n"
    )) == [3]  # the scan sees the pattern it forbids
