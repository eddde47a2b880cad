"""Ships megatron_railwave_autoinstall.pth at the root of site-packages (regular and editable
installs): the opt-in startup hook of ``megatron_railwave.autoinstall``, which does nothing unless
RAILWAVE_AUTO_INSTALL=1. Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "megatron_railwave_autoinstall.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class EditableWheelWithPth(editable_wheel):
    # `pip install -e .` (PEP 660): the editable wheel maps the package to the source tree, but a
    # top-level file has to be in the wheel itself.
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # noqa: ANN001, ANN202
        files, mapping = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(unpacked_wheel) / PTH), preserve_mode=False)
        return files, mapping


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
