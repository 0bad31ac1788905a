# Feature labels beside the kind labels (unit, conformance, ...): `ctest -L staged` runs every test
# of the staged GPU path whatever its kind (docs/testing.md, "Tests by feature").
#
# gtest_discover_tests lists a binary's tests only when ctest runs, in a file that also sets
# <target>_TESTS; fabric_feature_labels() adds a script after it that gives each of those tests its
# kind label and the label of every feature its name matches.

# label=regex, matched against the full test name ("AllBackends/GpuReads.SingleReads.../shm  #
# GetParam() = shm"). A parameterised test's backend suffix names the transport.
set(FABRIC_FEATURE_RULES
  "staged=Staged|GpuReads"
  "cuda_ipc=CudaIpc|GpuReads|IpcCopies|IpcImports|IpcRoute|IpcWire"
  "reads=Reads[.]|ReadsOf|Read[A-Z]"
  "failover=Failover|NicHealth"
  "fence=Fence"
  "isolation=Isolation|Acceptance"
  "shm=/shm|Shm"
  "tcp=/tcp"
  "verbs=/verbs|Verbs|Rxe"
  "weights=Weights"
  "kv=^Kv|/Kv|Kv[A-Z]"
  "ep=^Ep|/Ep|Ep[A-Z]"
  CACHE INTERNAL "")

# fabric_feature_labels(<target> <kind> [<label>...]): the labels after the kind go to every test
# of the target, whatever its name (a folder's feature: every test in tests/shm gets shm).
function(fabric_feature_labels target kind)
  set(script "${CMAKE_CURRENT_BINARY_DIR}/${target}_feature_labels.cmake")
  set(text "set(_tests \"\${${target}_TESTS}\")\n")
  string(APPEND text "foreach(_t IN LISTS _tests)\n  set(_labels ${kind} ${ARGN})\n")
  foreach(rule IN LISTS FABRIC_FEATURE_RULES)
    string(REGEX MATCH "^[a-z_]+" label "${rule}")
    string(REGEX REPLACE "^[a-z_]+=" "" regex "${rule}")
    string(APPEND text "  if(_t MATCHES \"${regex}\")\n    list(APPEND _labels ${label})\n  endif()\n")
  endforeach()
  string(APPEND text "  set_tests_properties(\"\${_t}\" PROPERTIES LABELS \"\${_labels}\")\nendforeach()\n")
  file(WRITE "${script}" "${text}")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${script}")
endfunction()

# fabric_add_unit_tests(<target> <source>... [LABELS <label>...]): one folder's unit tests (no fabric
# needed: kind unit), as one program linked against the library's internals (src/ and
# tests/support on the include path); the LABELS go to every test in it, beside those its name
# earns.
function(fabric_add_unit_tests target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "LABELS")
  add_executable(${target} ${arg_UNPARSED_ARGUMENTS})
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tests/support)
  target_link_libraries(${target} PRIVATE fabric_internal GTest::gtest_main)
  gtest_discover_tests(${target} PROPERTIES LABELS unit DISCOVERY_TIMEOUT 60)
  fabric_feature_labels(${target} unit ${arg_LABELS})
endfunction()
