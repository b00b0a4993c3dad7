"""A small, readable EAGLE tree speculative decoder on HF transformers.

The engine-free oracle for the vLLM/SGLang integrations and the tool that
measures acceptance length (tau) on real text. Batch 1, greedy, any tree shape:

    dec = TreeDecoder(target, head)                      # HF LlamaForCausalLM + spec_plugins.heads.EagleHead
    out = dec.generate(prompt_ids, max_new_tokens=128, num_steps=5, topk=4, num_draft_tokens=8)
    out.tokens == dec.greedy(prompt_ids, 128).tokens     # lossless

One iteration (SGLang's EAGLE-2 pipeline, with ``spec_tree_kernels`` ops):

1. draft: the head expands the root's top-k children, then num_steps - 1
   forwards grow the k best paths by cumulative probability; every candidate
   goes to a pool (K + (S-1) K^2 scores, SGLang's order and parent_list);
2. ``select_tree_nodes`` keeps the T - 1 best (ancestor-closed), ``build_tree``
   gives positions (context + depth), the QLEN_ONLY ancestor mask and the
   first-child / next-sibling links;
3. verify: one target forward over the T nodes with a float 4D additive mask
   (prefix visible, tree columns = ancestors-or-self) over the KV cache;
4. ``verify_tree_greedy`` walks the tree with the target's argmax;
5. ``move_accepted_kv`` compacts the accepted path's KV to the front of the
   verify slots, the cache is cropped behind it;
6. the head extends its own KV cache over the accepted tokens (with the target's
   features at the accepted nodes), producing the next root's distribution.

The chain is the degenerate tree: topk = 1, num_draft_tokens = num_steps + 1.
Draft forwards per iteration S = num_steps (num_steps - 1 tree steps + 1 extend).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

import spec_tree_kernels as stk
from spec_plugins.tree_drafting import draft_pool


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


class TreeDecoder:
    def __init__(self, target_model, head, impl: str = "torch"):
        self.target = Target(target_model, head.c.aux_layer_ids if head.c.kind == "eagle3" else ())
        self.head = head.eval()
        self.kind = head.c.kind
        self.impl = impl  # spec_tree_kernels implementation ("torch" on CPU)
        self.eos = target_model.config.eos_token_id

    # ------------------------------------------------------------------ greedy
    @torch.no_grad()
    def greedy(self, prompt_ids, max_new_tokens: int, stop_at_eos: bool = True) -> Output:
        """Plain greedy decoding, one target forward per token (the baseline)."""
        out = Output(tokens=[])
        t0 = time.perf_counter()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        cache = self.target.new_cache()
        logits, _, _ = self.target.forward(ids, torch.arange(len(ids)), cache, features=False)
        pos = len(ids)
        while True:
            tok = int(logits[-1].argmax())
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
    def _features(self, aux, final):
        return self.head.fuse(aux if self.kind == "eagle3" else final)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, num_steps: int, topk: int, num_draft_tokens: int,
                 stop_at_eos: bool = True) -> Output:
        stk.validate_tree_shape(num_steps, topk, num_draft_tokens)
        out = Output(tokens=[])
        tm = out.timer
        t0 = time.perf_counter()
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        n = len(ids)
        cache = self.target.new_cache()
        # Prefill the target; its argmax is the first root (bonus) token.
        logits, aux, final = self.target.forward(ids, torch.arange(n), cache)
        root = int(logits[-1].argmax())
        out.tokens.append(root)
        # Prefill the head: position p reads token p + 1 and the target's features at p.
        t1 = time.perf_counter()
        d_logits, d_hidden, dk, dv = self.head.step(torch.cat([ids[1:], torch.tensor([root])]),
                                                    self._features(aux, final), torch.arange(n))
        tm.add("draft_prefill", time.perf_counter() - t1)
        last_logits, last_hidden = d_logits[-1], d_hidden[-1]
        kv_len = n  # target cache length == head cache length == position of the root
        while len(out.tokens) < max_new_tokens and not (stop_at_eos and out.tokens[-1] == self.eos):
            # 1. draft the pool
            t1 = time.perf_counter()
            scores, pool_tokens, parent_list = draft_pool(self.head, last_logits, last_hidden, dk, dv, kv_len,
                                                          num_steps, topk, tm.add)
            tm.add("draft_tree", time.perf_counter() - t1)
            # 2. select + build
            t1 = time.perf_counter()
            selected = stk.select_tree_nodes(scores[None], parent_list[None], topk, num_steps, num_draft_tokens,
                                             impl=self.impl)
            tree = stk.build_tree(selected, parent_list[None], torch.tensor([kv_len]), topk, num_steps,
                                  stk.TreeMaskMode.QLEN_ONLY, impl=self.impl)
            T = num_draft_tokens
            candidates = torch.cat([torch.tensor([root]), pool_tokens[selected[0]]])
            anc = tree.tree_mask.view(T, T)
            bias = torch.zeros(T, kv_len + T)
            bias[:, kv_len:] = torch.where(anc, 0.0, float("-inf"))
            tm.add("tree_ops", time.perf_counter() - t1)
            # 3. verify
            t1 = time.perf_counter()
            logits, aux, final = self.target.forward(candidates, tree.positions[0], cache, bias)
            tm.add("verify", time.perf_counter() - t1)
            # 4. greedy walk
            t1 = time.perf_counter()
            predict = logits.argmax(-1)
            res = stk.verify_tree_greedy(candidates[None], tree.retrieve_next_token, tree.retrieve_next_sibling,
                                         predict[None], num_steps, impl=self.impl)
            acc = int(res.accept_length[0])
            path = res.accept_index[0, : acc + 1].long()
            emitted = res.accept_tokens[0, : acc + 1]
            # 5. KV compaction: accepted nodes' rows to slots kv_len .. kv_len + acc
            stk.move_accepted_kv(self.target.kv_views(cache), kv_len + torch.arange(T)[None], res.accept_index,
                                 res.accept_length, impl=self.impl)
            if T - acc - 1 > 0:
                cache.crop(-(T - acc - 1))  # drop the rejected tail: cache length kv_len + acc + 1
            tm.add("tree_ops", time.perf_counter() - t1)
            out.accept_lengths.append(acc)
            out.tokens.extend(int(t) for t in emitted)
            # 6. the head catches up over the accepted nodes
            t1 = time.perf_counter()
            d_logits, d_hidden, k, v = self.head.step(emitted, self._features(aux[path] if aux is not None else None,
                                                                               final[path]),
                                                      kv_len + torch.arange(acc + 1), dk, dv)
            tm.add("draft_extend", time.perf_counter() - t1)
            dk, dv = torch.cat([dk, k]), torch.cat([dv, v])
            last_logits, last_hidden = d_logits[-1], d_hidden[-1]
            kv_len += acc + 1
            root = int(emitted[-1])
            if stop_at_eos and self.eos in emitted.tolist():
                break
        if stop_at_eos and self.eos in out.tokens:
            out.tokens = out.tokens[: out.tokens.index(self.eos) + 1]
        out.tokens = out.tokens[:max_new_tokens]
        out.seconds = time.perf_counter() - t0
        return out
