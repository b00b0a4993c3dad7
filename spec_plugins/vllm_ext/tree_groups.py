"""The V1 runner's trees of one step, grouped by size (``TreeGroup``).

A group is planned on the host before the target's forward, from what the
host already knows (the drafts the runner made, the scheduler's cut of
them, the batch's host arrays), and uploaded once without waiting; the walk
then fills in its device results, which the head's extend and the KV move
read. Also the rows helpers the plan and the walk share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import functools

import numpy as np
import torch

import spec_tree_kernels as stk


def upload(host, device) -> torch.Tensor:
    """A host tensor or array on ``device`` without waiting for the device's queue
    (a blocking copy from pageable memory drains it on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(host)) if isinstance(host, np.ndarray) else host
    return t.to(device, non_blocking=True)


@dataclass
class TreeGroup:
    """This step's trees with T nodes (B of them).

    Host, known before the step (the drafts and the scheduler): rows, tokens
    [B][T] (root first), parents [B][T] node-local parent of each node, top1
    [B][T] (``DraftTrees.top1``), the contexts, where the query rows lie.
    Device, uploaded once without waiting: rows_dev, q_starts, context_lens
    [B] int64, candidates [B, T] int64, and ``build`` (mask, positions,
    retrieve links), made on first use: a step of greedy chains verifies
    through vLLM's rejection sampler and never reads it. After the walk
    (device): predict [B, T] the token after each node (the head's extend
    input), accept_index [B, D + 1] int64 accepted nodes (root first, -1
    padded) and accept_length [B] int64 accepted drafts.
    """

    rows: list
    tokens: list
    parents: list
    top1: list
    all_chains: bool  # every tree of the group is a chain (causal: no tree mask needed)
    host_context_lens: torch.Tensor  # [B] int64
    max_context: int
    first_row: int | None  # the group's B*T query rows are first_row, first_row + 1, ... in order (None: not)
    mask_mode: str
    rows_dev: torch.Tensor
    q_starts: torch.Tensor
    context_lens: torch.Tensor
    candidates: torch.Tensor
    sampled: list = field(default_factory=list)  # indices (into rows) of requests that sample (temperature > 0)
    members: dict = field(default_factory=dict)  # mixed groups: "greedy" / "sampled" -> [n] device indices into rows
    predict: torch.Tensor | None = None
    accept_index: torch.Tensor | None = None
    accept_length: torch.Tensor | None = None
    accept_tokens: torch.Tensor | None = None  # [B, D + 1] int64 the tokens each tree emits, -1 padded

    @functools.cached_property
    def host_build(self) -> stk.TreeBuild:
        return stk.tree_from_parents(torch.tensor(self.parents, dtype=torch.int64), self.host_context_lens,
                                     self.mask_mode)

    @functools.cached_property
    def build(self) -> stk.TreeBuild:
        # Built on the host (a few hundred bytes) and copied without waiting: no device syncs per step.
        # Fresh contiguous tensors, as a gathered copy would be: the kernels' launch variants (warmed at
        # startup) depend on strides and pointer alignment, and the host build may hold offset views.
        return stk.TreeBuild(*(upload(t.clone(memory_format=torch.contiguous_format), self.q_starts.device)
                               for t in self.host_build))

    @property
    def greedy(self) -> list[int]:
        """Indices (into rows) of the requests that decode greedily."""
        sampled = set(self.sampled)
        return [i for i in range(len(self.rows)) if i not in sampled]

    @property
    def last_node(self) -> torch.Tensor:
        """[B] int64 each tree's last accepted node (device)."""
        return self.accept_index.gather(1, self.accept_length[:, None])[:, 0]

    @property
    def node_rows(self) -> torch.Tensor:
        """[B, T] the batch rows of each tree's nodes (device)."""
        return self.q_starts[:, None] + torch.arange(self.candidates.shape[1], device=self.q_starts.device)


def plan_tree_group(T: int, requests: list, device, mask_mode: str) -> TreeGroup:
    """The group of ``requests``' trees of T nodes, each request (batch row, first
    query row, context, tokens root first, parents, top-1 marks, samples)."""
    rows, q0s, ctxs, cands, parents, top1, samples = (list(x) for x in zip(*requests))
    # one upload for the group's per-request device vectors
    packed = upload(torch.tensor([rows, q0s, ctxs, *zip(*cands)], dtype=torch.int64), device)
    sampled = [i for i, s in enumerate(samples) if s]
    members = {}
    if sampled and len(sampled) < len(rows):  # mixed: each walk takes its own members
        greedy = [i for i in range(len(rows)) if not samples[i]]
        members = {"greedy": upload(torch.tensor(greedy), device), "sampled": upload(torch.tensor(sampled), device)}
    chain = list(range(-1, T - 1))
    return TreeGroup(rows=rows, tokens=cands, parents=parents, top1=top1,
                     all_chains=all(p == chain for p in parents),
                     host_context_lens=torch.tensor(ctxs, dtype=torch.int64), max_context=max(ctxs),
                     first_row=range_start(q0s, T), mask_mode=mask_mode,
                     rows_dev=packed[0], q_starts=packed[1], context_lens=packed[2],
                     candidates=packed[3:].T.clone(memory_format=torch.contiguous_format),  # aligned: kernels
                     sampled=sampled, members=members)


def range_start(starts, T: int) -> int | None:
    """starts[0] when trees of T rows starting at ``starts`` fill one range of
    rows in order (starts[i] = starts[0] + i * T), else None (also when empty)."""
    starts = np.asarray(starts)
    if len(starts) and np.array_equal(starts, starts[0] + T * np.arange(len(starts))):
        return int(starts[0])
    return None


def tree_rows(x: torch.Tensor, starts: np.ndarray, T: int) -> torch.Tensor:
    """[len(starts), T, ...]: rows starts[i] + j (j < T) of x. A view when they
    are one range in order (one request, or a batch of equal trees: no copy of
    [B * T, vocab] logits), else a gather."""
    B, first = len(starts), range_start(starts, T)
    if first is not None:
        return x[first: first + B * T].reshape(B, T, *x.shape[1:])
    rows = upload(np.asarray(starts, dtype=np.int64), x.device)[:, None] + torch.arange(T, device=x.device)
    return x[rows.flatten()].view(B, T, *x.shape[1:])
