# Two entry points that work on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.railwave-installed

.PHONY: demo test lint format test-all test-mcore-oldest setup clean plan-bench bench bench-paper scale-study bench-exchange testbed-bench gpu-check \
	simulate-exchange workload-fit token-skew call-costs ext kernels-check ops-bench deepep-conformance deepep-hardware-check

# setup.py ships the opt-in RAILWAVE_AUTO_INSTALL startup hook (megatron_railwave_autoinstall.pth).
$(STAMP): pyproject.toml setup.py megatron_railwave_autoinstall.pth
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch first, so that nothing later pulls a multi-GB CUDA build.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q numpy "packaging>=24.2" pyyaml pytest pytest-timeout hypothesis rich tqdm matplotlib scipy typing_extensions import-linter \
		ruff==0.17.6
	$(VPY) -m pip install -q --ignore-requires-python --no-deps megatron-core==0.19.2
	RAILWAVE_BUILD_EXT=0 $(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The compiled ops (megatron_railwave._C, built in place): the CPU twins, plus the CUDA kernels
# where torch has CUDA and nvcc is found. Rebuilt when csrc/ or setup.py change.
CSRC := $(shell find csrc -type f 2>/dev/null)
EXT_STAMP := $(VENV)/.railwave-ext
$(EXT_STAMP): $(STAMP) setup.py $(CSRC)
	$(VPY) setup.py -q build_ext --inplace
	@touch $(EXT_STAMP)

ext: $(EXT_STAMP)

# Compile check of the torch-free device code (csrc/kernels) for sm_90 with bare nvcc: no GPU
# and no CUDA torch needed. Skipped with a message where nvcc is missing.
NVCC ?= nvcc
KERNELS_CHECK := build/kernels_check_sm90.o
$(KERNELS_CHECK): $(wildcard csrc/kernels/*) $(wildcard csrc/common/*.cuh)
	@mkdir -p build
	$(NVCC) -arch=sm_90 -O3 -c csrc/kernels/compile_check.cu -o $(KERNELS_CHECK)

kernels-check:
	@if command -v $(NVCC) >/dev/null 2>&1; then $(MAKE) --no-print-directory $(KERNELS_CHECK); \
	else echo "note: $(NVCC) not found; skipping the csrc/kernels compile check"; fi

# Best effort: SimGrid (Debian python3-simgrid) for the flow-model cross-check test; the test
# skips with a reason where it cannot be installed.
SIMGRID_STAMP := $(VENV)/.simgrid-tried
$(SIMGRID_STAMP): $(STAMP)
	-@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! /usr/bin/python3 -c "import simgrid" 2>/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-simgrid) >/dev/null 2>&1 \
		|| echo "note: python3-simgrid not installed; the SimGrid cross-check will be skipped"; fi
	@touch $(SIMGRID_STAMP)

setup: $(STAMP)

# ruff: lint (pyflakes, pycodestyle, isort, pyupgrade, bugbear) and the formatter's check.
# `make format` rewrites the tree in the house style.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Lint and format ([tool.ruff] in pyproject.toml), then the import contracts of
# docs/architecture.md ([tool.importlinter]), then pytest.
# RAILWAVE_REQUIRE_EXT=1: the ops tests fail (rather than skip) if the compiled ops did not load.
test: $(STAMP) $(SIMGRID_STAMP) $(EXT_STAMP) kernels-check lint
	$(VENV)/bin/lint-imports
	RAILWAVE_REQUIRE_EXT=1 $(VPY) -m pytest -q -m "not slow" --timeout=900 --durations=15

# The oldest supported Megatron-Core (plugin.SUPPORTED_MEGATRON_CORE) laid over the venv's newest
# with PYTHONPATH (no second torch): the Megatron integration tests only (~6 min here).
MCORE_OLDEST := 0.15.3
MCORE_OLDEST_DIR := $(VENV)/mcore-$(MCORE_OLDEST)
MEGATRON_TESTS := tests/unit/test_layer_spec.py tests/integration/test_dispatcher_megatron.py \
	tests/integration/test_dispatcher_layouts.py tests/integration/test_dispatcher_errors.py

$(MCORE_OLDEST_DIR)/.installed: $(STAMP)
	$(VPY) -m pip install -q --ignore-requires-python --no-deps --target $(MCORE_OLDEST_DIR) megatron-core==$(MCORE_OLDEST)
	@touch $@

test-mcore-oldest: $(MCORE_OLDEST_DIR)/.installed
	PYTHONPATH=$(MCORE_OLDEST_DIR) RAILWAVE_EXPECT_MEGATRON_CORE=$(MCORE_OLDEST) $(VPY) -m pytest -q -m "not slow" \
		--timeout=1800 $(MEGATRON_TESTS)

test-all: $(STAMP) $(EXT_STAMP)
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -q --timeout=1800

# The main job: plan one GLM-4.5-Air layer per path, then train the tiny GLM-shaped MoE GPT on
# 8 CPU processes (4 nodes x 2 GPUs) with railwave and with alltoall, losses side by side, then a
# summary (ops used, each layer's path and bytes, where to look next). The compiled ops are built
# first (`ext`, output in $(VENV)/ext-build.log); where they cannot be built, one line says so and
# the demo runs the pure-torch reference ops (RAILWAVE_OPS=reference: the same numbers, and the job
# does not warn about the fallback again).
demo: $(STAMP)
	@if $(MAKE) --no-print-directory $(EXT_STAMP) >$(VENV)/ext-build.log 2>&1; then ops=auto; \
		echo "compiled ops: megatron_railwave._C is built"; \
	else ops=reference; echo "note: the compiled ops did not build ($(VENV)/ext-build.log says why);" \
		"the demo runs the pure-torch reference ops, with the same numbers"; fi; \
	set -x; RAILWAVE_OPS=$$ops $(VPY) -m megatron_railwave.cli demo \
		&& RAILWAVE_OPS=$$ops $(VPY) examples/demo.py --steps 5

bench-exchange: $(STAMP) $(EXT_STAMP)
	$(VPY) -m megatron_railwave.cli bench-exchange --json out/bench_exchange.json

# Per-call costs of the exchange on CPU gloo and the virtual cluster (count exchange, per phase,
# RailBalance planning), the numbers behind the flow model's per-call cost fields (docs/selector.md).
call-costs: $(STAMP)
	$(VPY) -m megatron_railwave.cli call-costs --json out/call_costs.json

# The DeepEP backend and its fake against the real DeepEP wheel (signatures, return arities,
# handle layout, Config hints), without a GPU: builds a CUDA-torch venv OUTSIDE the repository
# (DEEPEP_VENV, default /tmp/deepep-venv, ~5.5 GB, once) and runs the `deepep`-marked tests.
deepep-conformance:
	bash scripts/deepep_conformance.sh

# The first hardware run of the DeepEP backend (NOT YET RUN): on every node of a >= 2 x 8 GPU rail
# cluster, NNODES=.. NODE_RANK=.. MASTER_ADDR=.. make deepep-hardware-check (docs/deepep.md).
deepep-hardware-check:
	bash scripts/deepep_hardware_check.sh

# Each compiled op against its pure-torch reference and a plain copy, GLM-4.5-Air sizes, one thread.
ops-bench: $(EXT_STAMP)
	$(VPY) -m megatron_railwave.cli ops-bench --device cpu --json out/ops_bench_cpu.json

plan-bench: $(STAMP)
	$(VPY) -m megatron_railwave.cli plan-bench --json out/plan_bench.json

# The flow model: every path on 45 GLM-4.5-Air layers under RING / MODERATE / EXTREME (~20 s).
bench: $(STAMP)
	@mkdir -p out
	$(VPY) -m megatron_railwave.cli bench --backend netmodel --cluster h800_4x8 \
		--workload glm45-air --json out/bench.json --plot out/bench.png

# The synthetic GLM-4.5-Air workload next to the paper's published statistics (docs/workloads.md);
# WORKLOAD_FIT_ARGS=--refit reruns the fit of its knobs first (minutes).
workload-fit: $(STAMP)
	@mkdir -p out
	$(VPY) -m megatron_railwave.cli workloads fit --json out/workload_fit.json $(WORKLOAD_FIT_ARGS)

# Token skew of real batching (docs/workloads.md, "Where token skew comes from"): the tiny GLM on
# 8 gloo processes (4 x 2) with the routing capture, per batching mode, then the skew of the captures.
TOKEN_SKEW_RUN = $(VPY) examples/train_glm_tiny.py --nprocs 8 --gpus-per-node 2 --moe-token-dispatcher-type railwave
token-skew: $(STAMP)
	@rm -rf out/token_skew && mkdir -p out/token_skew
	$(TOKEN_SKEW_RUN) --railwave-capture-dir out/token_skew/fixed --json out/token_skew/fixed.json \
		--batching fixed --steps 4 --seq-length 32 --micro-batch-size 4
	$(TOKEN_SKEW_RUN) --railwave-capture-dir out/token_skew/packed --json out/token_skew/packed.json \
		--batching packed --steps 8 --seq-length 256 --micro-batch-size 4
	$(TOKEN_SKEW_RUN) --railwave-capture-dir out/token_skew/budget --json out/token_skew/budget.json \
		--batching budget --steps 3 --seq-length 256 --samples-per-rank 8 --max-tokens-per-gpu 512
	$(TOKEN_SKEW_RUN) --railwave-capture-dir out/token_skew/budget_balanced --json out/token_skew/budget_balanced.json \
		--batching budget --balance-ranks --steps 3 --seq-length 256 --samples-per-rank 8 --max-tokens-per-gpu 512
	$(VPY) -m megatron_railwave.cli workloads token-skew out/token_skew/fixed out/token_skew/packed \
		out/token_skew/budget out/token_skew/budget_balanced --json out/token_skew/token_skew.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis megatron_railwave/_C*.so

# Needs root, ip and tc: 4 nodes x 4 rails at 10 Mbit/s in network namespaces, the exchange study, the
# k-to-1 probe, the flow model and the rail fault (4 x 2: add --gpus-per-node 2). About 20 min.
testbed-bench: $(STAMP)
	$(VPY) -m megatron_railwave.cli testbed run --nodes 4 --gpus-per-node 4 --rail-mbit 10 --samples 12 --incast --json out/testbed.json

# The virtual cluster on this CPU: every path of an H800 4x8 layer (T=512, H=256) in one process.
simulate-exchange: $(STAMP)
	$(VPY) -m megatron_railwave.cli simulate-exchange --cluster h800_4x8 --tokens 512 --hidden 256 \
		--json out/simulate_exchange.json

# The prepared device check (docs/ops.md, "The GPU check"): exit 0 all steps passed, 1 a step
# failed, 2 no CUDA device. The venv's python where there is one (the device machine has none).
gpu-check:
	PY=$(if $(wildcard $(VPY)),$(abspath $(VPY)),python3) bash scripts/gpu_check.sh

# The paper's grid on the flow model: H800 and H20 x RING / MODERATE / EXTREME, every path (PERM and
# JOINT also with 3 rail chunks per wave) and the peers (Megatron all-to-all, FAST-style BvN), payload
# scaled to the paper's layer times ('paper' = workloads.PAPER_PAYLOAD_SCALE, 1.895: NATIVE RING on
# H800 then sums to the paper's 1.801 s over the 45 layers), on the incast what-if presets (alpha
# 4.3165 fitted on the paper's workload-free UltraEP case alone; docs/netmodel.md). ~2 min each.
# BENCH_PAPER_MODEL=  (empty) runs the default, max-min presets (no incast loss) instead.
BENCH_PAPER_MODEL ?= _paper_incast
bench-paper: $(STAMP) $(EXT_STAMP)
	@mkdir -p out
	$(VPY) -m megatron_railwave.cli bench --cluster h800_4x8 --model h800_4x8$(BENCH_PAPER_MODEL) \
		--payload-scale paper --chunks 1,3 --plan-repeats 1 --no-progress --json out/bench_paper_h800$(BENCH_PAPER_MODEL).json --plot out/bench_paper_h800$(BENCH_PAPER_MODEL).png
	$(VPY) -m megatron_railwave.cli bench --cluster h20_4x8 --model h20_4x8$(BENCH_PAPER_MODEL) \
		--payload-scale paper --chunks 1,3 --plan-repeats 1 --no-progress --json out/bench_paper_h20$(BENCH_PAPER_MODEL).json --plot out/bench_paper_h20$(BENCH_PAPER_MODEL).png

# The 256-node study of docs/results.md ("Scale study"), saturating incast on the incast what-if
# preset (alpha fitted on UltraEP alone; SCALE_MODEL=h800_4x8 for the max-min
# default). Slow: 11-20 min wall (paper-incast / default), up to ~7 GB memory.
SCALE_MODEL ?= h800_4x8_paper_incast
scale-study: $(STAMP)
	@mkdir -p out
	$(VPY) -m megatron_railwave.cli bench --cluster h800_4x8 --model $(SCALE_MODEL) --nodes 256 --pattern none \
		--layers 8,17,36 --tokens 2048 --fanin 1,4,16 --plan-repeats 1 --no-progress --json out/scale_256_$(notdir $(basename $(SCALE_MODEL))).json
