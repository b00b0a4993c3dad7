"""Issue 52, item 4: DFlash block drafters and SGLang 0.5.23.

Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1`` (see
test_plugin_registration.py). SGLang 0.5.23 has a DFlash path
(``--speculative-algorithm DFLASH``: ``dflash_worker_v2.DFlashWorkerV2``), but
it drafts and verifies one chain per step, and EAGLE_TREE runs SGLang's EAGLE
worker, which cannot run a block drafter; so EAGLE_TREE refuses a DFlash
drafter at startup, naming why (``config.block_drafter_refusal``), and
SGLang's own DFLASH keeps working with our plugin installed.

What a future DDTree integration in SGLang's DFlash worker would rest on is
checked here against SGLang's own code, with our shipped drafter
(``spec_plugins/heads/smollm2-135m-dflash``):

* SGLang's config parser (``dflash_utils.parse_dflash_draft_config``) reads
  our drafter's block size, mask token and target layers as we do;
* SGLang's target captures the features our drafter was trained on
  (``LlamaForCausalLM.set_dflash_layers_to_capture``: target_layer_ids + 1);
* SGLang's block rows (its Triton ``_prepare_dflash_draft_block_unchecked``)
  are our drafter's query rows (``DFlashDrafter.block_query``);
* SGLang merges our shipped ``mask_embedding.pt`` into the target's table
  (``DFlashWorkerV2._maybe_merge_trained_mask_embedding``) as our drafter
  embeds its mask rows;
* SGLang's per-position greedy draft (``_greedy_sample_from_vocab_parallel_head``
  over the mask rows) is the rank-0 token of our ``block_topk``: DDTree's
  top-1 path is SGLang's chain;
* SGLang's chain acceptance (``compute_dflash_correct_drafts_and_bonus``, its
  torch path and its Triton kernel) equals our tree verify of the topk = 1
  DDTree tree (``block_trees`` -> ``tree_from_parents`` -> ``verify_tree_greedy``).

Test doubles: ``torchvision`` (``spec_plugins.sglang_ext._testing``); the
``self`` of two SGLang methods that cannot be built without a loaded model and
a GPU (a namespace with exactly the fields the method reads:
``set_dflash_layers_to_capture``'s model and pipeline rank,
``_maybe_merge_trained_mask_embedding``'s server args, device, mask token and
target model). ``_greedy_sample_from_vocab_parallel_head`` reads nothing of
``self`` for an unsharded head.
"""

from __future__ import annotations

import importlib
import json
import re
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.kernels.ops.speculative import dflash as sgl_dflash_ops  # noqa: E402
from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config  # noqa: E402
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

import spec_tree_kernels as stk  # noqa: E402
from spec_plugins.heads import drafter_path  # noqa: E402
from spec_plugins.heads.dflash_head import MASK_EMBEDDING_FILE, DFlashConfig, DFlashDrafter  # noqa: E402
from spec_plugins.sglang_ext import config  # noqa: E402
from spec_plugins.tree_drafting import block_topk, block_trees  # noqa: E402
# its fixtures: config-only checkpoints, and the user's knobs unset
from test_plugin_registration import ckpt, clean_env  # noqa: E402, F401

pytestmark = pytest.mark.sglang

DRAFTER = drafter_path("dflash")
DRAFTER_CONFIG = json.loads((DRAFTER / "config.json").read_text())


@pytest.fixture(scope="module")
def drafter():
    return DFlashDrafter.load(DRAFTER)


def parse_cli(ckpt, draft_path, algorithm="EAGLE_TREE", *extra):
    """SGLang's own CLI parsing (``prepare_server_args``), then its resolution."""
    from sglang.srt.server_args import prepare_server_args

    argv = [
        "--model-path", ckpt["target"], "--speculative-algorithm", algorithm,
        "--speculative-draft-model-path", str(draft_path), "--skip-tokenizer-init", *extra,
    ]  # fmt: skip
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


# ----------------------------------------------------- startup: the refusal


def test_eagle_tree_refuses_a_dflash_drafter_naming_the_option_and_why(ckpt, monkeypatch):
    why = (
        r"--speculative-draft-model-path '.*smollm2-135m-dflash' is a DFlash block drafter "
        r"\(architectures \['DFlashDraftModel'\]\); --speculative-algorithm EAGLE_TREE cannot serve it.*"
        r"DFlashWorkerV2.*_greedy_sample_from_vocab_parallel_head.*custom_mask=None.*"
        r"compute_dflash_correct_drafts_and_bonus.*Use --speculative-algorithm DFLASH"
    )
    with pytest.raises(ValueError, match=why):
        parse_cli(ckpt, DRAFTER, "EAGLE_TREE", "--attention-backend", config.BACKEND_TORCH, "--device", "cpu")
    # the user's variant does not skip the check (it would load the drafter as an EAGLE head)
    monkeypatch.setenv(config.VARIANT_ENV, "EAGLE")
    with pytest.raises(ValueError, match=why):
        parse_cli(ckpt, DRAFTER, "EAGLE_TREE", "--attention-backend", "triton", "--device", "cpu")


def test_a_dflash_config_entry_alone_marks_a_block_drafter(ckpt, tmp_path):
    """A DFlash checkpoint whose architecture SGLang spells otherwise (or a
    later release adds) still carries the field SGLang's DFlash parser reads."""
    (tmp_path / "config.json").write_text(
        json.dumps(dict(DRAFTER_CONFIG, architectures=["LlamaForCausalLMEagle"]))
    )
    with pytest.raises(ValueError, match=r"is a DFlash block drafter \(a dflash_config entry\)"):
        parse_cli(ckpt, tmp_path, "EAGLE_TREE", "--attention-backend", config.BACKEND_TORCH, "--device", "cpu")
    # an EAGLE head is not: config.block_drafter_evidence reads only those two things
    assert config.block_drafter_evidence({"architectures": ["LlamaForCausalLMEagle3"]}) is None


def test_block_drafter_architectures_are_sglangs_dflash_models():
    """Every model SGLang 0.5.23 loads as a DFlash-family drafter (a
    ``DFlashDraftModel`` subclass in a module's ``EntryClass``), and nothing else."""
    import pathlib

    import sglang.srt.models as models
    from sglang.srt.models.dflash import DFlashDraftModel

    found = set()
    for source in sorted(pathlib.Path(list(models.__path__)[0]).glob("*.py")):
        if "DFlashDraftModel" not in source.read_text():
            continue  # a subclass names its base (or a module that does, which names it too)
        module = importlib.import_module(f"sglang.srt.models.{source.stem}")
        entries = getattr(module, "EntryClass", [])
        for cls in entries if isinstance(entries, (list, tuple)) else [entries]:
            if isinstance(cls, type) and issubclass(cls, DFlashDraftModel):
                found.add(cls.__name__)
    assert found == set(config.SGLANG_BLOCK_DRAFTER_ARCHITECTURES)


def test_sglangs_dflash_still_resolves_with_our_plugin(ckpt):
    """--speculative-algorithm DFLASH goes through our resolution hook
    untouched: SGLang's defaults from our drafter's config (one step, topk 1,
    a verify window of its block size), SGLang's DFlash spec and worker.
    ``--device cuda``: SGLang's DFlash step refuses other devices; resolution
    runs nothing on it."""
    view = resolved_view(parse_cli(ckpt, DRAFTER, "DFLASH", "--device", "cuda"))
    assert view.speculative_algorithm == "DFLASH"
    assert (view.speculative_num_steps, view.speculative_eagle_topk) == (1, 1)
    assert view.speculative_num_draft_tokens == DRAFTER_CONFIG["block_size"]
    algo = SpeculativeAlgorithm.from_string("DFLASH")
    assert algo.is_dflash() and not SpeculativeAlgorithm.from_string("EAGLE_TREE").is_dflash()
    # and our mask-mode flag is still refused there, as for every other algorithm
    with pytest.raises(ValueError, match=f"{config.MASK_MODE_FLAG} 'QLEN_ONLY' applies to --speculative-algorithm "
                                         "EAGLE_TREE only"):  # fmt: skip
        parse_cli(ckpt, DRAFTER, "DFLASH", "--device", "cuda", config.MASK_MODE_FLAG, "QLEN_ONLY")


def test_sglangs_dflash_path_is_one_chain_as_the_refusal_says(ckpt):
    """The facts ``config.block_drafter_refusal`` states: SGLang's DFlash
    resolution turns a tree's topk (and steps) into 1; its worker verifies
    with no tree mask and accepts with the chain rule; the functions it names
    exist in this SGLang."""
    import inspect
    import pkgutil

    view = resolved_view(parse_cli(ckpt, DRAFTER, "DFLASH", "--device", "cuda", "--speculative-num-steps", "3",
                                   "--speculative-eagle-topk", "4"))  # fmt: skip
    assert (view.speculative_num_steps, view.speculative_eagle_topk) == (1, 1)
    verify_source = inspect.getsource(DFlashWorkerV2.forward_batch_generation)
    assert "custom_mask = None" in verify_source and "GrammarTree.from_linear_chain(draft_tokens)" in verify_source
    assert "compute_dflash_correct_drafts_and_bonus" in inspect.getsource(DFlashWorkerV2._accept_block)
    message = config.block_drafter_refusal("p", "e")
    named = re.findall(r"\b_?[a-z]+(?:_[a-z0-9]+)+\b", message.split("DFlashWorkerV2")[1].split("DDTree")[0])
    assert named == [
        "_greedy_sample_from_vocab_parallel_head", "custom_mask", "compute_dflash_correct_drafts_and_bonus",
    ]  # fmt: skip
    assert callable(DFlashWorkerV2._greedy_sample_from_vocab_parallel_head)
    assert callable(sgl_dflash_ops.compute_dflash_correct_drafts_and_bonus)
    assert pkgutil.resolve_name("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2") is DFlashWorkerV2


# ------------------------------------- module-level equivalences with SGLang


def test_sglang_parses_our_drafters_config_as_we_do():
    from sglang.srt.utils.hf_transformers_utils import get_config

    ours = DFlashConfig.from_engine_config(DRAFTER_CONFIG)
    for hf_config in (get_config(str(DRAFTER), trust_remote_code=False), DRAFTER_CONFIG):
        parsed = parse_dflash_draft_config(draft_hf_config=hf_config)
        assert parsed.block_size == ours.block_size
        assert parsed.mask_token_id == ours.mask_token_id
        assert parsed.target_layer_ids == ours.target_layer_ids
        assert parsed.num_hidden_layers == ours.num_hidden_layers
        assert parsed.num_target_layers == ours.num_target_layers
        assert parsed.projector_type is None and not parsed.selector_rank  # plain DFlash: SGLang's argmax path
        assert parsed.resolve_target_layer_ids(target_num_layers=ours.num_target_layers) == ours.target_layer_ids
    # a config we write for another shape says the same to SGLang
    other = DFlashConfig(block_size=5, mask_token_id=3, target_layer_ids=[0, 2], num_target_layers=4)
    parsed = parse_dflash_draft_config(draft_hf_config=other.engine_config())
    assert (parsed.block_size, parsed.mask_token_id, parsed.target_layer_ids) == (5, 3, [0, 2])


def test_sglangs_target_captures_the_features_our_drafter_reads():
    from sglang.srt.models.llama import LlamaForCausalLM

    # the method's self: the fields it reads and writes (a loaded target needs a GPU)
    target = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace())
    LlamaForCausalLM.set_dflash_layers_to_capture(target, DRAFTER_CONFIG["dflash_config"]["target_layer_ids"])
    assert target.capture_aux_hidden_states
    assert target.model.layers_to_capture == DFlashConfig.from_engine_config(DRAFTER_CONFIG).capture_layers


def test_sglangs_block_rows_are_our_drafters_query_rows(drafter):
    """SGLang's Triton block preparation (bonus, then masks; positions from the
    committed length) against ``DFlashDrafter.block_query``, for a batch."""
    block_size = drafter.c.block_size
    bonus = torch.tensor([5, 900, 17], dtype=torch.int64)
    prefix = torch.tensor([3, 11, 0], dtype=torch.int64)
    req_to_token = torch.arange(4 * 32, dtype=torch.int32).view(4, 32)
    block_ids = torch.empty(3, block_size, dtype=torch.int64)
    positions = torch.empty_like(block_ids)
    cache_loc = torch.empty_like(block_ids)
    sgl_dflash_ops._prepare_dflash_draft_block_unchecked(
        bonus_tokens=bonus, prefix_lens=prefix, req_pool_indices=torch.tensor([2, 0, 3]), req_to_token=req_to_token,
        block_ids_out=block_ids, positions_out=positions, cache_loc_out=cache_loc,
        mask_token_id=drafter.c.mask_token_id,
    )  # fmt: skip
    for row in range(3):
        tokens, pos = drafter.block_query(int(bonus[row]), int(prefix[row]))
        assert torch.equal(block_ids[row], tokens[0]) and torch.equal(positions[row], pos[0])


def test_sglang_merges_our_mask_embedding_as_our_drafter_embeds_mask_rows(ckpt, drafter):
    """``mask_embedding.pt`` as we ship it is what SGLang's DFlash worker loads
    into the target's embedding table; looked up there, the mask row is our
    drafter's mask embedding and the other rows are the target's."""
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="DFLASH", speculative_draft_model_path=str(DRAFTER),
        device="cuda",
    )  # fmt: skip
    _testing.publish(server_args)
    vocab, hidden = drafter.c.vocab_size, drafter.c.hidden_size
    table = torch.nn.Embedding(vocab, hidden)
    torch.nn.init.normal_(table.weight, generator=torch.Generator().manual_seed(0))
    target_rows = table.weight.detach().clone()
    target = types.SimpleNamespace(get_input_embeddings=lambda: table)
    # the method's self: the fields it reads (the worker needs a loaded target on a GPU)
    worker = types.SimpleNamespace(
        server_args=server_args, device="cpu", _mask_token_id=drafter.c.mask_token_id,
        _target_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=target)),
    )  # fmt: skip
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):  # one rank: an unsharded table (its log line reads the rank)
        DFlashWorkerV2._maybe_merge_trained_mask_embedding(worker)
    tokens, _ = drafter.block_query(bonus=7, start=0, num_masks=3)
    ours = drafter.attach_target(target_rows, target_rows).embed_block(tokens)
    with torch.no_grad():
        assert torch.equal(table(tokens), ours)
    assert (DRAFTER / MASK_EMBEDDING_FILE).is_file()


def test_sglangs_greedy_block_is_the_top1_of_our_block_topk(drafter):
    """SGLang drafts each mask row's argmax through the target's LM head
    (rows 1.. of the block's hidden states); our ``block_topk`` rank 0 over
    ``draft_block`` is the same chain, so DDTree's top-1 path is SGLang's."""
    gen = torch.Generator().manual_seed(1)
    H, V = drafter.c.hidden_size, drafter.c.vocab_size
    embed = torch.randn(V, H, generator=gen) * 0.05
    features = torch.randn(9, len(drafter.c.target_layer_ids), H, generator=gen)
    hidden = drafter.attach_target(embed, embed).block_hidden(features, bonus=1000)
    # A target head under which each block row has its own argmax (row i's
    # direction at token 100 + 7 i), so a chain read from the wrong rows differs.
    lm_head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(lm_head.weight, std=0.01, generator=gen)
    with torch.no_grad():
        lm_head.weight[100 + 7 * torch.arange(len(hidden))] = torch.nn.functional.normalize(hidden, dim=-1)
        sgl = DFlashWorkerV2._greedy_sample_from_vocab_parallel_head(None, hidden_states=hidden[1:], lm_head=lm_head)
    assert torch.equal(sgl, 100 + 7 * torch.arange(1, len(hidden)))  # the mask rows' own tokens
    values, tokens = block_topk(drafter.attach_target(embed, lm_head.weight).draft_block(features, bonus=1000)[None], 4)
    assert torch.equal(tokens[0, :, 0], sgl)


def sglang_chain_accept_triton(candidates, target_predict):
    """SGLang's Triton kernel (the path its CUDA tensors take), launched as
    ``compute_dflash_correct_drafts_and_bonus`` launches it."""
    import triton

    bs, block_size = candidates.shape
    correct = torch.empty(bs, dtype=torch.int32)
    bonus = torch.empty(bs, dtype=torch.int64)
    sgl_dflash_ops._fused_correct_drafts_and_bonus_kernel[(bs,)](
        candidates.contiguous(), target_predict.contiguous(), correct, bonus, block_size,
        BLOCK=triton.next_power_of_2(max(block_size - 1, 1)),
    )  # fmt: skip
    return correct, bonus


def test_sglangs_chain_acceptance_is_our_verify_of_the_topk1_ddtree():
    """SGLang's DFlash verify rule against ours on the tree DDTree builds with
    topk = 1 (the drafter's chain): same accepted count, same bonus token."""
    gen = torch.Generator().manual_seed(2)
    bs, L, V = 6, 7, 12
    logits = torch.randn(bs, L, V, generator=gen)
    values, tokens = block_topk(logits, 1)
    trees = block_trees(values, tokens, L, impl="torch")
    assert torch.equal(trees.parents, torch.arange(-1, L).expand(bs, L + 1))  # a chain
    root = torch.randint(0, V, (bs, 1), generator=gen)
    candidates = torch.cat([root, trees.tokens], 1)  # SGLang's draft_tokens: bonus, then the drafts
    # the target agrees with the drafts up to a random depth (0..L), then differs
    agree = torch.tensor([0, 1, 3, L, L - 1, 2])
    target_predict = torch.randint(0, V, (bs, L + 1), generator=gen)
    for b in range(bs):
        k = int(agree[b])
        target_predict[b, :k] = candidates[b, 1 : k + 1]
        if k < L:
            target_predict[b, k] = (candidates[b, k + 1] + 1) % V
    build = stk.tree_from_parents(trees.parents, torch.zeros(bs, dtype=torch.int64), stk.TreeMaskMode.QLEN_ONLY,
                                  impl="torch")  # fmt: skip
    ours = stk.verify_tree_greedy(candidates, build.retrieve_next_token, build.retrieve_next_sibling, target_predict,
                                  L, impl="torch")  # fmt: skip
    our_correct = ours.accept_length.long()  # accepted drafts, the root excluded: SGLang's count
    our_bonus = ours.accept_tokens[torch.arange(bs), ours.accept_length.long()]
    for sgl_correct, sgl_bonus in (
        sgl_dflash_ops.compute_dflash_correct_drafts_and_bonus(candidates=candidates, target_predict=target_predict),
        sglang_chain_accept_triton(candidates, target_predict),
    ):
        assert torch.equal(sgl_correct.long(), agree)
        assert torch.equal(our_correct, sgl_correct.long()) and torch.equal(our_bonus, sgl_bonus)
