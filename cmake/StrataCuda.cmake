# CUDA is optional but on by default when nvcc is found. Without it the build
# says so once and goes on; the runtime then offers the sim device only.
#
# Architectures built (one line each, as ggml does):
#   sm_80  Ampere A100/A30: the oldest data-centre GPU with bf16 tensor cores and
#          async copies; the floor for training offload that uses bf16.
#   sm_90  Hopper H100/H200: the GPUs offload training runs on today; native
#          code avoids a PTX JIT at start-up.
#   PTX for 90 is embedded too, so newer GPUs (Blackwell) JIT from it.
# We link the CUDA runtime (cudart, static) and never libcuda directly, so every
# binary starts on a machine without a driver and reports "no GPU".
set(STRATA_HAVE_CUDA OFF)
if(STRATA_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    endif()
    if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER)
      set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
    endif()
    enable_language(CUDA)
    # CMake 3.25 knows no C++20 flag for nvcc (added in 3.26) and refuses
    # CUDA_STANDARD 20 without one; nvcc 12+ accepts -std=c++20, so name it.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(STRATA_HAVE_CUDA ON)
    message(STATUS "strata: CUDA ${CMAKE_CUDA_COMPILER_VERSION} found; building for ${CMAKE_CUDA_ARCHITECTURES}")
  else()
    message(STATUS "strata: nvcc not found; building without CUDA (sim device only)")
  endif()
else()
  message(STATUS "strata: CUDA disabled by STRATA_CUDA=OFF (sim device only)")
endif()
