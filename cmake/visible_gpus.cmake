# kvl_visible_gpus(<found> <archs>): whether this machine shows a CUDA GPU, and the CUDA
# architectures of the visible GPUs that the kernels can run on (sm_80 and newer), as CMake
# spells them ("80-real;90-real"), lowest first, without PTX.
#
# A GPU is visible when `nvidia-smi -L` runs and lists one ("GPU 0: ..."); nvcc alone says
# nothing (CI and the development machines have nvcc and no GPU). The architectures come from
# `nvidia-smi --query-gpu=compute_cap`; a driver too old for that query gives "native" (nvcc asks
# the driver). GPUs below sm_80 are left out: found is TRUE and archs empty when only those are
# visible. Kept apart from CMakeLists.txt so that tests/op/test_package.py can run the rule
# against a stand-in nvidia-smi (cmake -P).
function(kvl_visible_gpus found_var archs_var)
  set(found FALSE)
  set(archs "")
  find_program(kvl_nvidia_smi nvidia-smi NO_CACHE)
  if(kvl_nvidia_smi)
    execute_process(COMMAND "${kvl_nvidia_smi}" -L
                    OUTPUT_VARIABLE listing RESULT_VARIABLE listed ERROR_QUIET TIMEOUT 30)
    if(listed EQUAL 0 AND listing MATCHES "GPU [0-9]+:")
      set(found TRUE)
    endif()
  endif()
  if(found)
    execute_process(COMMAND "${kvl_nvidia_smi}" --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE caps RESULT_VARIABLE queried ERROR_QUIET TIMEOUT 30)
    string(REGEX MATCHALL "[0-9]+\\.[0-9]+" caps "${caps}")
    if(NOT queried EQUAL 0 OR NOT caps)
      set(archs native)
    else()
      foreach(cap IN LISTS caps)
        string(REPLACE "." "" arch "${cap}")
        if(arch GREATER_EQUAL 80)
          list(APPEND archs "${arch}-real")
        endif()
      endforeach()
      list(REMOVE_DUPLICATES archs)
      list(SORT archs COMPARE NATURAL)
    endif()
  endif()
  set(${found_var} ${found} PARENT_SCOPE)
  set(${archs_var} "${archs}" PARENT_SCOPE)
endfunction()
