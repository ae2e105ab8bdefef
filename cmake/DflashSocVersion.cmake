include_guard(GLOBAL)

# Lower-cases an Ascend SoC name and resolves short aliases: "Ascend910B1", "910b1" -> ascend910b1;
# "910b", "a2" -> ascend910b1; "a3", "910_93" -> ascend910_9391. The kernels use the A2/A3 vector
# API (DataCopyPad, Sum), so only the 910B and 910_93 families are accepted.
function(dflash_soc_version input out_var)
  string(TOLOWER "${input}" soc)
  string(REGEX REPLACE "^ascend" "" soc "${soc}")
  set(aliases "910b=910b1" "a2=910b1" "a3=910_9391" "910_93=910_9391")
  foreach(alias IN LISTS aliases)
    string(REPLACE "=" ";" pair "${alias}")
    list(GET pair 0 short)
    list(GET pair 1 full)
    if(soc STREQUAL short)
      set(soc "${full}")
    endif()
  endforeach()
  if(NOT soc MATCHES "^(910b[1-4]|910b2c|910b4-1|910_93[0-9][0-9])$")
    message(FATAL_ERROR "SOC_VERSION=${input} is not an Ascend SoC these kernels support: use "
                        "ascend910b1..ascend910b4, ascend910b2c, ascend910b4-1 or ascend910_93xx "
                        "(aliases: 910b, a2, a3, 910_93)")
  endif()
  set(${out_var} "ascend${soc}" PARENT_SCOPE)
endfunction()
