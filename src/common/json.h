// JSON string quoting for the tools' --json output (fabric-info, fabric-bench).
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace fabric::detail {

// The length of the well-formed UTF-8 sequence that `s` starts with (1 to 4), or 0 when it
// does not start with one: Unicode's table of well-formed byte sequences (RFC 3629), so no
// overlong form, no surrogate (U+D800 to U+DFFF), nothing above U+10FFFF, no truncated
// sequence. `s` is not empty.
inline size_t utf8_sequence_length(std::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char c = byte(0);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // not overlong
    if (c == 0xED) hi = 0x9F;  // not a surrogate
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // not overlong
    if (c == 0xF4) hi = 0x8F;  // at most U+10FFFF
  } else {
    return 0;  // a continuation byte, C0, C1 (overlong), F5 to FF
  }
  if (s.size() < n || byte(1) < lo || byte(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return n;
}

// `s` as a JSON string literal, quotes included; always valid UTF-8 and valid JSON (RFC 8259),
// whatever bytes `s` holds. Names from the system (a NIC, an environment variable, a name
// quoted in an error message) may hold bytes that are not UTF-8: each byte that does not
// belong to a well-formed UTF-8 sequence is written as a backslash followed by xNN (two
// lowercase hex digits), i.e. the JSON text `\\xff` for the byte 0xFF, which a JSON reader
// reads as the four characters `\xff`. That is how fabric_lib writes such bytes in every str
// (Python's "backslashreplace"), so fabric_lib.info() and `fabric-info --json` read the same,
// and the byte's value stays visible (U+FFFD would lose it; \u00ff would read as a real 'ÿ').
// Well-formed UTF-8 is copied as it is; '"', '\\' and control characters are escaped.
inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  out.reserve(s.size() + 2);
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x80) {
      const size_t n = utf8_sequence_length(s.substr(i));
      if (n == 0) {
        out += fmt::format("\\\\x{:02x}", static_cast<unsigned>(u));
        ++i;
      } else {
        out.append(s.substr(i, n));
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (u < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(u));
        } else {
          out += c;
        }
    }
    ++i;
  }
  return out + "\"";
}

}  // namespace fabric::detail
