"""The model card's acceptance table: one row per shape of the card's head, tau
per evaluation domain from the acceptance benchmark's rows (a domain a row
lacks prints "-"), other heads' rows left out."""

import shutil

from spec_plugins.heads import head_path
from spec_plugins.training.card import write_card


def _row(head, shape, tau, by_domain):
    s, k, t = shape
    return {"head": head, "num_steps": s, "topk": k, "num_draft_tokens": t, "tau": tau,
            "accept_by_depth": [tau - 1], "lossless": True, "tau_by_domain": by_domain}


def test_card_reports_tau_per_domain(tmp_path):
    for name in ("training.json", "config.json"):
        shutil.copy(head_path("eagle3") / name, tmp_path / name)
    bench = {"prompts": ["a", "b", "c"], "max_new_tokens": 32, "rows": [
        _row("eagle3", (5, 1, 6), 1.5, {"code": 1.25, "writing": 1.75}),
        _row("eagle3", (5, 4, 8), 2.0, {"code": 2.5}),
        _row("eagle1", (5, 1, 6), 9.0, {"chat": 9.0}),
    ]}
    text = write_card(tmp_path, bench=bench)
    assert text == (tmp_path / "README.md").read_text()
    table = text[text.index("| (num_steps"):].splitlines()
    assert table[0] == "| (num_steps, topk, T) | tau | acceptance by depth | lossless | tau code | tau writing |"
    assert table[2] == "| (5, 1, 6) | 1.50 | 0.50 | yes | 1.25 | 1.75 |"
    assert table[3] == "| (5, 4, 8) | 2.00 | 1.00 | yes | 2.50 | - |"
    assert "9.00" not in text  # eagle1's row is another card's
