"""A small, readable EAGLE tree speculative decoder on HF transformers.

The engine-free oracle for the vLLM/SGLang integrations and the tool that
measures acceptance length (tau) on real text. Batch 1, any tree shape, greedy
or sampled:

    dec = TreeDecoder(target, head)                      # HF LlamaForCausalLM + spec_plugins.heads.EagleHead
    out = dec.generate(prompt_ids, max_new_tokens=128, num_steps=5, topk=4, num_draft_tokens=8)
    out.tokens == dec.greedy(prompt_ids, 128).tokens     # lossless
    out = dec.generate(prompt_ids, 128, 5, 4, 8, temperature=0.7, top_p=0.9, seed=0)
    # distributed exactly as dec.sample(prompt_ids, 128, temperature=0.7, top_p=0.9)

One iteration, ``TreeDecoder.step`` (SGLang's EAGLE-2 pipeline, with
``spec_tree_kernels`` ops; timed from there, one named method per sub-step):

* ``_draft``: the head expands the root's top-k children, then num_steps - 1
  forwards grow the k best paths by cumulative probability; every candidate
  goes to a pool (K + (S-1) K^2 scores, SGLang's order and parent_list);
* ``_select``: ``select_tree_nodes`` keeps the T - 1 best (ancestor-closed);
* ``_build``: ``build_tree`` gives positions (context + depth), the QLEN_ONLY
  ancestor mask and the first-child / next-sibling links;
* verify: one target forward over the T nodes with a float 4D additive
  mask (prefix visible, tree columns = ancestors-or-self) over the KV cache;
* ``_walk``: ``verify_tree_greedy`` with the target's argmax (temperature
  0), or ``verify_tree_sampling`` (temperature > 0: target-only recursive
  rejection with the target's ``sampling_probs`` at every node and randoms from
  the request's seeded generator; exact in distribution because the drafts are
  deterministic top-k picks);
* ``_move``: ``move_accepted_kv`` compacts the accepted path's KV to the front
  of the verify slots, the cache is cropped behind it;
* ``_extend``: the head extends its own KV cache over the accepted tokens (with
  the target's features at the accepted nodes), producing the next root's
  distribution.

The chain is the degenerate tree: topk = 1, num_draft_tokens = num_steps + 1.
Draft forwards per iteration S = num_steps (num_steps - 1 tree steps + 1 extend).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

import spec_tree_kernels as stk
from spec_plugins.tree_drafting import TreeShape, expand_head_pool


def check_sampling_params(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution a sampled request draws from, given the target's logits [..., V].

    softmax(logits / temperature), restricted to the top_k largest logits (0:
    no limit; ties with the k-th are kept), then to the smallest set of most
    likely tokens whose mass reaches top_p (1.0: no limit; the most likely
    token always stays), renormalized. float64 logits stay float64, anything
    else is computed in float32. The plain sampling baseline, the first token
    of ``generate`` and every verified tree node use this one function.
    """
    check_sampling_params(temperature, top_k, top_p)
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p  # the more likely tokens already reach top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass
class Sampling:
    """A sampled request's parameters and its random stream (temperature > 0)."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator

    @classmethod
    def create(cls, temperature: float, top_k: int, top_p: float, seed: int | None) -> "Sampling":
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        check_sampling_params(temperature, top_k, top_p)
        return cls(temperature, top_k, top_p, gen)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, logits: torch.Tensor) -> int:
        """One token from the distribution at logits [V]."""
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))

    def randoms(self, nodes: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``verify_tree_sampling``'s randoms for one verify step: coins [1, nodes]
        U[0, 1) and exponentials [1, vocab] Exp(1), kept > 0."""
        coins = torch.rand(1, nodes, generator=self.generator, dtype=dtype)
        exponentials = torch.empty(1, vocab, dtype=dtype).exponential_(generator=self.generator)
        return coins, exponentials.clamp_(min=torch.finfo(dtype).tiny)


@dataclass
class Timer:
    """Wall time and count of each kind of call (for the cost model)."""

    seconds: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)

    def add(self, key: str, dt: float, n: int = 1):
        self.seconds[key] = self.seconds.get(key, 0.0) + dt
        self.calls[key] = self.calls.get(key, 0) + n

    def mean(self, key: str) -> float:
        return self.seconds.get(key, 0.0) / max(1, self.calls.get(key, 0))

    @contextlib.contextmanager
    def section(self, key: str):
        """Time the ``with`` body under ``key`` (one call)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - start)


@dataclass
class Output:
    tokens: list  # generated token ids (prompt excluded)
    accept_lengths: list = field(default_factory=list)  # accepted draft tokens per verify step
    seconds: float = 0.0
    timer: Timer = field(default_factory=Timer)

    @property
    def tau(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the bonus token)."""
        return 1 + sum(self.accept_lengths) / max(1, len(self.accept_lengths))


class Target:
    """The HF target with a DynamicCache: forwards that also return the head's features."""

    def __init__(self, model, aux_layers=(2, 15, 27)):
        from transformers import DynamicCache

        self.model = model.eval()
        self.aux_layers = tuple(aux_layers)
        self._cache_cls = DynamicCache

    def new_cache(self):
        return self._cache_cls(config=self.model.config)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache, bias: torch.Tensor | None = None,
                features: bool = True):
        """ids/positions [N]; bias [N, cache_len + N] additive float (None: causal).

        Returns (logits [N, V], aux [N, n_aux, H] or None, final [N, H])."""
        captured = {}
        hooks = []
        if features:
            for idx in self.aux_layers:
                def hook(module, args, kw, idx=idx):
                    captured[idx] = args[0] if args else kw["hidden_states"]
                hooks.append(self.model.model.layers[idx].register_forward_pre_hook(hook, with_kwargs=True))
        mask = None if bias is None else bias.to(self.model.dtype)[None, None]
        try:
            out = self.model.model(input_ids=ids[None], position_ids=positions[None], past_key_values=cache,
                                   attention_mask=mask, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        final = out.last_hidden_state[0]
        logits = self.model.lm_head(final)
        aux = torch.stack([captured[i][0] for i in self.aux_layers], 1) if features and self.aux_layers else None
        return logits, aux, final

    @staticmethod
    def kv_views(cache) -> list:
        """Each layer's K and V as [slots, 1, H, D] views (slot = position) for move_accepted_kv."""
        views = []
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                views.append(t[0].transpose(0, 1).unsqueeze(1))
        return views


@dataclass
class _State:
    """What one speculative iteration reads and updates."""

    cache: object  # the target's DynamicCache, length kv_len
    draft_k: torch.Tensor  # the head's KV of the context [kv_len, Hkv, D]
    draft_v: torch.Tensor
    last_logits: torch.Tensor  # the head's output at position kv_len - 1 (ranks the root's children)
    last_hidden: torch.Tensor
    kv_len: int  # target cache length == head cache length == position of the root
    root: int  # the last emitted token, not yet in either cache


# ------------------------------------------------- the pure sub-steps
# Batched over R requests and engine-free: the adapters' tests run them as the
# per-step oracle on the pools their engines drafted.


def select_tree(scores: torch.Tensor, parent_list: torch.Tensor, shape: TreeShape, impl: str = "torch"):
    """select: [R, T - 1] pool indices of the T - 1 best candidates of each
    pool (scores [R, P], parent_list [R, 1 + (S-1)K]), ancestor-closed."""
    return stk.select_tree_nodes(scores, parent_list, shape.topk, shape.num_steps, shape.num_draft_tokens, impl=impl)


def build_verify_tree(pool_tokens: torch.Tensor, parent_list: torch.Tensor, selected: torch.Tensor,
                      roots: torch.Tensor, kv_lens: torch.Tensor, shape: TreeShape, impl: str = "torch"):
    """build: the verify trees of the selected candidates under each root.
    Returns (candidates [R, T] node tokens, node 0 the root; ``stk.TreeBuild``
    with positions kv_len + depth, the QLEN_ONLY ancestor mask and the
    first-child / next-sibling links)."""
    tree = stk.build_tree(selected, parent_list, kv_lens, shape.topk, shape.num_steps, stk.TreeMaskMode.QLEN_ONLY,
                          impl=impl)
    return torch.cat([roots[:, None], pool_tokens.gather(1, selected)], 1), tree


def walk_tree(candidates: torch.Tensor, tree, logits: torch.Tensor, num_steps: int,
              sampling: "Sampling | None" = None, impl: str = "torch"):
    """walk: the verify walk over the target's logits [R, T, V] at the nodes of
    ``build_verify_tree``'s trees: greedy (argmax) when ``sampling`` is None,
    else target-only recursive rejection (``sampling_probs`` at every node).
    Returns ``stk.VerifyResult``."""
    links = (tree.retrieve_next_token, tree.retrieve_next_sibling)
    if sampling is None:
        return stk.verify_tree_greedy(candidates, *links, logits.argmax(-1), num_steps, impl=impl)
    if logits.shape[0] != 1:
        raise ValueError(f"a sampled walk takes one request (a Sampling holds one request's generator), "
                         f"got {logits.shape[0]}")
    probs = sampling.probs(logits[0])
    coins, exponentials = sampling.randoms(probs.shape[0], probs.shape[1], probs.dtype)
    return stk.verify_tree_sampling(candidates, *links, probs[None], coins, exponentials, num_steps, impl=impl)


@dataclass
class _Tree:
    candidates: torch.Tensor  # [T] node tokens, node 0 = the root
    tree: object  # build_tree's result (positions, mask, links)
    bias: torch.Tensor  # [T, kv_len + T] additive verify mask


class TreeDecoder:
    def __init__(self, target_model, head, impl: str = "torch"):
        self.target = Target(target_model, head.c.aux_layer_ids if head.c.kind == "eagle3" else ())
        self.head = head.eval()
        self.kind = head.c.kind
        self.impl = impl  # spec_tree_kernels implementation ("torch" on CPU)
        self.eos = target_model.config.eos_token_id

    # ------------------------------------------------------------- baselines
    @torch.no_grad()
    def greedy(self, prompt_ids, max_new_tokens: int, stop_at_eos: bool = True) -> Output:
        """Plain greedy decoding, one target forward per token (the baseline)."""
        return self._autoregressive(prompt_ids, max_new_tokens, lambda logits: int(logits.argmax()), stop_at_eos)

    @torch.no_grad()
    def sample(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               seed: int | None = None, stop_at_eos: bool = True) -> Output:
        """Plain sampling from ``sampling_probs``, one target forward per token (the
        baseline ``generate(temperature > 0)`` matches in distribution)."""
        sampling = Sampling.create(temperature, top_k, top_p, seed)
        return self._autoregressive(prompt_ids, max_new_tokens, sampling.draw, stop_at_eos)

    def _autoregressive(self, prompt_ids, max_new_tokens: int, pick, stop_at_eos: bool) -> Output:
        out = Output(tokens=[])
        t0 = time.perf_counter()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        cache = self.target.new_cache()
        logits, _, _ = self.target.forward(ids, torch.arange(len(ids)), cache, features=False)
        pos = len(ids)
        while True:
            tok = pick(logits[-1])
            out.tokens.append(tok)
            if len(out.tokens) >= max_new_tokens or (stop_at_eos and tok == self.eos):
                break
            t1 = time.perf_counter()
            logits, _, _ = self.target.forward(torch.tensor([tok]), torch.tensor([pos]), cache, features=False)
            out.timer.add("target_1", time.perf_counter() - t1)
            pos += 1
        out.seconds = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------- speculative
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, num_steps: int, topk: int, num_draft_tokens: int,
                 stop_at_eos: bool = True, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None) -> Output:
        """Tree speculative decoding. temperature 0: greedy (token-identical to
        ``greedy``); temperature > 0: distributed as ``sample`` with the same
        temperature / top_p / top_k (randoms from a generator seeded by ``seed``;
        None: a fresh seed)."""
        shape = TreeShape(num_steps, topk, num_draft_tokens)
        return self._speculate(prompt_ids, shape, max_new_tokens, stop_at_eos, temperature, top_p, top_k, seed)

    def _speculate(self, prompt_ids, shape, max_new_tokens: int, stop_at_eos: bool, temperature: float,
                   top_p: float, top_k: int, seed: int | None) -> Output:
        """Prefill, then ``step`` until ``max_new_tokens`` or EOS (any shape ``step`` takes)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        sampling = Sampling.create(temperature, top_k, top_p, seed) if temperature > 0 else None
        out = Output(tokens=[])
        t0 = time.perf_counter()
        state = self._prefill(torch.as_tensor(prompt_ids, dtype=torch.long), sampling, out)
        while len(out.tokens) < max_new_tokens and not (stop_at_eos and out.tokens[-1] == self.eos):
            emitted = self.step(state, shape, sampling, out.timer)
            out.accept_lengths.append(len(emitted) - 1)
            out.tokens.extend(emitted)
            if stop_at_eos and self.eos in emitted:
                break
        if stop_at_eos and self.eos in out.tokens:
            out.tokens = out.tokens[: out.tokens.index(self.eos) + 1]
        out.tokens = out.tokens[:max_new_tokens]
        out.seconds = time.perf_counter() - t0
        return out

    def step(self, state: "_State", shape: TreeShape, sampling: "Sampling | None", timer: Timer) -> list[int]:
        """One speculative iteration; returns the emitted tokens (the accepted
        drafts, then the bonus token, which is the next root)."""
        with timer.section("draft_tree"):
            pool = self._draft(state, shape, timer)
        with timer.section("tree_ops"):
            selected = self._select(pool, shape)
            tree = self._build(state, pool, selected, shape)
        with timer.section("verify"):
            logits, aux, final = self.target.forward(tree.candidates, tree.tree.positions[0], state.cache, tree.bias)
        with timer.section("tree_ops"):
            res = self._walk(tree, logits, shape.num_steps, sampling)
            emitted, path = self._move(state, res, shape.num_draft_tokens)
        with timer.section("draft_extend"):
            self._extend(state, emitted, path, aux, final)
        return emitted.tolist()

    def _features(self, aux, final):
        return self.head.fuse(aux if self.kind == "eagle3" else final)

    def _prefill(self, ids: torch.Tensor, sampling: Sampling | None, out: Output) -> _State:
        """Prefill the target and pick the first root (bonus) token from its last
        logits (argmax, or a draw from ``sampling_probs``); prefill the head:
        position p reads token p + 1 and the target's features at p."""
        n = len(ids)
        cache = self.target.new_cache()
        logits, aux, final = self.target.forward(ids, torch.arange(n), cache)
        root = int(logits[-1].argmax()) if sampling is None else sampling.draw(logits[-1])
        out.tokens.append(root)
        with out.timer.section("draft_prefill"):
            d_logits, d_hidden, dk, dv = self.head.step(torch.cat([ids[1:], torch.tensor([root])]),
                                                        self._features(aux, final), torch.arange(n))
        return _State(cache, dk, dv, d_logits[-1], d_hidden[-1], kv_len=n, root=root)

    def _draft(self, state: _State, shape: TreeShape, timer: Timer):
        """The candidate pool: (scores [P], pool_tokens [P], parent_list)."""
        return expand_head_pool(self.head, state.last_logits, state.last_hidden, state.draft_k, state.draft_v,
                                state.kv_len, shape.num_steps, shape.topk, timer.add)

    def _select(self, pool, shape: TreeShape) -> torch.Tensor:
        scores, _, parent_list = pool
        return select_tree(scores[None], parent_list[None], shape, self.impl)

    def _build(self, state: _State, pool, selected: torch.Tensor, shape: TreeShape) -> _Tree:
        """The verify tree and the target's additive mask over its cache."""
        _, pool_tokens, parent_list = pool
        kv_len, T = state.kv_len, shape.num_draft_tokens
        candidates, tree = build_verify_tree(pool_tokens[None], parent_list[None], selected,
                                             torch.tensor([state.root]), torch.tensor([kv_len]), shape, self.impl)
        bias = torch.zeros(T, kv_len + T)
        bias[:, kv_len:] = torch.where(tree.tree_mask.view(T, T), 0.0, float("-inf"))
        return _Tree(candidates[0], tree, bias)

    def _walk(self, t: _Tree, logits: torch.Tensor, num_steps: int, sampling: Sampling | None):
        return walk_tree(t.candidates[None], t.tree, logits[None], num_steps, sampling, self.impl)

    def _move(self, state: _State, res, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV compaction: the accepted nodes' rows to slots kv_len .. kv_len + acc,
        the rejected tail cropped (cache length kv_len + acc + 1). Returns the
        emitted tokens and the accepted nodes (tree indices)."""
        T, acc = num_draft_tokens, int(res.accept_length[0])
        stk.move_accepted_kv(self.target.kv_views(state.cache), state.kv_len + torch.arange(T)[None],
                             res.accept_index, res.accept_length, impl=self.impl)
        if T - acc - 1 > 0:
            state.cache.crop(-(T - acc - 1))
        return res.accept_tokens[0, : acc + 1], res.accept_index[0, : acc + 1].long()

    def _extend(self, state: _State, emitted: torch.Tensor, path: torch.Tensor, aux, final) -> None:
        """The head catches up over the accepted nodes (their tokens' successors
        and the target's features there); the last emitted token is the next root."""
        n = len(emitted)
        features = self._features(aux[path] if aux is not None else None, final[path])
        d_logits, d_hidden, k, v = self.head.step(emitted, features, state.kv_len + torch.arange(n), state.draft_k,
                                                  state.draft_v)
        state.draft_k, state.draft_v = torch.cat([state.draft_k, k]), torch.cat([state.draft_v, v])
        state.last_logits, state.last_hidden = d_logits[-1], d_hidden[-1]
        state.kv_len += n
        state.root = int(emitted[-1])
