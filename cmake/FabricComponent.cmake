# fabric_component(<target> EXPORT_NAME <name> OUTPUT_NAME <file> SOURCES <src>...
#                  [CUDA_SOURCES <src>...] [STUB_SOURCES <src>...])
# A component library of fabric-lib (fabric::<name>) on the public engine API: a static library
# <target> (lib<file>.a), its alias fabric::<name>, the tree's src/ for its private headers,
# fabric::fabric public and fmt private; CUDA_SOURCES (and the CUDA runtime) in CUDA builds,
# STUB_SOURCES otherwise. Paths are relative to the calling CMakeLists.txt.
function(fabric_component target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "EXPORT_NAME;OUTPUT_NAME"
    "SOURCES;CUDA_SOURCES;STUB_SOURCES")
  add_library(${target} STATIC ${arg_SOURCES})
  set_target_properties(${target} PROPERTIES OUTPUT_NAME ${arg_OUTPUT_NAME}
    EXPORT_NAME ${arg_EXPORT_NAME})
  add_library(fabric::${arg_EXPORT_NAME} ALIAS ${target})
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${target} PUBLIC fabric_lib PRIVATE fmt::fmt)
  if(FABRIC_CUDA_ENABLED)
    if(arg_CUDA_SOURCES)
      target_sources(${target} PRIVATE ${arg_CUDA_SOURCES})
      target_link_libraries(${target} PRIVATE CUDA::cudart_static)
    endif()
  elseif(arg_STUB_SOURCES)
    target_sources(${target} PRIVATE ${arg_STUB_SOURCES})
  endif()
endfunction()
