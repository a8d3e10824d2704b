# A thin wrapper over the CMake presets (as DuckDB's Makefile is).
#
#   make demo   install what is missing, build (release), run the main job
#   make test   install what is missing, build and run every test this machine can run:
#               release (all labels but soak; gpu tests skip without a GPU; the torch tests under
#               Debian's torch 1.13, label torch, and under PyPI's torch 2.x in the venv that
#               scripts/install-deps makes, label torch2), then the unit tests under the asan and
#               tsan presets
#   make bench-deps   also install the benchmarks' peers (fio, python3-torch)
#   make release|debug|asan|tsan   configure + build one preset
#   make format        format every tracked source with clang-format 14 (.clang-format)
#   make format-check  fail, naming the files, when any tracked source drifts from it
#                      (make test runs it first, so CI fails on drift)
#   make function-length-check  fail on a function over 80 lines in runtime/ or api/
#                      without a reason comment (scripts/check-function-length; make test runs it)
#   make notes-check   fail on a `Note [X]` cited but defined nowhere (scripts/check-notes;
#                      make test runs it; also ctest check_notes, label unit)
#   make docs-check    fail on a doc the tree contradicts: folder READMEs' May call / Called by
#                      vs the #includes, docs/config.md vs Config::keys(), links of README.md and
#                      docs/ (scripts/check-docs; make test runs it; also ctest check_docs, label unit)

JOBS ?= $(shell nproc)
PRESETS := release debug asan tsan

.PHONY: demo test deps bench-deps $(PRESETS) clean format format-check function-length-check notes-check docs-check \
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

demo: deps release
	scripts/demo build/release

test: deps format-check function-length-check notes-check docs-check
	cmake --preset release -DSTRATA_REQUIRE_TORCH2=ON >/dev/null
	$(MAKE) release
	ctest --preset release
	$(MAKE) asan
	ctest --preset asan
	$(MAKE) tsan
	ctest --preset tsan

function-length-check:
	scripts/check-function-length

notes-check:
	scripts/check-notes

docs-check:
	scripts/check-docs

gpu-check:
	scripts/gpu-check

format:
	$(SOURCES) | xargs $(CLANG_FORMAT) -i

format-check:
	@$(CLANG_FORMAT) --version | grep -q 'version 14\.' || { echo "format-check: needs clang-format 14 (scripts/install-deps installs it)" >&2; exit 1; }
	@$(SOURCES) | xargs $(CLANG_FORMAT) --dry-run --Werror || { echo "format-check: sources drift from .clang-format; run make format" >&2; exit 1; }

clean:
	rm -rf build
