# The Python client (python/megacpp_client). Its message and service modules are generated from
# proto/ into BUILD/python at build time, never committed, so that they always match the daemon
# they were built with: PYTHONPATH=python:BUILD/python.
#
# protoc and gRPC's Python plugin are the ones the C++ stubs already use (protobuf-compiler,
# protobuf-compiler-grpc). Debian 12's python3-grpc-tools cannot be used: it bundles protoc 3.6,
# which refuses the proto3 `optional` fields of jobs.proto.
set(MEGACPP_PYTHON_OUT ${CMAKE_BINARY_DIR}/python)
file(GLOB MEGACPP_PYTHON_PROTOS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/proto/megacpp/v1/*.proto)
set(MEGACPP_PYTHON_STUBS)
foreach(proto ${MEGACPP_PYTHON_PROTOS})
  get_filename_component(stem ${proto} NAME_WE)
  list(APPEND MEGACPP_PYTHON_STUBS ${MEGACPP_PYTHON_OUT}/megacpp/v1/${stem}_pb2.py
       ${MEGACPP_PYTHON_OUT}/megacpp/v1/${stem}_pb2_grpc.py)
endforeach()
add_custom_command(
  OUTPUT ${MEGACPP_PYTHON_STUBS}
  COMMAND ${CMAKE_COMMAND} -E make_directory ${MEGACPP_PYTHON_OUT}
  COMMAND protobuf::protoc -I ${CMAKE_SOURCE_DIR}/proto --python_out=${MEGACPP_PYTHON_OUT}
          --grpc_python_out=${MEGACPP_PYTHON_OUT}
          --plugin=protoc-gen-grpc_python=$<TARGET_FILE:gRPC::grpc_python_plugin>
          ${MEGACPP_PYTHON_PROTOS}
  DEPENDS ${MEGACPP_PYTHON_PROTOS}
  COMMENT "Generating the Python gRPC modules in ${MEGACPP_PYTHON_OUT}"
  VERBATIM)
add_custom_target(megacpp_python ALL DEPENDS ${MEGACPP_PYTHON_STUBS})

if(NOT MEGACPP_BUILD_TESTS OR NOT TARGET megacppd)
  return()
endif()
# The official-checkpoint importer (python/megacpp_checkpoint) is standard library only: any
# python3 runs its test, which converts a torch-format directory it writes itself and then
# evaluates and trains on the result with the megacpp CLI.
add_test(NAME python.import_official
         COMMAND Python3::Interpreter ${CMAKE_SOURCE_DIR}/tests/python/import_official_test.py
                 --bin-dir $<TARGET_FILE_DIR:megacpp>)
set_tests_properties(python.import_official PROPERTIES LABELS cpu TIMEOUT 300)

# The client needs grpcio and protobuf >= 3.20 (Debian's python3-grpcio, python3-protobuf): the
# first interpreter that has them runs the test (a pyenv python3 ahead of /usr/bin on PATH
# usually has neither).
set(MEGACPP_CLIENT_PYTHON "")
foreach(candidate ${Python3_EXECUTABLE} /usr/bin/python3)
  execute_process(
    COMMAND ${candidate} -c "import grpc; from google.protobuf.internal import builder"
    RESULT_VARIABLE import_result OUTPUT_QUIET ERROR_QUIET)
  if(import_result EQUAL 0)
    set(MEGACPP_CLIENT_PYTHON ${candidate})
    break()
  endif()
endforeach()
if(MEGACPP_CLIENT_PYTHON)
  # A real daemon, as the tests under tests/daemon/ start one: the integration label.
  add_test(NAME python.client
           COMMAND ${MEGACPP_CLIENT_PYTHON} ${CMAKE_SOURCE_DIR}/tests/python/client_test.py
                   --bin-dir $<TARGET_FILE_DIR:megacppd> --stubs ${MEGACPP_PYTHON_OUT})
else()
  add_test(NAME python.client
           COMMAND bash -c "echo 'skipped: no python3 with grpc and protobuf >= 3.20 \
(apt-get install python3-grpcio python3-protobuf, see deploy/install-deps.sh)'; exit 77")
endif()
set_tests_properties(python.client PROPERTIES LABELS integration SKIP_RETURN_CODE 77 TIMEOUT 900)
