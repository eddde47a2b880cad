"""Build of the compiled ops (csrc/ -> megatron_railwave._C) and of the opt-in startup hook; the
package metadata is in pyproject.toml.

No quiet fallback: a build that compiles extensions builds the compiled ops for the torch it
finds, or stops with one line naming the cause and the fix (README, Install):

* torch must be importable at build time. pip's default isolated build environment has no torch
  (and must not get one: the ops are built against the torch the job runs with), so install with
  ``pip install --no-build-isolation``; without torch the build stops.
* A CUDA build of torch: the CUDA kernels too (CUDAExtension, for ``TORCH_CUDA_ARCH_LIST``;
  unset, torch picks the visible GPUs' archs); without nvcc the build stops. A CPU torch: the CPU
  twins (CppExtension).
* RAILWAVE_BUILD_EXT=0 is the only way to build without the compiled ops (the pure-torch
  reference ops are used then; ``install()`` refuses that on a CUDA machine unless
  RAILWAVE_OPS=reference).
* The check runs when the extension is built (``build_ext``), so ``sdist`` and the metadata steps
  work without torch.
* CUDA_HOME: /usr/local/bin/nvcc may be a wrapper script, from which torch guesses
  CUDA_HOME=/usr/local; when CUDA_HOME is unset and /usr/local/cuda/bin/nvcc exists, that is used
  instead.
* The C++ standard is left to torch.utils.cpp_extension (torch >= 2.14 headers need C++20).
* -ffp-contract=off on the CPU twins: segment_sum must round every addition, as the GPU's
  __fadd_rn does.
* ninja compiles in parallel (MAX_JOBS); without it torch compiles one file at a time.
* megatron_railwave_autoinstall.pth goes to the root of site-packages (regular and editable
  installs): the startup hook of ``megatron_railwave.autoinstall``, which does nothing unless
  RAILWAVE_AUTO_INSTALL=1.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel
from setuptools.errors import SetupError

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "megatron_railwave._C"
SKIP = "or set RAILWAVE_BUILD_EXT=0 to install without compiled ops (the pure-torch reference ops)"


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


CPU_SOURCES = _sources("csrc/cpu/*.cpp") + _sources("csrc/bindings/*.cpp")
CUDA_SOURCES = _sources("csrc/cuda/*.cu")


def _refusing_build_ext(reason: str) -> type:
    """A build_ext that stops with ``reason`` (as setuptools prints errors: one line)."""

    class RefuseBuildExt(build_ext):
        def run(self) -> None:
            raise SetupError(reason)

    return RefuseBuildExt


def _extensions() -> tuple[list, dict]:
    flag = os.environ.get("RAILWAVE_BUILD_EXT", "1")
    if flag not in ("0", "1"):
        raise SystemExit(
            f"railwave: RAILWAVE_BUILD_EXT={flag!r} must be 0 (no compiled ops) or 1 (the default)"
        )
    if flag == "0":
        print(
            "railwave: RAILWAVE_BUILD_EXT=0, building without the compiled ops (the pure-torch "
            "reference ops will be used; on a CUDA machine install() then needs "
            "RAILWAVE_OPS=reference)"
        )
        return [], {}
    if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    # The same module and sources whatever happens next, so sdist lists them and the wheel is
    # platform-specific; a build_ext that refuses stands in where they cannot be compiled.
    placeholder = [Extension(EXT_NAME, sources=CPU_SOURCES)]
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        return placeholder, {
            "build_ext": _refusing_build_ext(
                f"railwave: torch is not importable in this build environment ({exc}), so the "
                "compiled ops cannot be built; pip's default isolated build has no torch: run "
                "pip with --no-build-isolation in the environment that has torch (README, "
                f"Install), {SKIP}"
            )
        }

    cxx_flags = ["-O3", "-g0", "-ffp-contract=off"]
    nvcc_home = cpp_extension.CUDA_HOME
    if torch.version.cuda is not None:
        if nvcc_home is None or not os.path.exists(os.path.join(nvcc_home, "bin", "nvcc")):
            return placeholder, {
                "build_ext": _refusing_build_ext(
                    f"railwave: torch {torch.__version__} has CUDA {torch.version.cuda} but nvcc "
                    f"was not found (CUDA_HOME={nvcc_home}), so the CUDA ops cannot be built: set "
                    "CUDA_HOME to the CUDA toolkit whose bin/nvcc matches torch's CUDA (e.g. "
                    f"CUDA_HOME=/usr/local/cuda), {SKIP}"
                )
            }
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
        print(
            f"railwave: building the CPU and CUDA ops (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, nvcc in {nvcc_home}) for "
            + (
                f"TORCH_CUDA_ARCH_LIST={archs}"
                if archs
                else "the visible GPUs' archs (TORCH_CUDA_ARCH_LIST unset; e.g. 9.0 for H100/H800)"
            )
        )
        extension = cpp_extension.CUDAExtension(
            name=EXT_NAME,
            sources=CPU_SOURCES + CUDA_SOURCES,
            define_macros=[("RAILWAVE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
        )
    else:
        print(f"railwave: building the CPU ops (torch {torch.__version__}, no CUDA)")
        extension = cpp_extension.CppExtension(
            name=EXT_NAME, sources=CPU_SOURCES, extra_compile_args={"cxx": cxx_flags}
        )
    use_ninja = shutil.which("ninja") is not None
    if not use_ninja:
        print("railwave: ninja not found: compiling one file at a time (pip install ninja)")
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
