"""ci/sglang_spec_tree.py loads SGLang's Triton tree kernels from a copy of
spec_tree.py without importing sglang, and they agree with our reference.

Needs a copy of SGLang 0.5.23's spec_tree.py: $SGLANG_SPEC_TREE_PY, else the
one in .venv-sglang (ci/setup_sglang_venv.sh), else an unpacked wheel under
/tmp/whl. Runs under TRITON_INTERPRET=1 without a GPU (tests/conftest.py).
"""

from __future__ import annotations

import glob
import os
import random
import sys
from pathlib import Path

import pytest
import torch

import spec_tree_kernels as K
from kernel_device import DEVICE
from pools import random_batch
from spec_tree_kernels import reference
from test_tree_ops import random_tokens_with_real_acceptance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))
import sglang_spec_tree  # noqa: E402

_SUFFIX = "sglang/kernels/ops/speculative/spec_tree.py"


def find_spec_tree() -> str | None:
    candidates = [os.environ.get(sglang_spec_tree.ENV_VAR, "")]
    candidates += sorted(glob.glob(str(ROOT / ".venv-sglang" / "lib" / "python3*" / "site-packages" / _SUFFIX)))
    candidates += ["/tmp/whl/sg/" + _SUFFIX]
    return next((c for c in candidates if c and Path(c).is_file()), None)


SPEC_TREE = find_spec_tree()
pytestmark = pytest.mark.skipif(SPEC_TREE is None, reason="no copy of SGLang's spec_tree.py ($SGLANG_SPEC_TREE_PY)")


def test_extracts_only_the_kernels():
    source = sglang_spec_tree.extract_source(SPEC_TREE)
    assert "import sglang" not in source and "from sglang" not in source
    for name in sglang_spec_tree.NEEDED:
        assert f"def {name}(" in source or f"class {name}(" in source
    assert source.count("@triton.jit") == 2


def test_missing_definitions_are_named(tmp_path):
    bad = tmp_path / "spec_tree.py"
    bad.write_text("def sgl_build_tree_kernel_triton():\n    pass\n")
    with pytest.raises(ValueError, match="verify_tree_greedy_triton"):
        sglang_spec_tree.extract_source(bad)


@pytest.mark.parametrize("topk, num_steps, nodes, batch", [(2, 3, 6, 2), (4, 3, 8, 3), (1, 4, 5, 2), (3, 1, 3, 2)])
def test_sglang_kernels_agree_with_our_reference(topk, num_steps, nodes, batch):
    """Tie-free pools: SGLang's FULL_MASK / QLEN_ONLY masks, positions, links and
    greedy verify equal ours (SGLang's accept_index holds b*T + node)."""
    mod = sglang_spec_tree.load(SPEC_TREE)
    rng = random.Random(topk * 100 + nodes)
    scores, parent_list = random_batch(rng, batch, topk, num_steps, "random")
    seq_lens = torch.tensor([rng.randint(0, 9) for _ in range(batch)], dtype=torch.int64)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
    seq_lens_sum = int(seq_lens.sum())
    dev = [t.to(DEVICE) for t in (parent_list, selected, seq_lens)]
    for mode in (0, 1):
        ours, ok = reference.build_tree(selected, parent_list, seq_lens, topk, num_steps, K.TreeMaskMode(mode), seq_lens_sum)
        assert bool(ok.all())
        mask, positions, index, next_token, next_sibling = sglang_spec_tree.build_tree(
            mod, *dev, seq_lens_sum, topk, num_steps, nodes, mode
        )
        assert torch.equal(mask.cpu(), ours.tree_mask)
        assert torch.equal(positions.cpu().view(batch, nodes), ours.positions)
        assert torch.equal(index.cpu(), ours.retrieve_index)
        assert torch.equal(next_token.cpu(), ours.retrieve_next_token)
        assert torch.equal(next_sibling.cpu(), ours.retrieve_next_sibling)
    candidates, target = random_tokens_with_real_acceptance(rng, selected, parent_list, topk, vocab=3)
    expected = reference.verify_tree_greedy(candidates, ours.retrieve_next_token, ours.retrieve_next_sibling, target, num_steps)
    _, accept_index, accept_num = sglang_spec_tree.verify(
        mod, candidates.to(DEVICE), index, next_token, next_sibling, target.to(DEVICE), num_steps
    )
    flat = torch.where(expected.accept_index >= 0, expected.accept_index + nodes * torch.arange(batch)[:, None], -1)
    assert torch.equal(accept_index.cpu(), flat.to(torch.int32))
    assert torch.equal(accept_num.cpu(), expected.accept_length)
