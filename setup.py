"""The wheel leaves out the repository-only modules of its packages (see
pyproject.toml's [tool.setuptools] note); everything else is in pyproject.toml."""

from setuptools import setup
from setuptools.command.build_py import build_py

# (package, module) pairs that stay in the repository: benchmarks, the HF
# reference decoders (EAGLE trees and DDTree), the docs' support-table generator, the SGLang test doubles,
# the CPU-features line of CI and the host-kernel bench
REPOSITORY_ONLY = {
    ("spec_plugins", "acceptance_bench"),
    ("spec_plugins", "bench_noise"),
    ("spec_plugins", "block_bench"),
    ("spec_plugins", "block_decoder"),
    ("spec_plugins", "cpu_features"),
    ("spec_plugins", "cpu_v2_interpreter"),
    ("spec_plugins", "reference_decoder"),
    ("spec_plugins", "support_table"),
    ("spec_plugins", "vllm_bench"),
    ("spec_plugins.sglang_ext", "_testing"),
}


class RuntimeBuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] not in REPOSITORY_ONLY]


setup(cmdclass={"build_py": RuntimeBuildPy})
