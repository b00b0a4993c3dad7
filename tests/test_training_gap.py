"""The gap diagnostic's counting (spec_plugins.training.gap), on hand-built
tensors whose agreement, coverage and target confidence are known in advance.
A stand-in head (logits = its hidden through a fixed matrix) replaces the
trained one: the real head and target run in the diagnostic itself."""

import math

import torch

from spec_plugins.training.gap import Agreement, loss_trend
from spec_plugins.training.train import shift, split_indices

V = 4  # vocabulary; hidden size too: the target's LM head is the identity


class StandInHead:
    """logits(h) = h over the draft vocabulary ``draft`` (target ids)."""

    def __init__(self, draft):
        self.draft = torch.tensor(draft)

    def draft_to_target(self):
        return self.draft

    def logits(self, h):
        return h[..., self.draft]


def confident(token: int, p: float) -> torch.Tensor:
    """A final hidden whose target distribution (identity LM head) puts probability p on ``token``."""
    x = torch.zeros(V)
    x[token] = math.log(p * (V - 1) / (1 - p))
    return x


def test_agreement_counts_hits_coverage_and_confidence_buckets():
    # one sequence of 5 positions; position t's target distribution comes from final[t + 1]
    final = torch.stack([confident(0, 0.5), confident(1, 0.28), confident(2, 0.6), confident(3, 0.95),
                         confident(1, 0.8), confident(0, 0.4)])[None]
    valid = torch.tensor([[True, True, True, True, False, False]])
    agreement = Agreement(StandInHead([0, 1, 2]), torch.eye(V), unroll=1)  # token 3 outside the draft vocab
    hidden = shift(final, 1).clone()
    hidden[0, 0] = confident(0, 0.9)  # position 0: the target's top-1 is 1, the head proposes 0
    agreement.observe(0, hidden, valid, final)
    s = agreement.summary()
    assert s["positions"] == 4
    # position 0 miss; 1 agree (both 2); 2 target 3 outside draft vocab -> miss; 3 agree (both 1)
    assert s["agreement_by_step"] == [0.5]
    assert s["target_top1_in_draft_vocab_by_step"] == [0.75]
    buckets = s["step0_by_target_confidence"]
    # target top-1 probabilities at positions 0..3: 0.28, 0.6, 0.95, 0.8
    assert [b["share"] for b in buckets.values()] == [0.25, 0.0, 0.25, 0.25, 0.25]
    assert [b["agreement"] for b in buckets.values()] == [0.0, None, 1.0, 1.0, 0.0]


def test_agreement_is_perfect_for_a_head_that_copies_the_target_at_every_step():
    torch.manual_seed(0)
    final = torch.randn(2, 7, V)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[:, -3:] = False  # past the end of the shifted features (zeros: both sides would pick token 0)
    agreement = Agreement(StandInHead(list(range(V))), torch.eye(V), unroll=3)
    for j in range(3):
        agreement.observe(j, shift(final, j + 1), valid, final)
        agreement.observe(j, -shift(final, j + 1), valid, final)  # the opposite pick: never the target's top-1
    assert agreement.summary()["agreement_by_step"] == [0.5, 0.5, 0.5]


def test_loss_trend_reports_the_fall_over_the_last_quarter():
    history = [{"step": s, "ema": 10.0 - s / 100} for s in range(0, 401, 10)]
    t = loss_trend(history)
    assert (t["ema_at_50%"], t["ema_at_75%"], t["ema_at_end"]) == (8.0, 7.0, 6.0)
    assert t["fall_over_last_quarter"] == round(1 / 7, 4)


def test_split_indices_hold_out_five_percent_disjointly():
    train, held_out = split_indices(3840, seed=0)
    assert len(held_out) == 192 and sorted(train + held_out) == list(range(3840))
    assert split_indices(3840, seed=0) == (train, held_out)


def test_summed_counts_equal_one_pass_over_all_positions():
    torch.manual_seed(1)
    final, noise = torch.randn(2, 9, V), torch.randn(2, 9, V)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[:, -2:] = False
    hidden = shift(final, 1) + noise  # agrees at some positions only
    head, lm_head = StandInHead([0, 1, 3]), torch.eye(V)
    whole = Agreement(head, lm_head, unroll=1)
    whole.observe(0, hidden, valid, final)
    total = Agreement(head, lm_head, unroll=1)
    for b in range(2):  # one sequence at a time, as measure_by_domain sums its domains
        part = Agreement(head, lm_head, unroll=1)
        part.observe(0, hidden[b : b + 1], valid[b : b + 1], final[b : b + 1])
        total += part
    assert total.summary() == whole.summary()
    assert 0 < whole.summary()["agreement_by_step"][0] < 1


def test_sequences_read_from_jsonl_and_gzip_alike(tmp_path):
    import gzip
    import json

    from spec_plugins.training.data import load_sequences

    records = [{"prompt_ids": [1, 2], "response_ids": [3]}, {"prompt_ids": [4], "response_ids": [5, 6]}]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "s.jsonl").write_text(text)
    (tmp_path / "s.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert load_sequences(tmp_path / "s.jsonl") == load_sequences(tmp_path / "s.jsonl.gz") == records
