"""DDTree over a DFlash block drafter, engine-free (``spec_plugins.block_decoder``).

* the drafter's training forward (many blocks per sequence under one
  block-diagonal mask) is the drafting forward vLLM runs (one block over the
  committed context), row for row;
* its checkpoint round-trips and says what vLLM's DFlash loader reads;
* greedy DDTree and chain decoding are token-identical to plain greedy
  decoding, on a tiny target and on SmolLM2 with the shipped, trained drafter
  (where acceptance is deep, and the tree accepts more per step than the chain);
* sampled DDTree is distributed exactly as plain sampling (chi-square), and the
  test catches a verify path at the wrong temperature.

Needs transformers (the .venv-vllm venv).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the .venv-vllm venv, ci/setup_model_venv.sh)")
pytest.importorskip("transformers", reason="transformers is not installed (the .venv-vllm venv, ci/setup_model_venv.sh)")

import tiny  # noqa: E402  (tests/model/tiny.py)

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import chisquare  # noqa: E402  (tests/chisquare.py)

from spec_plugins.block_decoder import BlockTreeDecoder  # noqa: E402
from spec_plugins.heads.dflash_head import DFlashConfig, DFlashDrafter  # noqa: E402
from spec_plugins.training.train_dflash import block_inputs, sample_anchors  # noqa: E402


def tiny_drafter(target, seed: int = 1, block_size: int = 5) -> DFlashDrafter:
    """A random DFlash drafter over a tiny target's layers 0..2 (inputs of 1..3)."""
    c = target.config
    cfg = DFlashConfig(hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=c.hidden_size // 4, num_hidden_layers=2,
                       vocab_size=c.vocab_size, block_size=block_size, mask_token_id=c.vocab_size - 1,
                       target_layer_ids=[0, 1, 2], num_target_layers=c.num_hidden_layers, rope_theta=10000.0)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).to(torch.float64)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
        drafter.mask_embedding.normal_(0, 1.0)
    return drafter.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight).eval()


def test_training_forward_is_the_drafting_forward():
    target = tiny.tiny_target(seed=2)
    drafter = tiny_drafter(target, block_size=6)
    B, S = 2, 30
    ids = torch.randint(3, 90, (B, S), generator=torch.Generator().manual_seed(0))
    length, prompt_len = torch.tensor([30, 21]), torch.tensor([4, 7])
    features = torch.randn(B, S, 3, target.config.hidden_size, dtype=torch.float64)
    anchors = sample_anchors(length, prompt_len, 6, torch.Generator().manual_seed(0))
    tokens, positions, visible, _, _ = block_inputs(drafter.c, ids, length, anchors)
    hidden = drafter(drafter.context(features), torch.arange(S).expand(B, S), tokens, positions, visible)
    together = drafter.logits(hidden).log_softmax(-1).unflatten(1, (6, drafter.c.block_size))[:, :, 1:]
    for b in range(B):
        for m in range(6):
            a = int(anchors[b, m])
            alone = drafter.draft_block(features[b, :a], int(ids[b, a]))
            torch.testing.assert_close(together[b, m], alone, rtol=1e-9, atol=1e-9)
    # a mask that lets blocks see each other is NOT the drafting forward
    leaky = torch.ones_like(visible)
    hidden = drafter(drafter.context(features), torch.arange(S).expand(B, S), tokens, positions, leaky)
    assert not torch.allclose(drafter.logits(hidden).log_softmax(-1).unflatten(1, (6, 6))[:, :, 1:], together)


def test_checkpoint_round_trips_in_vllms_dflash_format(tmp_path):
    target = tiny.tiny_target(seed=2)
    drafter = tiny_drafter(target)
    drafter.save(tmp_path, dtype=torch.float64)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]  # vLLM's registry: qwen3_dflash.DFlashQwen3ForCausalLM
    assert cfg["dflash_config"] == {"mask_token_id": target.config.vocab_size - 1, "target_layer_ids": [0, 1, 2]}
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any("embed_tokens" in n or "lm_head" in n or "mask" in n for n in names), names  # shared / separate
    again = DFlashDrafter.load(tmp_path, dtype=torch.float64).attach_target(
        target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    features = torch.randn(9, 3, target.config.hidden_size, dtype=torch.float64)
    assert torch.equal(again.draft_block(features, 5), drafter.draft_block(features, 5))
    torch.save({"mask_token_id": 3, "embedding": drafter.mask_embedding.detach()}, tmp_path / "mask_embedding.pt")
    with pytest.raises(ValueError, match="mask_token_id 3"):
        DFlashDrafter.load(tmp_path)


# (topk, num_nodes): the chain (topk 1, the block's L drafts), narrow and wide trees, a node budget below L
SHAPES = [(1, 4), (2, 6), (4, 12), (3, 3), (4, 30)]


@pytest.mark.parametrize("topk,num_nodes", SHAPES)
def test_greedy_ddtree_is_token_identical_on_a_tiny_target(topk, num_nodes):
    target = tiny.tiny_target(seed=5)
    dec = BlockTreeDecoder(target, tiny_drafter(target, seed=6))
    for seed in range(3):
        prompt = torch.randint(3, 90, (7 + seed,), generator=torch.Generator().manual_seed(seed))
        out = dec.generate(prompt, 24, topk, num_nodes, stop_at_eos=False)
        assert out.tokens == dec.greedy(prompt, 24, stop_at_eos=False).tokens, (topk, num_nodes, seed)


class OracleBlockDecoder(BlockTreeDecoder):
    """TEST DOUBLE for the drafter's distributions only: it knows the greedy
    continuation ``reference`` (prompt + greedy tokens) and drafts log-probs that
    rank the true token at a random place (sometimes below the top-K, so
    rejections occur at every depth). The tree build, verify, walk and KV move
    are the production path; a random drafter would rarely be accepted."""

    def __init__(self, target, drafter, reference, seed=0):
        super().__init__(target, drafter)
        self.reference, self.gen = reference, torch.Generator().manual_seed(seed)

    def _draft(self, state, shape):
        from spec_plugins.tree_drafting import block_topk, block_trees

        L, V = self.drafter.c.num_masks, self.drafter.c.vocab_size
        logits = 4 * torch.randn(L, V, generator=self.gen, dtype=torch.float64)  # peaked, as trained drafters are
        for i in range(L):
            pos = state.kv_len + 1 + i
            if pos < len(self.reference):
                rank = int(torch.randint(0, shape.topk + 1, (1,), generator=self.gen))
                order = logits[i].argsort(descending=True)
                true = self.reference[pos]
                other = int(order[rank]) if int(order[rank]) != true else int(order[(rank + 1) % V])
                logits[i, true], logits[i, other] = logits[i, other].clone(), logits[i, true].clone()
        values, tokens = block_topk(logits.log_softmax(-1)[None], shape.topk)
        return block_trees(values, tokens, shape.num_nodes, impl=self.impl)


@pytest.mark.parametrize("topk,num_nodes", [(2, 6), (4, 12), (3, 30)])
def test_greedy_ddtree_accepts_deep_paths_and_stays_identical(topk, num_nodes):
    target = tiny.tiny_target(seed=5)
    drafter = tiny_drafter(target, seed=6)
    plain = BlockTreeDecoder(target, drafter)
    accepted = []
    for seed in range(3):
        prompt = torch.randint(3, 90, (7 + seed,), generator=torch.Generator().manual_seed(seed))
        ref = plain.greedy(prompt, 40, stop_at_eos=False).tokens
        dec = OracleBlockDecoder(target, drafter, prompt.tolist() + ref, seed)
        out = dec.generate(prompt, 40, topk, num_nodes, stop_at_eos=False)
        assert out.tokens == ref, (topk, num_nodes, seed)
        accepted += out.accept_lengths
    hist = torch.bincount(torch.tensor(accepted), minlength=5)
    deep = 3 if num_nodes >= 12 else 2  # a 6-node tree rarely holds three true levels
    assert hist[0] > 0 and hist[deep:].sum() > 0, f"accept lengths {hist.tolist()}: rejections or deep paths missing"


def test_greedy_ddtree_stops_at_eos_like_greedy():
    target = tiny.tiny_target(seed=5)
    dec = BlockTreeDecoder(target, tiny_drafter(target, seed=6))
    prompt = torch.randint(3, 90, (8,), generator=torch.Generator().manual_seed(1))
    ref = dec.greedy(prompt, 40, stop_at_eos=False).tokens
    dec.eos = ref[12]  # a token greedy emits: generation must end right after its first occurrence
    want = ref[: ref.index(dec.eos) + 1]
    assert dec.generate(prompt, 40, 4, 12).tokens == want == dec.greedy(prompt, 40).tokens


# --------------------------------------------------------------------------- sampled
TEMPERATURE, TOP_P = 0.8, 0.9
N_SEEDS, ALPHA, POOL_BELOW = 1000, 1e-3, 10
PROMPT = torch.randint(3, 16, (8,), generator=torch.Generator().manual_seed(0))


def sampling_decoder(cls=BlockTreeDecoder):
    """A 16-token target whose next token is mostly a bigram (a handful of likely
    tokens at temperature 0.8), as in test_reference_decoder_sampling."""
    target = tiny.tiny_target(vocab=16, engineered=True)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(10.0)
            layer.mlp.down_proj.weight.mul_(10.0)
    return cls(target, tiny_drafter(target, seed=3, block_size=3))


class HotterTreePath(BlockTreeDecoder):
    """Negative control: the tree nodes' distribution at temperature x 1.5."""

    def _walk(self, t, logits, num_steps, sampling):
        return super()._walk(t, logits, num_steps, dataclasses.replace(sampling, temperature=sampling.temperature * 1.5))


def counts(run, seeds) -> collections.Counter:
    return collections.Counter(tuple(run(s).tokens) for s in seeds)


@pytest.fixture(scope="module")
def plain_sampling():
    dec = sampling_decoder()
    return counts(lambda s: dec.sample(PROMPT, 3, TEMPERATURE, TOP_P, seed=s, stop_at_eos=False), range(N_SEEDS))


def tree_counts(dec, n, accept_lengths=None):
    def run(seed):
        out = dec.generate(PROMPT, 3, 4, 8, stop_at_eos=False, temperature=TEMPERATURE, top_p=TOP_P, seed=seed)
        if accept_lengths is not None:
            accept_lengths.extend(out.accept_lengths)
        return out

    return counts(run, range(10**6, 10**6 + n))


def test_sampled_ddtree_matches_plain_sampling_in_distribution(plain_sampling):
    accept_lengths = []
    stat, df, p = chisquare.two_sample(plain_sampling, tree_counts(sampling_decoder(), N_SEEDS, accept_lengths),
                                       min_count=POOL_BELOW)
    assert df >= 10, f"too few outcome bins ({df + 1}): the test has little power"
    assert p > ALPHA, f"DDTree sampling differs from plain sampling: chi2 {stat:.1f}, df {df}, p {p:.2e}"
    hist = torch.bincount(torch.tensor(accept_lengths), minlength=3)
    assert hist[0] > 0 and hist[1:].sum() > 0 and hist[2:].sum() > 0, \
        f"accept-length histogram {hist.tolist()}: the accept or reject path went untested"


def test_distribution_test_detects_a_wrong_tree_temperature(plain_sampling):
    stat, df, p = chisquare.two_sample(plain_sampling, tree_counts(sampling_decoder(HotterTreePath), 300),
                                       min_count=POOL_BELOW)
    assert p < ALPHA, f"a tree path at temperature x 1.5 went unnoticed: chi2 {stat:.1f}, df {df}, p {p:.2e}"
