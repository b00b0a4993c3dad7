"""``train --recipe``: each stage of RECIPES continues from the one before, the
last writes the head folder, the ones before the data cache; a failing stage
stops the recipe with its exit code. The trainer itself is replaced by a
recorder (training a head takes an hour of this machine)."""

import pytest

from spec_plugins.training import data as data_mod
from spec_plugins.training import train


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """(calls, tmp_path, set_rc): the argv of every stage run; set_rc(n) makes each stage exit with n."""
    calls, rc = [], [0]
    monkeypatch.setattr(data_mod, "data_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv) or rc[0])
    return calls, tmp_path, lambda n: rc.__setitem__(0, n)


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("head", sorted(train.RECIPES))
def test_recipe_chains_its_stages(recorded, head):
    calls, tmp, _ = recorded
    out = tmp / "head"
    assert train.run_recipe(head, out) == 0
    stages = train.RECIPES[head]
    assert len(calls) == len(stages)
    for n, (argv, stage_args) in enumerate(zip(calls, stages), 1):
        assert argv[:2] == ["--head", head] and argv[-len(stage_args):] == stage_args
        expected_out = out if n == len(stages) else tmp / "cache" / f"{head}-stage{n}"
        assert _flag(argv, "--out") == str(expected_out)
        assert _flag(argv, "--init-from") == (None if n == 1 else _flag(calls[n - 2], "--out"))


def test_recipe_stops_at_a_failing_stage(recorded):
    calls, tmp, set_rc = recorded
    set_rc(3)
    assert train.run_recipe("eagle3", tmp / "head") == 3
    assert len(calls) == 1
