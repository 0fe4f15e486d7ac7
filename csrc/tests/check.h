// What the C++ test programs share: a failed expectation is printed and counted, and the program's exit
// status says whether any failed.
#pragma once

#include <cstdio>
#include <string>

namespace zero_kernels::testing {

inline int failures = 0;

inline void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAIL: %s\n", what.c_str());
  }
}

// One line for the whole program (``suite``: what it tests); the exit status: 0 when nothing failed, else 1.
inline int finish(const char* suite) {
  std::printf("%s: %s (%d failure(s))\n", suite, failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}

}  // namespace zero_kernels::testing
