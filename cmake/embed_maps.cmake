# Writes OUT, a C++ file holding the text of every map file given in MAPS (a |-list), in
# that order, as the shipped key maps (src/map/shipped_maps.hpp). Run at build time, so
# an edited map under maps/ is rebuilt into the binary.
set(body "// Generated from maps/*.json by cmake/embed_maps.cmake: edit those files.\n#include \"map/shipped_maps.hpp\"\n\nnamespace ckptfs {\n\nstd::span<const ShippedMap> ShippedMaps() {\n  static const ShippedMap kMaps[] = {\n")
string(REPLACE "|" ";" MAPS "${MAPS}")
foreach(path IN LISTS MAPS)
  get_filename_component(name "${path}" NAME_WE)
  file(READ "${path}" text)
  string(FIND "${text}" ")ckptfs_map" clash)
  if(NOT clash EQUAL -1)
    message(FATAL_ERROR "${path} holds the text ')ckptfs_map'")
  endif()
  string(APPEND body "      {\"${name}\", R\"ckptfs_map(${text})ckptfs_map\"},\n")
endforeach()
string(APPEND body "  };\n  return kMaps;\n}\n\n}  // namespace ckptfs\n")
file(WRITE "${OUT}.tmp" "${body}")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
