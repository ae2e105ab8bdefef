# Finds torch (its CMake package) and torch_npu (headers and libtorch_npu) through the Python that
# runs the build (Python3_EXECUTABLE; setup.py passes its own).
# Out: TORCH_LIBRARIES, TORCH_CXX_FLAGS (from find_package(Torch)), TORCH_NPU_DIR
include_guard(GLOBAL)

find_package(Python3 REQUIRED COMPONENTS Interpreter)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
          "import os, torch, torch_npu; print(torch.utils.cmake_prefix_path + ';' + os.path.dirname(torch_npu.__file__))"
  OUTPUT_VARIABLE paths
  ERROR_VARIABLE error
  RESULT_VARIABLE failed
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(failed)
  message(FATAL_ERROR "${Python3_EXECUTABLE} cannot import torch and torch_npu:\n${error}")
endif()
list(GET paths 0 torch_prefix)
list(GET paths 1 TORCH_NPU_DIR)
list(APPEND CMAKE_PREFIX_PATH "${torch_prefix}")
find_package(Torch REQUIRED)
message(STATUS "dflash: torch_npu at ${TORCH_NPU_DIR}")
