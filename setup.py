"""Build of the compiled ops (csrc/ -> megatron_railwave._C) and of the opt-in startup hook; the
package metadata is in pyproject.toml.

* CUDAExtension when torch was built with CUDA and nvcc is found, else CppExtension (CPU twins
only).
* RAILWAVE_BUILD_EXT=0 skips the extension: the package then uses the pure-torch reference ops.
* CUDA_HOME: /usr/local/bin/nvcc may be a wrapper script, from which torch guesses
CUDA_HOME=/usr/local;
  when CUDA_HOME is unset and /usr/local/cuda/bin/nvcc exists, that is used instead.
* The C++ standard is left to torch.utils.cpp_extension (torch >= 2.14 headers need C++20).
* -ffp-contract=off on the CPU twins: segment_sum must round every addition, as the GPU's __fadd_rn
does.
* megatron_railwave_autoinstall.pth goes to the root of site-packages (regular and editable
installs):
  the startup hook of ``megatron_railwave.autoinstall``, which does nothing unless
  RAILWAVE_AUTO_INSTALL=1.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extensions() -> tuple[list, dict]:
    if os.environ.get("RAILWAVE_BUILD_EXT", "1") == "0":
        print(
            "railwave: RAILWAVE_BUILD_EXT=0, skipping the compiled ops (the reference ops will be "
            "used)"
        )
        return [], {}
    if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        print(f"railwave: torch is not importable ({exc}); skipping the compiled ops")
        return [], {}

    sources = _sources("csrc/cpu/*.cpp") + _sources("csrc/bindings/*.cpp")
    cxx_flags = ["-O3", "-g0", "-ffp-contract=off"]
    nvcc_home = cpp_extension.CUDA_HOME
    with_cuda = (
        torch.version.cuda is not None
        and nvcc_home is not None
        and os.path.exists(os.path.join(nvcc_home, "bin", "nvcc"))
    )
    if torch.version.cuda is not None and not with_cuda:
        print(
            f"railwave: torch has CUDA {torch.version.cuda} but nvcc was not found "
            f"(CUDA_HOME={nvcc_home}); "
            "building the CPU ops only"
        )
    if with_cuda:
        extension = cpp_extension.CUDAExtension(
            name="megatron_railwave._C",
            sources=sources + _sources("csrc/cuda/*.cu"),
            define_macros=[("RAILWAVE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
        )
    else:
        extension = cpp_extension.CppExtension(
            name="megatron_railwave._C",
            sources=sources,
            extra_compile_args={"cxx": cxx_flags},
        )
    use_ninja = shutil.which("ninja") is not None
    return [extension], {
        "build_ext": cpp_extension.BuildExtension.with_options(use_ninja=use_ninja)
    }


PTH = "megatron_railwave_autoinstall.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(
            str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH), preserve_mode=False
        )

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class EditableWheelWithPth(editable_wheel):
    # `pip install -e .` (PEP 660): the editable wheel maps the package to the source tree, but a
    # top-level file has to be in the wheel itself.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # noqa: ANN001, ANN202
        files, mapping = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        self.copy_file(
            str(Path(__file__).parent / PTH), str(Path(unpacked_wheel) / PTH), preserve_mode=False
        )
        return files, mapping


ext_modules, cmdclass = _extensions()
setup(
    ext_modules=ext_modules,
    cmdclass={**cmdclass, "build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth},
)
