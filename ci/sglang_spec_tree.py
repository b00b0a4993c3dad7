"""Load SGLang's own Triton tree kernels for side-by-side checks and timings,
without importing (or vendoring) SGLang.

SGLang 0.5.23's ``sglang/kernels/ops/speculative/spec_tree.py`` defines the
Triton kernels ``sgl_build_tree_kernel_efficient_triton`` and
``verify_tree_greedy_kernel_triton`` with their launchers
``sgl_build_tree_kernel_triton`` and ``verify_tree_greedy_triton``, but the
module also imports ``sglang.srt.platforms`` / ``sglang.srt.utils``, which pull
in most of SGLang's dependencies. Here the file's text is parsed and only those
definitions (and the ``TreeMaskMode`` enum they use) are kept, under a header
of plain ``torch`` / ``triton`` imports, written to a temporary file and
imported from there (Triton's ``@jit`` reads a function's source through
``inspect``, so exec'ing a string would not do).

The copy of spec_tree.py is Apache-2.0 code of another project and must not be
committed here: point ``SGLANG_SPEC_TREE_PY`` at a copy (for example one taken
from the SGLang wheel into an ignored folder at run time).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
import tempfile
import types
from pathlib import Path

ENV_VAR = "SGLANG_SPEC_TREE_PY"
NEEDED = (
    "TreeMaskMode",
    "sgl_build_tree_kernel_efficient_triton",
    "verify_tree_greedy_kernel_triton",
    "sgl_build_tree_kernel_triton",
    "verify_tree_greedy_triton",
)
# sglang/kernels/ops/kvcache/cache_move.py's all-layer slot copy (what
# MHATokenToKVPool.move_kv_cache launches); optional: append that file's text
# to the copy to include it.
OPTIONAL = ("copy_all_layer_kv_cache_tiled",)
_HEADER = '''"""Extracted at run time from {path} (SGLang, Apache-2.0) by
ci/sglang_spec_tree.py: only {names}. Not part of this repository."""
from enum import IntEnum

import torch
import triton
import triton.language as tl

'''


def extract_source(path: str | os.PathLike) -> str:
    """Module text holding only NEEDED's definitions of ``path`` (decorators
    included), in file order. Raises ValueError naming any that is missing."""
    text = Path(path).read_text()
    lines = text.splitlines()
    found: dict[str, str] = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in NEEDED + OPTIONAL:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            found[node.name] = "\n".join(lines[first - 1 : node.end_lineno])
    missing = [name for name in NEEDED if name not in found]
    if missing:
        raise ValueError(f"{path} defines none of {missing}: not SGLang 0.5.23's spec_tree.py?")
    body = "\n\n\n".join(found[name] for name in NEEDED + OPTIONAL if name in found)
    return _HEADER.format(path=path, names=", ".join(NEEDED)) + body + "\n"


def load(path: str | os.PathLike | None = None) -> types.ModuleType:
    """Import the extracted kernels as a module (cached per source text).

    ``path`` defaults to $SGLANG_SPEC_TREE_PY. The module exposes
    TreeMaskMode, sgl_build_tree_kernel_triton(...) and
    verify_tree_greedy_triton(...) with SGLang's signatures.
    """
    path = path or os.environ.get(ENV_VAR)
    if not path:
        raise FileNotFoundError(f"set {ENV_VAR} to a copy of SGLang's spec_tree.py")
    source = extract_source(path)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"sglang_spec_tree_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    folder = Path(tempfile.gettempdir()) / "spec_tree_sglang_kernels"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{name}.py"
    if not file.exists() or file.read_text() != source:
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, file)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def available(path: str | os.PathLike | None = None) -> bool:
    path = path or os.environ.get(ENV_VAR)
    return bool(path) and Path(path).is_file()


# ------------------------------------------------- SGLang's calling sequence


def build_tree(mod, parent_list, selected_index, seq_lens, seq_lens_sum, topk, num_steps, nodes, mode, fill_prefix_mask=True):
    """SGLang's build step as eagle_utils.build_tree_kernel_efficient does it
    (buffers allocated and initialized the same way, then the Triton kernel).

    mode: 0 FULL_MASK or 1 QLEN_ONLY (SGLang's Triton build has no bitpacking).
    Returns (tree_mask, positions [B*T], retrieve_index, next_token, next_sibling [B, T]).
    """
    import torch

    batch = seq_lens.numel()
    device = seq_lens.device
    if mode == 0:
        shape = (seq_lens_sum * nodes + nodes * nodes * batch,)
        tree_mask = (
            torch.full(shape, True, dtype=torch.bool, device=device)
            if fill_prefix_mask
            else torch.empty(shape, dtype=torch.bool, device=device)
        )
    else:
        tree_mask = torch.full((nodes * batch * nodes,), True, dtype=torch.bool, device=device)
    retrieve = torch.full((3, batch, nodes), -1, device=device, dtype=torch.long)
    positions = torch.empty((batch * nodes,), device=device, dtype=torch.long)
    mod.sgl_build_tree_kernel_triton(
        parent_list, selected_index, seq_lens, tree_mask, positions, retrieve[0], retrieve[1], retrieve[2],
        topk, num_steps, nodes, mod.TreeMaskMode(mode),
    )  # fmt: skip
    return tree_mask, positions, retrieve[0], retrieve[1], retrieve[2]


def verify(mod, candidates, retrieve_index, next_token, next_sibling, target_predict, num_steps):
    """SGLang's greedy verify (eagle_utils' buffers, then the Triton kernel).

    Returns (predict [B*T] int32, accept_index [B, S+1] int32 holding
    retrieve_index values b*T + node, accept_token_num [B] int32).
    """
    import torch

    batch, nodes = candidates.shape
    device = candidates.device
    predict = torch.zeros(batch * nodes, dtype=torch.int32, device=device)
    accept_index = torch.full((batch, num_steps + 1), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.empty((batch,), dtype=torch.int32, device=device)
    mod.verify_tree_greedy_triton(
        predict, accept_index, accept_token_num, candidates, retrieve_index, next_token, next_sibling, target_predict
    )
    return predict, accept_index, accept_token_num


def move_kv(mod, caches, tgt_loc, src_loc):
    """SGLang's accepted-KV move: MHATokenToKVPool._move_kv_cache_impl with its
    tiling heuristics, over flat [slots, H, D] contiguous caches, chunked by
    256 locations as SGLang does. Requires copy_all_layer_kv_cache_tiled."""
    import torch
    import triton

    stride_bytes = caches[0].stride(0) * caches[0].element_size()
    tile = 512 if stride_bytes >= 8192 else (256 if stride_bytes >= 4096 else 128)
    cap = 128 if tile >= 512 else 256
    warps = 4 if tile <= 256 else 8
    if not hasattr(move_kv, "_ptrs") or move_kv._key != [c.data_ptr() for c in caches]:
        move_kv._key = [c.data_ptr() for c in caches]
        move_kv._ptrs = torch.tensor(move_kv._key, dtype=torch.uint64, device=caches[0].device)
        move_kv._strides = torch.tensor([stride_bytes] * len(caches), dtype=torch.int64, device=caches[0].device)
    n = tgt_loc.numel()
    for start in range(0, n, cap):
        length = min(cap, n - start)
        mod.copy_all_layer_kv_cache_tiled[(len(caches), triton.cdiv(stride_bytes, tile))](
            move_kv._ptrs, move_kv._strides, tgt_loc[start : start + length], src_loc[start : start + length],
            length, triton.next_power_of_2(length), BYTES_PER_TILE=tile, num_warps=warps, num_stages=2,
        )  # fmt: skip
