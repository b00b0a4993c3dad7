"""CI guard for SGLang's GPU-only call sites the EAGLE_TREE plugin relies on.

SGLang's server cannot start on these machines, so the places where a GPU
server would reach our code (or fail to) are checked against SGLang 0.5.23's
own sources, as far as its modules import here (issue 19, CI guard):

* processes: every process that builds spec objects loads plugins; the
  tokenizer workers do not, which is why ``--tokenizer-worker-num > 1`` is
  refused, and a process without plugins cannot name EAGLE_TREE;
* scheduler: the keywords it builds the spec worker with, and every method it
  and the model runner ask a spec algorithm;
* the four hooked functions keep the signatures their callers use;
* attention backends: every verify entry point of the parents of ``spec_tree``
  and ``spec_tree_triton`` is ours (the TARGET_VERIFY graph entry points
  included), decode only, or the base's shared-read rule; SGLang's
  FULL_MASK consumers get a fully written buffer through
  ``build_eagle_verify_input``'s preallocated path (``seq_lens_sum`` 0).

Static checks read SGLang's source files with ``ast`` (no import needed).
Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1``; faked: ``torchvision``
(``spec_plugins.sglang_ext._testing``), and in the last test the batch, draft
input and target worker handed to ``build_eagle_verify_input`` (namespaces
with the fields it reads; a real one needs a loaded model).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.attention.verify_mask import VerifyMask, tree_mask_numel  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

import spec_tree_kernels as stk  # noqa: E402
from spec_plugins.sglang_ext import config, engine_patches, layout  # noqa: E402
from spec_plugins.sglang_ext.attention import TreeVerifyMixin, TreeVerifyTorchNativeBackend  # noqa: E402
from spec_plugins.sglang_ext.attention import triton_tree_backend_class  # noqa: E402
from spec_plugins.sglang_ext.worker import EagleTreeWorker  # noqa: E402
from spec_tree_kernels import TreeMaskMode  # noqa: E402

pytestmark = pytest.mark.sglang


def function_node(module: str, qualname: str) -> ast.AST:
    """The def of ``qualname`` (``f`` or ``Class.f``) in SGLang's source file of ``module``."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    for part in qualname.split("."):
        tree = next(
            node for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part
        )  # fmt: skip
    return tree


def called_names(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            names.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return names


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _testing.write_tiny_checkpoint_configs(tmp_path_factory.mktemp("ckpt"))


# ------------------------------------------------------------- processes

PLUGIN_LOADING_ENTRY_POINTS = [
    ("sglang.srt.managers.scheduler", "run_scheduler_process"),
    ("sglang.srt.managers.detokenizer_manager", "run_detokenizer_process"),
    ("sglang.srt.managers.data_parallel_controller", "run_data_parallel_controller_process"),
    ("sglang.srt.entrypoints.engine", "Engine.__init__"),
]


@pytest.mark.parametrize("module,qualname", PLUGIN_LOADING_ENTRY_POINTS)
def test_processes_that_name_the_algorithm_load_plugins(module, qualname):
    assert "load_plugins" in called_names(function_node(module, qualname)), (
        f"SGLang's {module}.{qualname} no longer calls load_plugins: EAGLE_TREE would be unknown in that process"
    )


def test_tokenizer_workers_do_not_load_plugins_but_need_the_algorithm():
    """Why resolution refuses --tokenizer-worker-num > 1 (item 3). When this
    fails because SGLang's workers load plugins, lift that refusal
    (``algorithm.check_flags_before_eagle_family``)."""
    http = "sglang.srt.entrypoints.http_server"
    worker_path = called_names(function_node(http, "init_multi_tokenizer")) | called_names(function_node(http, "lifespan"))
    assert "load_plugins" not in worker_path
    top_level = ast.parse(Path(importlib.util.find_spec(http).origin).read_text()).body
    assert not any("load_plugins" in called_names(node) for node in top_level if not isinstance(node, ast.FunctionDef))
    # and a tokenizer manager asks for the algorithm when it is built
    manager = "sglang.srt.managers.tokenizer_manager"
    assert "init_model_config" in called_names(function_node(manager, "TokenizerManager.__init__"))
    assert "compute_num_reserved_tokens" in called_names(function_node(manager, "TokenizerManager.init_model_config"))
    assert "from_string" in called_names(function_node("sglang.srt.managers.utils", "compute_num_reserved_tokens"))


WORKER_WITHOUT_PLUGINS = """
import pickle, sys
from spec_plugins.sglang_ext import _testing
_testing.install_import_stubs()  # torchvision only; no plugin is registered
from sglang.srt.runtime_context import publish
from sglang.srt.managers.utils import compute_num_reserved_tokens
try:
    publish(pickle.load(open(sys.argv[1], "rb")), role="tokenizer")  # what init_multi_tokenizer does
    compute_num_reserved_tokens()  # what its TokenizerManager does next
except ValueError as err:
    import traceback
    print("REFUSED:", err, "in", traceback.extract_tb(err.__traceback__)[1].name)
"""


def test_a_process_without_plugins_cannot_name_eagle_tree(ckpt, tmp_path):
    """A tokenizer worker's first step with EAGLE_TREE server args, in a fresh
    interpreter that (like SGLang's workers) never loaded plugins."""
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend=config.BACKEND_TORCH,
    )  # fmt: skip
    args_file = tmp_path / "server_args.pkl"
    args_file.write_bytes(pickle.dumps(server_args))  # SGLang hands them over pickled (shared memory)
    out = subprocess.run(
        [sys.executable, "-c", WORKER_WITHOUT_PLUGINS, str(args_file)], capture_output=True, text=True, timeout=300
    )
    assert "REFUSED: Unknown speculative algorithm name: EAGLE_TREE" in out.stdout, out.stderr[-3000:]
    # with the plugin (every other process): EAGLE's reservation
    from sglang.srt.managers.utils import compute_num_reserved_tokens

    _testing.publish(server_args)
    from sglang.srt.arg_groups.overrides import resolved_view

    assert compute_num_reserved_tokens() >= resolved_view(server_args).speculative_num_draft_tokens


# ------------------------------------------------------------- scheduler


def test_scheduler_builds_our_worker_with_the_keywords_it_passes():
    method = function_node("sglang.srt.managers.scheduler", "Scheduler.maybe_init_draft_worker")
    kwargs = next(
        node.value for node in ast.walk(method)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "draft_worker_kwargs"
    )  # fmt: skip
    assert "create_worker" in called_names(method)
    keywords = {kw.arg for kw in kwargs.keywords}
    assert keywords == {"server_args", "gpu_id", "nccl_port", "target_worker"}
    inspect.signature(EagleTreeWorker.__init__).bind(None, **dict.fromkeys(keywords))


# Public methods of SpeculativeAlgorithm our spec object need not answer:
# class-level (called on SpeculativeAlgorithm itself), or reached only for the
# literal names EAGLE/EAGLE3 (adaptive_spec_params.adaptive_unsupported_reason).
CLASS_LEVEL_ONLY = {"from_string", "register", "get_platform_worker_cls"}


def test_spec_object_answers_every_method_sglang_asks():
    """SGLang's scheduler and model runner call these on whatever
    ``from_string`` returns; 0.5.23's CustomSpecAlgo lacked several (crash at
    scheduler init on a GPU)."""
    algo = SpeculativeAlgorithm.from_string(config.ALGORITHM_NAME)
    public = {name for name, value in vars(SpeculativeAlgorithm).items() if not name.startswith("_") and callable(value)}
    public |= {name for name, value in vars(SpeculativeAlgorithm).items() if isinstance(value, (classmethod, property))}
    missing = sorted(name for name in public - CLASS_LEVEL_ONLY if not hasattr(algo, name))
    assert not missing, f"EagleTreeSpecAlgo lacks {missing} (SpeculativeAlgorithm has them in this SGLang)"
    for name in ("create_future_map", "build_disagg_draft_input"):  # ours delegate with SGLang's parameters
        theirs = list(inspect.signature(getattr(SpeculativeAlgorithm, name)).parameters)[1:]
        assert list(inspect.signature(getattr(algo, name)).parameters) == theirs, name


# ---------------------------------------------------------- hooked functions

DROP_INS = {
    engine_patches.HOOK_ORGANIZE: layout.organize_draft_results_closed,
    engine_patches.HOOK_BUILD: layout.build_tree_sglang_layout,
    engine_patches.HOOK_VERIFY: layout.verify_tree_greedy_sglang_layout,
    engine_patches.HOOK_MOVE_KV: layout.move_accepted_kv_sglang_layout,
}


@pytest.mark.parametrize("target", list(DROP_INS), ids=lambda t: t.rsplit(".", 1)[1])
def test_drop_ins_take_what_sglang_passes(target):
    """Our drop-in of each hooked function has SGLang's parameters (names,
    order, defaults) plus keyword-only extras, so every call site binds."""
    module, name = target.rsplit(".", 1)
    original = inspect.unwrap(getattr(importlib.import_module(module), name))  # HookRegistry wraps it
    theirs = list(inspect.signature(original).parameters.values())
    ours = [p for p in inspect.signature(DROP_INS[target]).parameters.values() if p.kind != p.KEYWORD_ONLY]
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


# ------------------------------------------------------ attention backends

_VERIFY_WORDS = re.compile(r"target_verify|custom_mask|verify_mask|spec_info")
# Verify-related entry points of the parents that are not ours, and why none
# is reached in tree verify with our backends:
NOT_REACHED = {
    "forward_decode": "decode batches only (TARGET_VERIFY goes to forward_extend)",
    # (init_cuda_graph_state and glue_target_verify_metadata are ours: TARGET_VERIFY graphs, issue #38)
    "shared_read_ends": "the base's rule for verify (shared reads end in the replay); ours end earlier, before it",
}


def verify_entry_points(parent) -> set[str]:
    """Public AttentionBackend methods whose implementation in ``parent``
    handles target verify or its mask."""
    found = set()
    for name in (n for n in dir(AttentionBackend) if not n.startswith("_")):
        impl = inspect.getattr_static(parent, name)
        func = impl.fget if isinstance(impl, property) else getattr(impl, "__func__", impl)
        try:
            source = inspect.getsource(func)
        except (TypeError, OSError):
            continue
        if _VERIFY_WORDS.search(source):
            found.add(name)
    return found


@pytest.mark.parametrize(
    "ours,parent", [(TreeVerifyTorchNativeBackend, TorchNativeAttnBackend), (None, TritonAttnBackend)],
    ids=["spec_tree", "spec_tree_triton"],
)  # fmt: skip
def test_every_verify_entry_point_of_the_parent_is_ours(ours, parent):
    ours = ours or triton_tree_backend_class()
    assert ours.__mro__[1] is TreeVerifyMixin and parent in ours.__mro__
    not_ours = {name for name in verify_entry_points(parent) if name not in vars(TreeVerifyMixin)}
    assert not_ours <= set(NOT_REACHED), f"{parent.__name__} handles target verify in {sorted(not_ours - set(NOT_REACHED))}"
    for name in vars(TreeVerifyMixin):
        if name in verify_entry_points(parent):
            assert getattr(ours, name) is getattr(TreeVerifyMixin, name), name  # ours wins in the MRO


def test_sglang_full_mask_consumer_buffer_is_written_whole(ckpt):
    """SGLang's Triton verify backend preallocates a FULL_MASK uint8 buffer
    for max_bs requests of max_context_len (triton_backend.init_cuda_graph_state);
    ``build_eagle_verify_input`` then passes seq_lens_sum=0 (no host sync) and
    SGLang fills the whole buffer before writing the tree cells. Through that
    call site, with our build hook, no stale prefix bit survives (item 8)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input

    steps, topk, nodes, bs, max_bs, max_ctx = 3, 2, 5, 2, 3, 40
    gen = torch.Generator().manual_seed(8)
    parent_list = _testing.random_parent_list(gen, bs, topk, steps)
    selected = stk.select_tree_nodes(torch.rand(bs, stk.pool_size(topk, steps), generator=gen), parent_list, topk, steps, nodes)
    seq_lens = torch.tensor([7, 12])
    size = tree_mask_numel(TreeMaskMode.FULL_MASK, max_bs, nodes, max_ctx)
    mask = VerifyMask(buffer=torch.zeros(size, dtype=torch.uint8), mode=TreeMaskMode.FULL_MASK, max_bs=max_bs)
    batch = types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, seq_lens=seq_lens, seq_lens_sum=None, req_pool_indices=torch.arange(bs),
        req_to_token_pool=None,
    )  # fmt: skip
    target_worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(attn_backend=types.SimpleNamespace(verify_mask=mask, max_context_len=max_ctx))
    )
    draft_input = types.SimpleNamespace(bonus_tokens=torch.zeros(bs, dtype=torch.long))
    with engine_patches.activated(engine_patches.TreeRuntime(mask_mode=TreeMaskMode.FULL_MASK, impl="torch")):
        verify_input = build_eagle_verify_input(
            batch, draft_input, parent_list, selected, torch.zeros(bs, nodes - 1, dtype=torch.long), None,
            target_worker=target_worker, topk=topk, num_steps=steps, num_draft_tokens=nodes,
            tree_mask_mode=TreeMaskMode.FULL_MASK, device="cpu",
        )  # fmt: skip
    assert verify_input.custom_mask.data_ptr() == mask.buffer.data_ptr()
    expected = stk.build_tree(selected, parent_list, seq_lens, topk, steps, TreeMaskMode.FULL_MASK, impl="torch")
    used = expected.tree_mask.numel()
    assert mask.buffer[:used].bool().tolist() == expected.tree_mask.tolist()
    assert bool(mask.buffer[used:].bool().all())

