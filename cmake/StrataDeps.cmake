# Every dependency comes from a Debian package and is found the CMake way.
# scripts/install-deps installs whatever is missing.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)

pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)
pkg_check_modules(JEMALLOC REQUIRED IMPORTED_TARGET jemalloc)
find_package(Boost 1.74 REQUIRED)            # headers only: Asio
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 QUIET CONFIG)
if(NOT CLI11_FOUND)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE ${CLI11_INCLUDE_DIR})
endif()
find_package(nlohmann_json 3.10 REQUIRED)
if(STRATA_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(STRATA_BUILD_BENCH)
  find_package(benchmark QUIET)
endif()
