# The service side: the gRPC API (proto/), the service pieces under service/ (daemon config,
# gates, preconditions, the executor), the daemon (megacppd), the executor process
# (megacpp-executor) and the CLI (megacpp).
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
# The metrics registry and its text format only (prometheus-cpp-core): /metrics is served by the
# daemon's own HTTP endpoint, not by prometheus-cpp-pull's server.
pkg_check_modules(PROMETHEUS_CPP REQUIRED IMPORTED_TARGET prometheus-cpp-core)

add_subdirectory(${CMAKE_SOURCE_DIR}/proto ${CMAKE_BINARY_DIR}/proto)

file(GLOB_RECURSE MEGACPP_SERVICE_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/service/*.cpp)
list(FILTER MEGACPP_SERVICE_SOURCES EXCLUDE REGEX "_main\\.cpp$")
add_library(megacpp_service STATIC ${MEGACPP_SERVICE_SOURCES})
target_compile_options(megacpp_service PRIVATE ${MEGACPP_WARNINGS})
target_link_libraries(megacpp_service PUBLIC megacpp_runtime megacpp_receipts megacpp_proto)
target_link_libraries(megacpp_all INTERFACE megacpp_service)

file(GLOB MEGACPP_DAEMON_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/daemon/*.cpp)
list(FILTER MEGACPP_DAEMON_SOURCES EXCLUDE REGEX "_main\\.cpp$")
# The web page at / (daemon/web/index.html), compiled into the daemon: it serves no files.
set(MEGACPP_WEB_PAGE_HEADER ${CMAKE_BINARY_DIR}/generated/daemon/web_page_html.h)
add_custom_command(
  OUTPUT ${MEGACPP_WEB_PAGE_HEADER}
  COMMAND ${CMAKE_COMMAND} -DINPUT=${CMAKE_SOURCE_DIR}/daemon/web/index.html
          -DOUTPUT=${MEGACPP_WEB_PAGE_HEADER} -DNAME=web_page_html -DNAMESPACE=megacpp::daemon
          -DSOURCE_DIR=${CMAKE_SOURCE_DIR} -P ${CMAKE_SOURCE_DIR}/cmake/embed_file.cmake
  DEPENDS ${CMAKE_SOURCE_DIR}/daemon/web/index.html ${CMAKE_SOURCE_DIR}/cmake/embed_file.cmake
  COMMENT "Embedding daemon/web/index.html")
add_library(megacpp_daemon STATIC ${MEGACPP_DAEMON_SOURCES} ${MEGACPP_WEB_PAGE_HEADER})
target_include_directories(megacpp_daemon PRIVATE ${CMAKE_BINARY_DIR}/generated)
target_compile_options(megacpp_daemon PRIVATE ${MEGACPP_WARNINGS})
target_link_libraries(megacpp_daemon PUBLIC megacpp_service gRPC::grpc++ gRPC::grpc++_reflection
                      PkgConfig::HTTPLIB PkgConfig::PROMETHEUS_CPP)
target_link_libraries(megacpp_all INTERFACE megacpp_daemon)

file(GLOB MEGACPP_CLI_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/cli/*.cpp
     ${CMAKE_SOURCE_DIR}/cli/commands/*.cpp)
foreach(binary megacppd:daemon megacpp-executor:service megacpp:cli)
  string(REPLACE ":" ";" parts ${binary})
  list(GET parts 0 name)
  list(GET parts 1 layer)
  if(name STREQUAL "megacppd")
    set(sources daemon/megacppd_main.cpp)
    set(library megacpp_daemon)
  elseif(name STREQUAL "megacpp-executor")
    set(sources service/executor/executor_main.cpp)
    set(library megacpp_service)
  else()
    set(sources ${MEGACPP_CLI_SOURCES})
    set(library megacpp_service)
  endif()
  add_executable(${name} ${sources})
  target_compile_options(${name} PRIVATE ${MEGACPP_WARNINGS})
  target_link_libraries(${name} PRIVATE ${library} CLI11::CLI11)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
endforeach()
