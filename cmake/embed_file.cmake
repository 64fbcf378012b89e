# Writes OUTPUT, a header that holds the bytes of INPUT as NAME (a string_view returned by the
# inline function NAME()) in namespace NAMESPACE. Run as `cmake -DINPUT=... -DOUTPUT=... -DNAME=...
# -DNAMESPACE=... -P embed_file.cmake`. Bytes rather than a string literal: ISO C++ compilers need
# not take literals over 64 KiB, and -Wpedantic (fatal here) says so.
file(READ "${INPUT}" content HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${content}")
file(RELATIVE_PATH source "${SOURCE_DIR}" "${INPUT}")
file(WRITE "${OUTPUT}.tmp"
     "#pragma once\n"
     "// Generated from ${source} by cmake/embed_file.cmake; edit that file instead.\n"
     "#include <string_view>\n\n"
     "namespace ${NAMESPACE} {\n\n"
     "inline constexpr unsigned char k_${NAME}_bytes[] = {${bytes}};\n\n"
     "inline std::string_view ${NAME}() {\n"
     "  return {reinterpret_cast<const char*>(k_${NAME}_bytes), sizeof(k_${NAME}_bytes)};\n"
     "}\n\n"
     "}  // namespace ${NAMESPACE}\n")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
