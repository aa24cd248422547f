# The two commands a fresh machine needs: `make run` and `make test`.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.simmer-installed

# llama.cpp compiles for the build machine's CPU (-march=native). Some VMs advertise Intel AMX without
# enabling it, and ggml's AMX kernels then die with SIGILL on the first matmul: build without them on x86.
# CMake starts CMAKE_C_FLAGS/CMAKE_CXX_FLAGS from CFLAGS/CXXFLAGS; an explicit -mno-* wins over -march=native.
LLAMA_FLAGS := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

.PHONY: run check test lint format bench docker-test test-arm64 test-avx2 clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Install, fetch + convert + verify the default model (with progress), then serve it.
run: $(STAMP)
	$(BIN)/simmer pull
	$(BIN)/simmer serve

# The tests whose branches depend on what the CPU's kernels do with a batch: run again with the batch probe
# answering as other CPU classes measure (tests/conftest.py --batch-rows), so a change that breaks them
# there shows on any machine (docs/development.md).
BATCH_TESTS := tests/models/runtime/test_batch.py tests/server/serving/test_batch_serving.py

# The first loop of a change: lint, then every test that needs neither the real SmolLM2, Chromium nor Docker
# (nothing to download or compile beyond the venv), without the schemathesis campaign. `make test` is the
# whole suite, as CI runs it.
check: lint
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not slow and not browser and not docker and not campaign"

# Lint, then the whole test suite. Installs, when it can, Chromium for the browser tests and the llama.cpp
# peer (llama-cpp-python compiles llama.cpp once, ~5 minutes; pip reuses the wheel after) for the tests
# that compare with it; without them those tests skip and say why.
# pytest runs on 2 worker processes (pytest-xdist); --dist loadfile keeps each file's tests, and so its
# module fixtures, in one process. pytest's exit code 5 (no test ran) still fails the target.
test: lint
	-bash tests/install_browser.sh
	$(BIN)/python -c 'import llama_cpp' 2>/dev/null || CFLAGS="$(LLAMA_FLAGS)" CXXFLAGS="$(LLAMA_FLAGS)" \
		$(BIN)/python -m pip install -q 'llama-cpp-python[server]==0.3.36' || echo "llama.cpp peer not installed: its comparison tests skip"
	$(BIN)/python -m pytest -n 2 --dist loadfile
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not slow" --batch-rows=one-row-inexact $(BATCH_TESTS)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not slow" --batch-rows=differ $(BATCH_TESTS)

# ruff; pyright (basic) on the packages [tool.pyright] lists; import-linter's layering contracts
# ([tool.importlinter] in pyproject.toml). All offline: pyright's node comes from a wheel.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pyright
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/simmer bench engine --json bench-engine.json

docker-test:
	bash docker/test.sh

# The suite on arm64 (Debian bookworm under qemu-user; needs root for the chroot): the not-slow tests and one
# end-to-end test. Not part of CI. The first run builds and caches the root filesystem (docs/arm64.md).
test-arm64:
	bash tests/arm64/run.sh

# The tests that depend on the CPU's kernels on an emulated AVX2 CPU (qemu-x86_64 -cpu Haswell). Not in CI.
test-avx2: $(STAMP)
	bash tests/avx2/run.sh

clean:
	rm -rf $(VENV) .pytest_cache
