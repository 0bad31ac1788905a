// How much slower sanitized builds run: bounds that are about time get this factor. Kept apart
// from test_support.h so that programs without GoogleTest (the soak) can use it too.
#pragma once

namespace fabric::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kSlowdown = 4;
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr int kSlowdown = 4;
constexpr bool kSanitized = true;
#else
constexpr int kSlowdown = 1;
constexpr bool kSanitized = false;
#endif
#else
constexpr int kSlowdown = 1;
constexpr bool kSanitized = false;
#endif

}  // namespace fabric::testing
