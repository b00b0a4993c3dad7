"""SGLang's tree flag names on vLLM's command line (``vllm serve ... --speculative-algorithm
EAGLE_TREE``), added to vLLM's parser and translated into EngineArgs fields (``engine_patches``)."""

from __future__ import annotations

from .config import CLI_ALGORITHM, SPEC_TREE_KEY, TreeConfigError, set_once

CLI_FLAGS = {
    # flag -> (namespace attribute, type, help)
    "--speculative-algorithm": ("speculative_algorithm", str,
                                f"{CLI_ALGORITHM} turns on spec-plugins' tree EAGLE (SGLang's flag name)."),
    "--speculative-draft-model-path": ("speculative_draft_model_path", str,
                                       "EAGLE-1 or EAGLE-3 head: a local folder or a hub id (kind read from its "
                                       "config through vLLM's loader)."),
    "--speculative-draft-model-revision": ("speculative_draft_model_revision", str,
                                           "The head's revision on the hub (branch, tag or commit)."),
    "--speculative-num-steps": ("speculative_num_steps", int, "Tree depth (default 5)."),
    "--speculative-eagle-topk": ("speculative_eagle_topk", int, "Branching per draft step (default 4; 1 = chain)."),
    "--speculative-num-draft-tokens": ("speculative_num_draft_tokens", int,
                                       "Tree nodes incl. the root (default 8; chain: num_steps + 1)."),
    "--speculative-tree-budget": ("speculative_tree_budget", str,
                                  "'auto': choose each step's shape (or no speculation) from --speculative-tree-menu "
                                  "by measured cost and acceptance; 'off' (default): the fixed shape above."),
    "--speculative-tree-menu": ("speculative_tree_menu", str,
                                "The adaptive budget's menu: 'none' and num_steps,topk,num_draft_tokens triples "
                                "(default 'none,3,1,4,5,1,6,5,4,8')."),
}


def add_cli_flags(parser) -> None:
    """Add SGLang-named tree flags to vLLM's parser (skipped if already there)."""
    existing = set(getattr(parser, "_option_string_actions", {}))
    group = parser.add_argument_group("spec-plugins tree speculative decoding")
    for flag, (dest, typ, help_text) in CLI_FLAGS.items():
        if flag not in existing:
            group.add_argument(flag, dest=dest, type=typ, default=None, help=help_text)


def apply_cli_flags(engine_args, namespace) -> None:
    """Translate the tree flags in ``namespace`` into EngineArgs fields.

    The head may come from --speculative-draft-model-path, from
    --speculative-config's "model" or from vLLM 0.33's --spec-model: given
    twice it must be the same head. Its kind is read later, in
    ``prepare_engine_args`` (a hub id needs vLLM's config loader)."""
    algo = getattr(namespace, "speculative_algorithm", None)
    tree_flags = {k: getattr(namespace, dest, None) for k, (dest, _, _) in CLI_FLAGS.items()}
    if algo is None:
        used = [k for k, v in tree_flags.items() if v is not None]
        if used:
            raise TreeConfigError(f"{', '.join(used)} given without --speculative-algorithm {CLI_ALGORITHM}")
        return
    if algo.upper() != CLI_ALGORITHM:
        raise TreeConfigError(f"--speculative-algorithm {algo!r}: spec-plugins adds only {CLI_ALGORITHM} "
                              "to vLLM (other methods: --speculative-config)")
    spec = dict(engine_args.speculative_config or {})
    for flag, key in (("--speculative-draft-model-path", "model"), ("--speculative-draft-model-revision", "revision")):
        value = tree_flags[flag]
        if value is None:
            continue
        set_once(spec, key, value, flag, "--speculative-config")
    engine_args.speculative_config = spec or None
    tree = {}
    for key, dest in (("num_steps", "speculative_num_steps"), ("topk", "speculative_eagle_topk"),
                      ("num_draft_tokens", "speculative_num_draft_tokens"), ("budget", "speculative_tree_budget"),
                      ("menu", "speculative_tree_menu")):
        v = getattr(namespace, dest, None)
        if v is not None:
            tree[key] = v
    engine_args.additional_config = {**(engine_args.additional_config or {}), SPEC_TREE_KEY: tree}
