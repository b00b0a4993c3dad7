"""Issue #50 item 2: every op that reads or writes the paged cache, on vLLM-CPU's
AMX tiles (``spec_tree_kernels.kv_layout``), against the same op on a plain
cache holding the same values and against the dense reference.

No AMX CPU is needed: the caches are built here in that exact layout, each
element placed by the offset formulas vLLM 0.32's cache-write op follows
(read off the op itself with isa="amx", which runs on any x86 CPU:
tests/model/test_vllm_tree_config.py::test_cpu_kv_views_read_what_vllm_wrote
checks those formulas against the op). The ops run on
``TiledKV`` views of that storage: tree rows (``TreeAttentionPlan``, torch
and "cpu", whose host kernel hands bf16 to torch), draft steps
(``BranchAttentionPlan`` torch) and the accepted-path KV move. A cache whose
tiles are transposed (the mutation) must read differently.
"""

from __future__ import annotations

import pytest
import torch

import spec_tree_kernels as stk
from spec_tree_kernels.attention_plan import TreeAttentionPlan
from spec_tree_kernels.attention_reference import tree_attention_reference
from spec_tree_kernels.branch_attention import BranchAttentionPlan
from spec_tree_kernels.kv_layout import TiledKV, refuse_tiled, tiled_or_plain

NB, BS, HKV, HQ, D = 9, 32, 2, 4, 64  # vLLM picks "amx" for bf16 with block_size % 32 == 0, head_size % 32 == 0


def amx_offsets(transposed_tile: bool = False):
    """[BS, D] int64: where (token t, dim d) lies in its block/head region, K then V
    (vLLM 0.32 ``cpu_attn_reshape_and_cache``, isa="amx"). transposed_tile: K's
    16 x 2 tiles stored 2 x 16 (the mutation)."""
    t, d = torch.arange(BS)[:, None], torch.arange(D)[None, :]
    if transposed_tile:
        k = (t // 16) * 16 * D + (d // 2) * 32 + (d % 2) * 16 + t % 16
    else:
        k = (t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2
    v = (d // 16) * 16 * BS + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return k, v


def amx_cache(k_dense, v_dense, transposed_tile=False):
    """The vLLM-CPU cache [NB, Hkv, BS, 2D] holding k_dense / v_dense [NB, BS, Hkv, D]
    in AMX order, each element written at its formula's offset."""
    k_off, v_off = amx_offsets(transposed_tile)
    region = torch.zeros(NB, HKV, 2 * BS * D, dtype=k_dense.dtype)
    region[:, :, k_off.flatten()] = k_dense.permute(0, 2, 1, 3).reshape(NB, HKV, BS * D)
    region[:, :, BS * D + v_off.flatten()] = v_dense.permute(0, 2, 1, 3).reshape(NB, HKV, BS * D)
    return region.view(NB, HKV, BS, 2 * D)


def tiled_views(cache):
    """TiledKV views of ``amx_cache``'s storage: K [NB, 2, 16, Hkv, D/2, 2], V [NB, 16, 2, Hkv, 4, 16]
    (the strides ``vllm_ext.attention_cpu`` fits to the op's layout)."""
    s_block, s_head = cache.stride(0), cache.stride(1)
    k = cache.as_strided((NB, BS // 16, 16, HKV, D // 2, 2), (s_block, 16 * D, 2, s_head, 32, 1))
    v = cache.as_strided((NB, BS // 2, 2, HKV, D // 16, 16), (s_block, 32, 1, s_head, 16 * BS, 2), BS * D)
    return tiled_or_plain(k), tiled_or_plain(v)


@pytest.fixture
def caches():
    gen = torch.Generator().manual_seed(50)
    k = torch.randn(NB, BS, HKV, D, generator=gen).bfloat16()
    v = torch.randn(NB, BS, HKV, D, generator=gen).bfloat16()
    k_tiled, v_tiled = tiled_views(amx_cache(k, v))
    assert isinstance(k_tiled, TiledKV) and isinstance(v_tiled, TiledKV)
    return k, v, k_tiled, v_tiled


def test_reads_are_the_dense_values(caches):
    k, v, k_tiled, v_tiled = caches
    blocks = torch.tensor([[4, 0], [8, 3]])
    assert torch.equal(k_tiled[blocks], k[blocks]) and torch.equal(v_tiled[blocks], v[blocks])
    block, offset = torch.tensor([2, 7, 7]), torch.tensor([0, 17, 31])
    assert torch.equal(k_tiled[block, offset], k[block, offset])
    assert torch.equal(v_tiled[block, offset], v[block, offset])
    assert k_tiled.shape == k.shape and k_tiled.dim() == 4 and k_tiled.dtype == torch.bfloat16


def test_a_transposed_tile_reads_differently(caches):
    """The mutation: K's tiles stored transposed. Read through the correct
    views, K is no longer the dense values (so every comparison below would
    fail), and V, whose tiles did not change, still is."""
    k, v, _, _ = caches
    k_bad, v_same = tiled_views(amx_cache(k, v, transposed_tile=True))
    blocks = torch.arange(NB)
    assert not torch.equal(k_bad[blocks], k) and torch.equal(v_same[blocks], v)


def _trees(gen):
    """3 requests of 6-node trees (ragged contexts) in ANCESTOR_BITMASK over a shuffled table."""
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 0, 0]])
    context = torch.tensor([40, 3, 90])
    mask = stk.tree_from_parents(parents, context, "ANCESTOR_BITMASK", max_depth=5, impl="torch").tree_mask
    table = torch.randperm(NB, generator=gen)[:9].view(3, 3).to(torch.int32)
    return table, context, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("impl", ["torch", "cpu"])
def test_tree_rows_match_the_reference(caches, impl, dtype):
    """bf16 is what vLLM tiles; float32 tiles check that the host kernel
    (which serves float32 strided views) hands tiles to the torch path."""
    if impl == "cpu":
        from spec_tree_kernels import cpu_attention

        assert cpu_attention.build(), cpu_attention.build_error()
    k, v, _, _ = caches
    k, v = k.to(dtype), v.to(dtype)
    k_tiled, v_tiled = tiled_views(amx_cache(k, v))
    gen = torch.Generator().manual_seed(1)
    table, context, mask = _trees(gen)
    q = torch.randn(3, 6, HQ, D, generator=gen).to(dtype)
    want = tree_attention_reference(q, k, v, table, context, mask, "ANCESTOR_BITMASK", 0.125)
    plan = TreeAttentionPlan.create(table, context, mask, "ANCESTOR_BITMASK", 6, BS, 100, impl=impl)
    got = plan.run(q, k_tiled, v_tiled, 0.125)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    plain = TreeAttentionPlan.create(table, context, mask, "ANCESTOR_BITMASK", 6, BS, 100, impl="torch")
    assert torch.equal(got, plain.run(q, k, v, 0.125))  # the plain cache's values through the torch path


def test_draft_steps_match_the_plain_cache(caches):
    """Two levels of a K=3 draft step over committed head KV read in place."""
    k, v, k_tiled, v_tiled = caches
    gen = torch.Generator().manual_seed(2)
    table, kv_lens = torch.randperm(NB, generator=gen)[:6].view(2, 3), torch.tensor([70, 33])
    branch = torch.randn(2, 2, 6, HKV, D, generator=gen).bfloat16()
    plan = BranchAttentionPlan.create(table, kv_lens, 70, BS, impl="torch", chunk_bytes=1)  # a chunk per block
    for level in (1, 2):
        q = torch.randn(2, 3, HQ, D, generator=gen).bfloat16()
        ancestors = torch.rand(2, 3, 3 * (level - 1), generator=gen) < 0.5
        outs = [plan.run(q, kc, vc, branch[0], branch[1], 3 * level, ancestors, 0.125, torch.empty_like(q))
                for kc, vc in ((k_tiled, v_tiled), (k, v))]
        assert torch.equal(outs[0], outs[1]), f"level {level}"


def test_kv_move_writes_the_tiles(caches):
    """The accepted path [0, 2, 5] of a 6-node tree over slots 60..65 (a block
    boundary at 64) moves in the tiles exactly as in the plain cache."""
    k, v, k_tiled, v_tiled = caches
    slots = (torch.arange(6) + 60)[None] + torch.tensor([[0], [96]])  # second request: block 4 -> 5
    accept = torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]])
    length = torch.tensor([2, 1])
    k_plain, v_plain = k.clone(), v.clone()
    stk.move_accepted_kv([k_plain, v_plain], slots, accept, length, impl="torch")
    stk.move_accepted_kv([k_tiled, v_tiled], slots, accept, length)
    blocks = torch.arange(NB)
    assert torch.equal(k_tiled[blocks], k_plain) and torch.equal(v_tiled[blocks], v_plain)
    assert not torch.equal(k_plain, k)  # the move moved something


def test_strided_only_paths_refuse_tiles_by_name(caches):
    _, _, k_tiled, v_tiled = caches
    with pytest.raises(ValueError, match="v_cache is a tiled cache.*Triton"):
        refuse_tiled("Triton", k_cache=torch.zeros(1), v_cache=v_tiled)
    from spec_tree_kernels import cpu_attention

    assert not cpu_attention.branch_supports(k_tiled, v_tiled)


def test_kv_move_keeps_tiles_from_strided_only_moves(caches, monkeypatch):
    """Triton's and CUDA's moves address strided views: with tiles among the
    caches, those go through the reference's indexing and only the plain
    views reach the chosen implementation (here a stand-in that records them)."""
    from spec_tree_kernels import api

    k, _, k_tiled, v_tiled = caches
    handed = []

    class StridedOnly:
        @staticmethod
        def move_accepted_kv(caches, *args):
            handed.extend(caches)

    monkeypatch.setattr(api, "_implementation", lambda op, impl, device: StridedOnly)
    plain = k.clone()
    slots, accept, length = torch.arange(60, 66)[None], torch.tensor([[0, 3, -1]]), torch.tensor([1])
    stk.move_accepted_kv([k_tiled, plain, v_tiled], slots, accept, length, impl="triton")
    assert len(handed) == 1 and handed[0] is plain
    assert torch.equal(k_tiled[torch.tensor(1), torch.tensor(29)], k[1, 31])  # depth 1's slot 61 <- node 3's 63
