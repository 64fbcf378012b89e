# libFuzzer targets for the parsers that read bytes from outside the process: the job-spec JSON
# with the daemon's validation, the daemon config, the safetensors header, the Megatron index,
# the executor event stream and the GEMM plan cache files. bench/fuzz/run.sh configures, builds and runs them.
#
#   cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DMEGACPP_FUZZ=ON \
#     -DMEGACPP_CUDA=OFF -DMEGACPP_BUILD_TESTS=OFF -DMEGACPP_BUILD_BENCH=OFF
#   cmake --build build-fuzz --target megacpp_fuzz
option(MEGACPP_FUZZ "Build the libFuzzer targets in bench/fuzz (clang only)" OFF)
if(NOT MEGACPP_FUZZ)
  return()
endif()
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "MEGACPP_FUZZ needs clang for libFuzzer: "
                      "configure with -DCMAKE_CXX_COMPILER=clang++-14")
endif()
if(MEGACPP_CUDA)
  message(FATAL_ERROR "MEGACPP_FUZZ builds the host parsers only: add -DMEGACPP_CUDA=OFF")
endif()

# Every undefined-behaviour report must stop the run, or libFuzzer would count it as a pass.
set(MEGACPP_FUZZ_SANITIZERS -fsanitize=address,undefined -fno-sanitize-recover=all
                            -fno-omit-frame-pointer)

# The libraries already exist when this file is included (it comes last), so the instrumentation
# goes onto each of them; coverage feedback must reach into the parsers, not just the harnesses.
get_property(_megacpp_fuzz_targets DIRECTORY ${CMAKE_SOURCE_DIR} PROPERTY BUILDSYSTEM_TARGETS)
list(APPEND _megacpp_fuzz_targets megacpp_proto)
foreach(target ${_megacpp_fuzz_targets})
  if(NOT TARGET ${target})
    continue()
  endif()
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "STATIC_LIBRARY" OR type STREQUAL "EXECUTABLE")
    # -Wno-pass-failed: clang reports each `omp simd` loop its vectorizer leaves scalar under
    # ASan at -O1 as a warning; that says nothing about the code and the kernels are not fuzzed.
    target_compile_options(${target} PRIVATE -fsanitize=fuzzer-no-link ${MEGACPP_FUZZ_SANITIZERS}
                                             -Wno-pass-failed)
  endif()
  if(type STREQUAL "EXECUTABLE")
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endforeach()

# target:library. Each harness links the lowest library that holds its parser, so the build
# compiles nothing the fuzzers never call (no daemon server, CLI or tests).
set(MEGACPP_FUZZ_TARGETS
    safetensors:megacpp_runtime
    indexed_dataset:megacpp_runtime
    daemon_config:megacpp_service
    event_stream:megacpp_service
    job_spec:megacpp_service
    plan_cache:megacpp_base)
add_custom_target(megacpp_fuzz)
foreach(entry ${MEGACPP_FUZZ_TARGETS})
  string(REPLACE ":" ";" parts ${entry})
  list(GET parts 0 name)
  list(GET parts 1 library)
  set(sources ${CMAKE_SOURCE_DIR}/bench/fuzz/${name}_fuzz.cpp)
  if(name STREQUAL "job_spec")
    # The validation alone, not megacpp_daemon: the rest of that library is the gRPC and HTTP
    # server, several minutes of clang+ASan compile time that the harness never calls.
    list(APPEND sources ${CMAKE_SOURCE_DIR}/daemon/job_spec.cpp)
  endif()
  add_executable(${name}_fuzz ${sources})
  target_compile_options(${name}_fuzz PRIVATE ${MEGACPP_WARNINGS} -fsanitize=fuzzer
                                              ${MEGACPP_FUZZ_SANITIZERS})
  target_link_options(${name}_fuzz PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(${name}_fuzz PRIVATE ${library})
  set_target_properties(${name}_fuzz PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                                                ${CMAKE_BINARY_DIR}/fuzz)
  add_dependencies(megacpp_fuzz ${name}_fuzz)
endforeach()
