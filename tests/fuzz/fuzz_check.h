// What every fuzz target uses: a check that aborts (so libFuzzer reports the input) with a
// message naming the property that broke.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond, what)                                                \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "fuzz property violated: %s (%s)\n", what, #cond); \
      std::abort();                                                           \
    }                                                                         \
  } while (0)
