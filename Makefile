# A thin wrapper over the CMake presets (as DuckDB's Makefile is).
#
#   make demo   install what the demo needs (scripts/install-deps --demo: no test packages, no
#               torch 2.x venv), build the demo preset's four targets (CUDA only where a GPU is
#               visible), run the main job (scripts/demo)
#   make test   install what is missing, build and run every test this machine can run:
#               release (all labels but soak; gpu tests skip without a GPU; the torch tests under
#               Debian's torch 1.13, label torch, and under PyPI's torch 2.x in the venv that
#               scripts/install-deps makes, label torch2), then the unit tests under the asan and
#               tsan presets (Note [Sanitizer builds])
#   make bench-deps   also install the benchmarks' peers (fio, python3-torch)
#   make release|debug|asan|tsan   configure + build one preset
#   make format        format every tracked source with clang-format 14 (.clang-format)
#   make format-check  fail, naming the files, when any tracked source drifts from it
#                      (make test runs it first, so CI fails on drift)
#   make length-check  fail on a source file over 450 lines, a function over 80 or a class over 400
#                      in the libraries, tools, python/, bench/, examples/ and scripts/ (scripts/check-lengths;
#                      make test runs it; also ctest check_lengths, label unit)
#   make notes-check   fail on a `Note [X]` cited but defined nowhere (scripts/check-notes;
#                      make test runs it; also ctest check_notes, label unit)
#   make owners-check  fail when the tensor and chunk tables have more write sites outside
#                      runtime/src/core/ than scripts/check-owners allows (make test runs it; also
#                      ctest check_owners, label unit)
#   make docs-check    fail on a doc the tree contradicts: folder READMEs' May call / Called by
#                      vs the #includes, docs/config.md vs Config::keys(), links of README.md and
#                      docs/ (scripts/check-docs; make test runs it; also ctest check_docs, label unit)

# Note [Sanitizer builds]: the asan and tsan presets build only what their unit tests run (the
# target unit_tests, Note [Unit targets] in tests/CMakeLists.txt), at -Og (ASan+UBSan) and -O1
# (TSan) with line tables only (-g1). Their build type is RelWithDebInfo, whose own flags
# (-O2 -g) used to follow the preset's and win: ASan+UBSan at -O2 -g compiled a test file in
# 47 s where -Og -g1 takes 13 s, and TSan 16 s where -O1 -g1 takes 9 s.

JOBS ?= $(shell nproc)
PRESETS := release debug asan tsan

.PHONY: demo test deps bench-deps $(PRESETS) clean format format-check length-check notes-check docs-check owners-check \
	gpu-check

# clang-format's output changes between major versions: the check pins 14.
CLANG_FORMAT ?= $(shell command -v clang-format-14 || command -v clang-format)
SOURCES = git ls-files '*.cpp' '*.hpp' '*.h' '*.c' '*.cu' '*.cuh'

deps:
	scripts/install-deps

bench-deps:
	scripts/install-deps --bench

$(PRESETS):
	cmake --preset $@ >/dev/null
	cmake --build --preset $@ -j $(JOBS)

# The demo compiles CUDA only where a GPU driver answers: elsewhere it runs on the sim device, and
# make test compiles the CUDA code (the release preset).
DEMO_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo ON || echo OFF)

demo:
	scripts/install-deps --demo
	cmake --preset demo -DSTRATA_CUDA=$(DEMO_CUDA) >/dev/null
	cmake --build --preset demo -j $(JOBS)
	scripts/demo build/demo

test: deps format-check length-check notes-check docs-check owners-check
	cmake --preset release -DSTRATA_REQUIRE_TORCH2=ON >/dev/null
	$(MAKE) release
	ctest --preset release
	$(MAKE) asan
	ctest --preset asan
	$(MAKE) tsan
	ctest --preset tsan

length-check:
	scripts/check-lengths

notes-check:
	scripts/check-notes

docs-check:
	scripts/check-docs

owners-check:
	scripts/check-owners

gpu-check:
	scripts/gpu-check

format:
	$(SOURCES) | xargs $(CLANG_FORMAT) -i

format-check:
	@$(CLANG_FORMAT) --version | grep -q 'version 14\.' || { echo "format-check: needs clang-format 14 (scripts/install-deps installs it)" >&2; exit 1; }
	@$(SOURCES) | xargs $(CLANG_FORMAT) --dry-run --Werror || { echo "format-check: sources drift from .clang-format; run make format" >&2; exit 1; }

clean:
	rm -rf build
