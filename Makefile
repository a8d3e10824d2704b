# A thin wrapper over the CMake presets (as DuckDB's Makefile is).
#
#   make demo   install what is missing, build (release), run the main job
#   make test   install what is missing, build and run every test this machine can run:
#               release (all labels; gpu tests skip without a GPU), then the unit tests
#               under the asan and tsan presets
#   make bench-deps   also install the benchmarks' peers (fio, python3-torch)
#   make release|debug|asan|tsan   configure + build one preset

JOBS ?= $(shell nproc)
PRESETS := release debug asan tsan

.PHONY: demo test deps bench-deps $(PRESETS) clean format gpu-check

deps:
	scripts/install-deps

bench-deps:
	scripts/install-deps --bench

$(PRESETS):
	cmake --preset $@ >/dev/null
	cmake --build --preset $@ -j $(JOBS)

demo: deps release
	scripts/demo build/release

test: deps
	$(MAKE) release
	ctest --preset release
	$(MAKE) asan
	ctest --preset asan
	$(MAKE) tsan
	ctest --preset tsan

gpu-check:
	scripts/gpu-check

format:
	git ls-files '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf build
