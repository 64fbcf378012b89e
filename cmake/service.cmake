# The service side: the gRPC API (proto/), the executor protocol, the daemon
# (megacppd), the executor process (megacpp-executor) and the CLI (megacpp).
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
find_package(SQLite3 REQUIRED)

add_subdirectory(${CMAKE_SOURCE_DIR}/proto ${CMAKE_BINARY_DIR}/proto)

# The daemon's library (everything but its main) and the executor protocol.
file(GLOB MEGACPP_SERVICE_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/daemon/*.cpp
     ${CMAKE_SOURCE_DIR}/runtime/executor/*.cpp ${CMAKE_SOURCE_DIR}/cli/client/*.cpp)
list(FILTER MEGACPP_SERVICE_SOURCES EXCLUDE REGEX "_main\\.cpp$")
add_library(megacpp_service STATIC ${MEGACPP_SERVICE_SOURCES})
target_compile_options(megacpp_service PRIVATE ${MEGACPP_WARNINGS})
target_link_libraries(megacpp_service PUBLIC megacpp_runtime megacpp_proto gRPC::grpc++
                      gRPC::grpc++_reflection PkgConfig::HTTPLIB SQLite::SQLite3)
if(TARGET megacpp_receipts)
  target_link_libraries(megacpp_service PUBLIC megacpp_receipts)
endif()
target_link_libraries(megacpp_all INTERFACE megacpp_service)

foreach(binary megacppd:daemon/megacppd_main.cpp
               megacpp-executor:runtime/executor/executor_main.cpp
               megacpp:cli/main.cpp)
  string(REPLACE ":" ";" parts ${binary})
  list(GET parts 0 name)
  list(GET parts 1 source)
  file(GLOB extra_sources CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/cli/commands/*.cpp)
  if(NOT name STREQUAL "megacpp")
    set(extra_sources)
  endif()
  add_executable(${name} ${source} ${extra_sources})
  target_compile_options(${name} PRIVATE ${MEGACPP_WARNINGS})
  target_link_libraries(${name} PRIVATE megacpp_service CLI11::CLI11)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
endforeach()
