"""The tree contract the kernel module owns: one table of mask modes
(``spec_tree_kernels.modes.MODES``) and one head-kind rule
(``spec_tree_kernels.head_kinds``), which the adapters import."""

from __future__ import annotations

import json

import pytest
import torch

from spec_tree_kernels.head_kinds import HeadKind, head_kind, head_kind_of_architectures
from spec_tree_kernels.modes import (
    MAX_BITPACKED_NODES,
    MAX_TREE_NODES,
    MODES,
    OWN_MODES,
    TREE_ATTENTION_MODE_NAMES,
    TREE_ATTENTION_MODES,
    TreeMaskMode,
    empty_tree_mask,
    max_nodes,
)


def test_the_table_covers_every_mode_and_matches_the_allocator():
    assert set(MODES) == set(TreeMaskMode)
    for mode, support in MODES.items():
        assert max_nodes(mode) == support.max_nodes == (MAX_BITPACKED_NODES if mode == TreeMaskMode.QLEN_ONLY_BITPACKING
                                                        else MAX_TREE_NODES)
        if support.dtype is not None:
            assert empty_tree_mask(mode, 2, 8, 10, "cpu").dtype == support.dtype
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
    pytest.importorskip("spec_plugins")
    from spec_plugins.sglang_ext import config as sglang_config

    assert sglang_config.OUR_BACKEND_MODES == TREE_ATTENTION_MODES
    assert sglang_config.OUR_BACKEND_DEFAULT_MODE == TREE_ATTENTION_MODES[0]
    assert sglang_config.VARIANTS == ("EAGLE", "EAGLE3")


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


def test_shipped_heads_detected_alike_by_every_consumer():
    pytest.importorskip("spec_plugins")
    from spec_plugins.heads import SHIPPED, HeadConfig, head_path
    from spec_plugins.sglang_ext.config import detect_variant

    for name in SHIPPED:
        cfg = json.loads((head_path(name) / "config.json").read_text())
        kind = HeadKind(name)
        assert head_kind(cfg) is kind
        assert HeadConfig.from_engine_config(cfg).kind == kind.value
        assert detect_variant(cfg["architectures"]) == kind.sglang_algorithm
