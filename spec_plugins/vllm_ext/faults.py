"""TEST-ONLY fault injection for the regression harness's own tests.

``SPEC_PLUGINS_INJECT_FAULT=accept_extra|skip_kv_move`` makes the workers build
a subclass of the tree runner that breaks the one law on purpose, so that the
tests of ``spec-plugins check`` can prove it catches each break. The production
runner classes carry none of this; never set the variable in production.
"""

from __future__ import annotations

import os

FAULT_ENV = "SPEC_PLUGINS_INJECT_FAULT"
FAULTS = ("accept_extra", "skip_kv_move")


class AcceptExtraFault:
    """The first rejected child of the last accepted node is emitted in place of
    the bonus token (an off-by-one in the walk)."""

    def after_tree_sampling(self, out, groups):
        tokens = out.sampled_token_ids
        for g in groups.values():
            child = g.build.retrieve_next_token.gather(1, g.last_node[:, None])[:, 0]
            rejected = child >= 0
            token = g.candidates.gather(1, child.clamp(min=0)[:, None])[:, 0]
            tokens[g.rows_dev[rejected], g.accept_length[rejected]] = token[rejected].to(tokens.dtype)


class SkipKVMoveFault:
    """The accepted nodes' KV stays where verification wrote it."""

    def _move_accepted_kv(self, groups):
        pass


def with_test_faults(runner_cls: type) -> type:
    """``runner_cls``, or its faulty subclass when ``FAULT_ENV`` asks for one."""
    fault = os.environ.get(FAULT_ENV) or None
    if fault is None:
        return runner_cls
    if fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={fault!r}: known faults are {', '.join(FAULTS)}")
    mixin = AcceptExtraFault if fault == "accept_extra" else SkipKVMoveFault
    return type(f"{runner_cls.__name__}With{mixin.__name__}", (mixin, runner_cls), {})
