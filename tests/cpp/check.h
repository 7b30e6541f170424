// The plain C++ tests' check: CHECK(cond) or CHECK(cond, printf-format, args...) prints the
// failure and counts it in `failures`; main() returns failures == 0 ? 0 : 1.
#pragma once

#include <cstdio>

static int failures = 0;

#define CHECK(cond, ...)                                           \
  do {                                                             \
    if (!(cond)) {                                                 \
      std::printf("FAILED %s:%d: %s", __FILE__, __LINE__, #cond);  \
      __VA_OPT__(std::printf(": "); std::printf(__VA_ARGS__);)     \
      std::printf("\n");                                           \
      ++failures;                                                  \
    }                                                              \
  } while (0)
