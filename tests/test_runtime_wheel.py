"""The runtime distribution (issue #16): the wheel holds the kernel module, the
two engine adapters and ``spec-plugins check / doctor``; the bundled target,
heads, prompts, training, reference decoder, benchmarks and SGLang test doubles
stay in the repository (pyproject.toml's packages, setup.py's build_py).

Builds the wheel from a copy of the checkout's sources (setuptools, no
network, no build isolation), checks its file list and entry points, then
imports the runtime modules from that wheel alone (``python -I -S``: the
repository and the editable install's finder are not on the path; torch comes
from this venv's site-packages) and checks that nothing repository-only is
imported, even lazily (an AST scan of every module in the wheel). Also checks
that the editable install (what CI and the main job use) still sees the
repository-only parts.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# repository only: packages (everything under them) and single modules
REPO_ONLY_PACKAGES = ("spec_plugins.heads", "spec_plugins.kernel_bench", "spec_plugins.models", "spec_plugins.prompts",
                      "spec_plugins.training")
REPO_ONLY_MODULES = ("spec_plugins.vllm_bench", "spec_plugins.bench_noise", "spec_plugins.acceptance_bench",
                     "spec_plugins.reference_decoder", "spec_plugins.block_decoder", "spec_plugins.block_bench",
                     "spec_plugins.sglang_ext._testing", "spec_plugins.support_table", "spec_plugins.cpu_features")


def repo_only(module: str) -> bool:
    return module in REPO_ONLY_MODULES or any(module == p or module.startswith(p + ".") for p in REPO_ONLY_PACKAGES)


def module_name(path: str) -> str:
    """'spec_plugins/vllm_ext/config.py' -> 'spec_plugins.vllm_ext.config' (__init__: the package)."""
    parts = path[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def build(tmp: Path, hook: str) -> Path:
    """Copy the sources to ``tmp`` and run the PEP 517 ``hook`` there; the built file."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("spec_plugins", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    out = tmp / "dist"
    out.mkdir()
    code = f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"
    res = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("wheel"), "build_wheel")


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked as an installer would (a pure-Python wheel: purelib is its root)."""
    target = tmp_path_factory.mktemp("target")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    return target


def test_wheel_holds_the_runtime_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    files = {n for n in names if ".dist-info/" not in n}
    # in: the whole kernel module (sources and CUDA files), both adapters, the CLI and what it runs
    kernels = {f"spec_tree_kernels/{p.relative_to(ROOT / 'kernels')}" for p in (ROOT / "kernels").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    adapters = {f"spec_plugins/{ext}/{p.name}" for ext in ("vllm_ext", "sglang_ext")
                for p in (ROOT / "spec_plugins" / ext).glob("*.py") if p.name != "_testing.py"}
    cli = {f"spec_plugins/{m}.py" for m in ("__init__", "cli", "cli_types", "engine_versions", "vllm_runs",
                                             "tree_drafting", "tree_commit", "synthetic_trees", "step_clock", "host_reads",
                                             "host_reads_v2", "serve")}
    cli |= {f"spec_plugins/budget/{m}.py" for m in ("__init__", "menu", "costs", "acceptance", "policy")}
    assert "spec_tree_kernels/csrc/tree_ops.cu" in kernels and "spec_plugins/vllm_ext/runner.py" in adapters
    assert "spec_tree_kernels/csrc/tree_attention_cpu.c" in kernels  # the host attention kernel builds from it
    assert not (kernels | adapters | cli) - files, "missing from the wheel"
    # out: weights, training, prompts, the target, benchmarks, the reference decoder, the SGLang test doubles
    assert not {f for f in files if f.endswith(".safetensors")}
    leaked = {f for f in files if f.endswith(".py") and repo_only(module_name(f))}
    leaked |= {f for f in files if f.startswith(tuple(p.replace(".", "/") + "/" for p in REPO_ONLY_PACKAGES))}
    assert not leaked, f"repository-only files in the wheel: {sorted(leaked)}"
    assert files == kernels | adapters | cli, f"unexpected files: {sorted(files - (kernels | adapters | cli))}"
    assert wheel.stat().st_size < 1_000_000  # was 22.6 MB with the heads
    # the engines' entry points and the one console script, whose modules are in the wheel
    assert "spec_plugins_tree = spec_plugins.vllm_ext:register" in entry_points
    assert "spec_plugins_tree = spec_plugins.sglang_ext:register" in entry_points
    scripts = entry_points.split("[console_scripts]")[1].split("[")[0].split()
    assert scripts == ["spec-plugins", "=", "spec_plugins.cli:main"]


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an import statement in ``source`` names, at any depth (lazy imports too)."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import submodule`
    return out


def test_no_runtime_module_imports_a_repository_only_one(wheel):
    """Lazily or not: a runtime path into the repository-only parts would fail
    from the wheel. The CLI reaches them by name through ``repository_part``,
    which explains what is missing."""
    bad = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith(".py") and ".dist-info/" not in name:
                mod = module_name(name)
                hits = {m for m in imported_modules(z.read(name).decode(), mod, name.endswith("__init__.py"))
                        if repo_only(m)}
                if hits:
                    bad[mod] = sorted(hits)
    assert not bad, f"runtime modules importing repository-only ones: {bad}"


CHILD = textwrap.dedent(r"""
    import contextlib, io, json, sys
    target, site = sys.argv[1], sys.argv[2:]
    sys.path[:] = [target] + site + [p for p in sys.path if "site-packages" not in p]
    import spec_plugins, spec_tree_kernels
    assert spec_plugins.__file__.startswith(target), spec_plugins.__file__
    assert spec_tree_kernels.__file__.startswith(target), spec_tree_kernels.__file__
    import spec_plugins.cli as cli, spec_plugins.vllm_ext as vx, spec_plugins.sglang_ext as sx
    import spec_plugins.vllm_ext.config, spec_plugins.vllm_ext.engine_patches, spec_plugins.vllm_ext.seams
    import spec_plugins.vllm_ext.requests, spec_plugins.vllm_ext.sampling, spec_plugins.vllm_ext.startup_checks
    import spec_plugins.sglang_ext.config, spec_plugins.sglang_ext.layout, spec_plugins.sglang_ext.registration
    import spec_plugins.sglang_ext.engine_patches, spec_plugins.sglang_ext.kernel_check
    import spec_plugins.vllm_runs, spec_plugins.budget, spec_plugins.tree_drafting
    vx.register(); sx.register()  # no engine in this venv: both no-ops
    out = {"modules": sorted(m for m in sys.modules if m.startswith(("spec_plugins", "spec_tree_kernels")))}
    out["files"] = sorted({m.__file__ for n, m in sys.modules.items()
                           if n.startswith(("spec_plugins", "spec_tree_kernels")) and getattr(m, "__file__", None)})
    for argv in (["doctor"], ["bench"], ["check"], ["check", "--help"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                rc = cli.main(argv)
            except SystemExit as e:
                rc = e.code
        out[" ".join(argv)] = [rc if isinstance(rc, int) else str(rc), buf.getvalue()]
    print(json.dumps(out))
""")


def test_runtime_entry_points_import_from_the_wheel_alone(installed):
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    res = subprocess.run([sys.executable, "-I", "-S", "-c", CHILD, str(installed), *site], cwd=installed,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert all(f.startswith(str(installed)) for f in out["files"]), out["files"]
    assert not [m for m in out["modules"] if repo_only(m)], out["modules"]
    rc, text = out["doctor"]
    assert rc == 0 and "runtime wheel" in text and "--heads FOLDER" in text, text
    rc, _ = out["bench"]
    assert "spec-plugins bench needs spec_plugins.vllm_bench" in rc and "pip install -e ." in rc, rc
    rc, _ = out["check"]
    assert "bundled SmolLM2 target (or pass --model)" in rc and "not in the runtime wheel" in rc, rc
    rc, text = out["check --help"]
    assert rc == 0 and "--model" in text and "--heads" in text


def test_editable_install_still_sees_the_repository_parts(tmp_path):
    """``pip install -e .`` maps the package folders, so the repository-only
    modules and the head weights import through it exactly as before."""
    editable = build(tmp_path, "build_editable")
    target = tmp_path / "target"
    with zipfile.ZipFile(editable) as z:
        z.extractall(target)
    (finder,) = [p.stem for p in target.glob("__editable___*finder.py")]
    code = textwrap.dedent(f"""
        import sys
        sys.path[:] = [{str(target)!r}] + sys.argv[1:] + sys.path
        import {finder}; {finder}.install()
        import importlib.util
        for m in {REPO_ONLY_MODULES + REPO_ONLY_PACKAGES + ("spec_plugins.training.train",)!r}:
            spec = importlib.util.find_spec(m)
            assert spec is not None and spec.origin.startswith({str(tmp_path / "src")!r}), (m, spec)
        import spec_plugins
        heads = __import__("pathlib").Path(spec_plugins.__file__).parent / "heads"
        assert len(list(heads.glob("*/model.safetensors"))) == 3  # EAGLE-3, EAGLE-1, DFlash
        print("ok")
    """)
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    res = subprocess.run([sys.executable, "-I", "-S", "-c", code, *site], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout[-3000:] + res.stderr[-3000:]


def test_cli_knows_the_shipped_head_names_without_the_heads_package():
    """cli keeps the shipped head names (the wheel has no spec_plugins.heads):
    they must stay those of spec_plugins.heads.SHIPPED and BLOCK_DRAFTERS."""
    from spec_plugins import cli
    from spec_plugins.heads import BLOCK_DRAFTERS, SHIPPED

    assert set(cli.SHIPPED_HEADS) == set(SHIPPED)
    assert set(cli.SHIPPED_BLOCK_DRAFTERS) == set(BLOCK_DRAFTERS)
