#!/usr/bin/env bash
# Conformance of the DeepEP backend and its fake against the real DeepEP wheel, without a GPU.
#
# Builds (once) a throwaway venv OUTSIDE the repository with the CUDA torch 2.14.1 (cu130) and
# the `tokenspeed-deepep` 2.1 wheel (about 5.5 GB with torch's CUDA dependencies), puts a stub
# `libcuda.so.1` (an empty shared object: the wheel's _C names libcuda.so.1 as a dependency but
# calls the driver through the runtime) and the pip-installed NVSHMEM / NCCL libraries on the
# library path, then runs the `deepep`-marked tests (tests/unit/exchange/test_deepep_conformance.py):
# every signature, default, return arity and handle layout the backend and the fake rely on.
#
# Usage: make deepep-conformance   (DEEPEP_VENV=/tmp/deepep-venv by default; PY=python3.11)
#        bash scripts/deepep_conformance.sh --setup-only   (build the venv, run nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DEEPEP_VENV:-/tmp/deepep-venv}"
PY="${PY:-python3.11}"
case "$VENV" in
  "$PWD"|"$PWD"/*) echo "DEEPEP_VENV=$VENV is inside the repository; give a path outside it (e.g. /tmp/deepep-venv)"; exit 2;;
esac
if [ ! -f "$VENV/.deepep-ready" ]; then
  echo "== building $VENV (CUDA torch 2.14.1 + tokenspeed-deepep 2.1; several GB, once)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==2.14.1" numpy pyyaml pytest pytest-timeout hypothesis \
      "packaging>=24.2" typing_extensions
  # The wheel declares no dependencies; it needs the CUDA torch above (NVSHMEM and NCCL come with it).
  "$VENV/bin/python" -m pip install -q --no-deps "tokenspeed-deepep>=2.1,<2.2"
  mkdir -p "$VENV/libcuda-stub"
  echo 'void railwave_libcuda_stub(void) {}' > "$VENV/libcuda-stub/stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$VENV/libcuda-stub/libcuda.so.1" "$VENV/libcuda-stub/stub.c"
  touch "$VENV/.deepep-ready"
fi
[ "${1:-}" = "--setup-only" ] && exit 0
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export LD_LIBRARY_PATH="$SITE/nvidia/nvshmem/lib:$SITE/nvidia/nccl/lib:$SITE/nvidia/cu13/lib:$VENV/libcuda-stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAILWAVE_OPS=reference
"$VENV/bin/python" -c "import deep_ep; print('deep_ep', deep_ep.__version__, 'from', deep_ep.__file__)"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m deepep tests/unit/exchange/test_deepep_conformance.py
