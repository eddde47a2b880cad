"""Worker entry point: ``python -m megatron_railwave.lab.testbed._worker RUN_DIR RANK`` (started by
run_workers)."""

import sys

from megatron_railwave.lab.testbed.launch import _worker_main

if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]))
