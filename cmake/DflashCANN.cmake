# Finds the CANN toolkit for dflash's Ascend C kernels and includes its ascendc.cmake, which
# provides ascendc_library() and ascendc_include_directories().
#
# In:  ASCEND_HOME_PATH (cache variable, else the environment variable set by <CANN>/set_env.sh)
#      SOC_VERSION      (cache variable, else the environment variable; default ascend910b1)
# Out: ASCEND_CANN_PACKAGE_PATH, SOC_VERSION (lower case, aliases resolved), RUN_MODE=npu,
#      ASCENDC_CMAKE_DIR
include_guard(GLOBAL)

include(DflashSocVersion)

if(NOT ASCEND_HOME_PATH)
  set(ASCEND_HOME_PATH "$ENV{ASCEND_HOME_PATH}")
endif()
if(NOT ASCEND_HOME_PATH)
  message(FATAL_ERROR "ASCEND_HOME_PATH is not set: source <CANN>/set_env.sh "
                      "(e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) or pass -DASCEND_HOME_PATH")
endif()
if(NOT IS_DIRECTORY "${ASCEND_HOME_PATH}")
  message(FATAL_ERROR "ASCEND_HOME_PATH=${ASCEND_HOME_PATH} is not a directory")
endif()
set(ASCEND_CANN_PACKAGE_PATH "${ASCEND_HOME_PATH}")

if(NOT SOC_VERSION)
  set(SOC_VERSION "$ENV{SOC_VERSION}")
endif()
if(NOT SOC_VERSION)
  set(SOC_VERSION "ascend910b1")
endif()
dflash_soc_version("${SOC_VERSION}" SOC_VERSION)
set(RUN_MODE "npu")
message(STATUS "dflash: CANN at ${ASCEND_CANN_PACKAGE_PATH}, SOC_VERSION=${SOC_VERSION}")

# Where ascendc.cmake lives differs between CANN releases.
unset(ASCENDC_CMAKE_DIR)
foreach(dir tools/tikcpp/ascendc_kernel_cmake compiler/tikcpp/ascendc_kernel_cmake
            ascendc_devkit/tikcpp/samples/cmake)
  if(NOT ASCENDC_CMAKE_DIR AND EXISTS "${ASCEND_CANN_PACKAGE_PATH}/${dir}/ascendc.cmake")
    set(ASCENDC_CMAKE_DIR "${ASCEND_CANN_PACKAGE_PATH}/${dir}")
  endif()
endforeach()
if(NOT ASCENDC_CMAKE_DIR)
  message(FATAL_ERROR "ascendc.cmake not found under ${ASCEND_CANN_PACKAGE_PATH} "
                      "(tools/, compiler/ or ascendc_devkit/tikcpp/...): is the CANN toolkit "
                      "(with the Ascend C devkit) installed?")
endif()
include("${ASCENDC_CMAKE_DIR}/ascendc.cmake")
