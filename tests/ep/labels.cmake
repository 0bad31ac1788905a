# Read by ctest after the discovered tests: gtest_discover_tests hands each property one value,
# so fabric_ep_tests' tests get their second label (ep, besides unit) here.
if(fabric_ep_tests_TESTS)
  set_tests_properties(${fabric_ep_tests_TESTS} PROPERTIES LABELS "unit;ep")
endif()
