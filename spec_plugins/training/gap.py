"""Where a trained head's remaining acceptance gap comes from.

    python -m spec_plugins.training.gap --head spec_plugins/heads/smollm2-135m-eagle3

Greedy verification accepts a draft token when it is the target's top-1, so
the quantity that bounds tau is the head's top-1 agreement with the target,
step by step along a chain. This script measures it on the head's own data
split (the held-out sequences of ``train.split_indices`` and an equally large
sample of its training sequences; the target's features are recomputed for
just those) and splits the shortfall into four suspects:

* **data size**: agreement on training sequences well above held-out means the
  head memorizes (more data would help); equal means it underfits;
* **vocabulary**: an EAGLE-3 head can only propose its draft vocabulary; the
  share of target top-1 tokens outside it is agreement no training recovers;
* **a flat target**: agreement by the target's own top-1 probability; where
  the target itself hesitates, a one-layer head rarely guesses its pick;
* **training compute**: how much the training loss still fell over the last
  quarter of the run (``training.json``'s history).

Prints a table and writes JSON (``--out``). Deterministic for a given head and
data; the chains are teacher-forced on the data's tokens, as in training.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

# Target top-1 probability buckets: [lower, upper) each.
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)
SHIPPED_SEQUENCES = Path(__file__).resolve().parents[2] / "results/2026-12-01/train_data_p3000/sequences.jsonl.gz"


class Agreement:
    """Counts, per unrolled step, of answer positions where the head's top-1 is
    the target's top-1, and (step 0) by the target's top-1 probability."""

    def __init__(self, head, lm_head: torch.Tensor, unroll: int):
        self.head, self.lm_head = head, lm_head
        self.draft_to_target = head.draft_to_target()
        self.in_draft_vocab = torch.zeros(lm_head.shape[0], dtype=torch.bool)
        self.in_draft_vocab[self.draft_to_target] = True
        self.n = torch.zeros(unroll)
        self.agree = torch.zeros(unroll)
        self.covered = torch.zeros(unroll)
        nb = len(CONFIDENCE_EDGES) - 1
        self.bucket_n, self.bucket_agree = torch.zeros(nb), torch.zeros(nb)

    def observe(self, j: int, hidden: torch.Tensor, valid: torch.Tensor, final: torch.Tensor) -> None:
        """Step j's chain at b (output ``hidden`` [B, L, H], ``valid`` [B, L]) predicts
        the target's next token after position b + j + 1 (``final`` [B, L, H]: the
        batch's target final hidden)."""
        from spec_plugins.training.train import shift

        target_p = (shift(final, j + 1)[valid].float() @ self.lm_head.T).softmax(-1)
        conf, target_top1 = target_p.max(-1)
        head_top1 = self.draft_to_target[self.head.logits(hidden[valid]).argmax(-1)]
        hit = head_top1 == target_top1
        self.n[j] += len(hit)
        self.agree[j] += hit.sum()
        self.covered[j] += self.in_draft_vocab[target_top1].sum()
        if j == 0:
            bucket = torch.bucketize(conf, torch.tensor(CONFIDENCE_EDGES[1:-1]), right=True)
            self.bucket_n += torch.bincount(bucket, minlength=len(self.bucket_n)).float()
            self.bucket_agree += torch.bincount(bucket[hit], minlength=len(self.bucket_n)).float()

    def __iadd__(self, other: "Agreement") -> "Agreement":
        for name in ("n", "agree", "covered", "bucket_n", "bucket_agree"):
            getattr(self, name).add_(getattr(other, name))
        return self

    def summary(self) -> dict:
        labels = [f"[{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'}"
                  for lo, hi in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:])]
        return {
            "positions": int(self.n[0]),
            "agreement_by_step": [round(float(a / n), 4) for a, n in zip(self.agree, self.n)],
            "target_top1_in_draft_vocab_by_step": [round(float(c / n), 4) for c, n in zip(self.covered, self.n)],
            "step0_by_target_confidence": {
                lab: {"share": round(float(n / self.bucket_n.sum()), 4),
                      "agreement": round(float(a / n), 4) if n else None}
                for lab, n, a in zip(labels, self.bucket_n, self.bucket_agree)},
        }


def measure(head, records: list[dict], lm_head: torch.Tensor, unroll: int, tokens_per_batch: int) -> Agreement:
    """The agreement counts of ``head`` over feature ``records``."""
    from spec_plugins.training.train import collate, make_batches, target_to_draft, unrolled_loss

    agreement = Agreement(head, lm_head, unroll)
    subset = agreement.draft_to_target
    t2d = target_to_draft(subset, lm_head.shape[0])
    with torch.no_grad():
        for batch in make_batches(records, tokens_per_batch, random.Random(0)):
            ids, length, prompt_len, aux, final = collate(records, batch)
            unrolled_loss(head, ids, length, prompt_len, aux, final, unroll, t2d, subset,
                          observe=lambda j, hidden, valid: agreement.observe(j, hidden, valid, final))
    return agreement


def measure_by_domain(head, records: list[dict], lm_head: torch.Tensor, unroll: int,
                      tokens_per_batch: int) -> tuple[Agreement, dict]:
    """(counts over all ``records``, {domain: counts}): one pass per domain, summed for all."""
    from spec_plugins.training.train import by_domain_of

    per_domain = {d: measure(head, rs, lm_head, unroll, tokens_per_batch) for d, rs in by_domain_of(records).items()}
    total = Agreement(head, lm_head, unroll)
    for agreement in per_domain.values():
        total += agreement
    return total, per_domain


def loss_trend(history: list[dict]) -> dict:
    """The training loss's moving average at 50%, 75% and 100% of the steps and
    its relative fall over the last quarter (a run still learning has not
    converged: more compute would raise agreement)."""
    def ema_at(frac):
        step = history[-1]["step"] * frac
        return min(history, key=lambda h: abs(h["step"] - step))["ema"]

    half, three_q, end = ema_at(0.5), ema_at(0.75), ema_at(1.0)
    return {"ema_at_50%": half, "ema_at_75%": three_q, "ema_at_end": end,
            "fall_over_last_quarter": round((three_q - end) / three_q, 4)}


def analyse(head_dir: Path, sequences: Path, unroll: int, tokens_per_batch: int, train_sample: int | None) -> dict:
    from transformers import AutoModelForCausalLM

    from spec_plugins.heads import load_head
    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.training.data import feature_records, load_sequences
    from spec_plugins.training.train import split_indices

    info = json.loads((head_dir / "training.json").read_text())
    seqs = load_sequences(sequences)
    expected = info["data"]["train_sequences"] + info["data"]["held_out_sequences"]
    if len(seqs) != expected:
        raise SystemExit(f"{sequences} has {len(seqs)} sequences; {head_dir} was trained on {expected}: "
                         "not its data, so its held-out split cannot be rebuilt")
    train_idx, val_idx = split_indices(len(seqs), info["train"]["seed"])
    sample_idx = random.Random(1).sample(train_idx, min(train_sample or len(val_idx), len(train_idx)))
    target = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32).eval()
    head = load_head(head_dir, target)
    lm_head = target.get_output_embeddings().weight.detach()
    print(f"[gap] features of {len(val_idx)} held-out and {len(sample_idx)} training sequences", flush=True)
    held_out = feature_records([seqs[i] for i in val_idx], model=target)
    trained_on = feature_records([seqs[i] for i in sample_idx], model=target)
    held_out_all, held_out_domains = measure_by_domain(head, held_out, lm_head, unroll, tokens_per_batch)
    return {"head": head_dir.name, "kind": info["kind"], "sequences": str(sequences), "unroll": unroll,
            "held_out": held_out_all.summary(),
            "training_sample": measure(head, trained_on, lm_head, unroll, tokens_per_batch).summary(),
            "held_out_by_domain": {d: a.summary()["agreement_by_step"] for d, a in held_out_domains.items()},
            "training_loss": loss_trend(info["history"]),
            "training_minutes": info["train"].get("minutes_total", info["train"]["minutes"])}


def report(r: dict) -> str:
    ho, tr = r["held_out"], r["training_sample"]
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = [f"# {r['head']} ({r['kind']}): top-1 agreement with the target per unrolled step",
             "",
             f"held-out      ({ho['positions']} positions): {fmt(ho['agreement_by_step'])}",
             f"training data ({tr['positions']} positions): {fmt(tr['agreement_by_step'])}",
             *[f"  held-out {d}: {fmt(a)}" for d, a in r["held_out_by_domain"].items()],
             "",
             f"data size: step-0 agreement train - held-out = "
             f"{tr['agreement_by_step'][0] - ho['agreement_by_step'][0]:+.3f}",
             f"vocabulary: target top-1 outside the draft vocabulary (held-out, step 0): "
             f"{1 - ho['target_top1_in_draft_vocab_by_step'][0]:.3f}",
             "flat target: held-out step 0 by the target's top-1 probability (share of positions, agreement):"]
    for lab, b in ho["step0_by_target_confidence"].items():
        agreement = "-" if b["agreement"] is None else f"{b['agreement']:.3f}"
        lines.append(f"  p {lab}: {b['share']:.3f}, {agreement}")
    t = r["training_loss"]
    lines.append(f"training compute: loss EMA {t['ema_at_50%']} -> {t['ema_at_75%']} -> {t['ema_at_end']} "
                 f"at 50/75/100% of {r['training_minutes']} min (fell {100 * t['fall_over_last_quarter']:.1f}% "
                 "over the last quarter)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True, help="a head folder with its training.json")
    ap.add_argument("--sequences", type=Path, default=SHIPPED_SEQUENCES,
                    help="the head's training sequences (.jsonl or .jsonl.gz; default: the shipped training sequences)")
    ap.add_argument("--unroll", type=int, default=5)
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--train-sample", type=int, default=None,
                    help="training sequences to compare with (default: as many as held out)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    r = analyse(args.head, args.sequences, args.unroll, args.tokens_per_batch, args.train_sample)
    print(report(r), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
