// The tools' JSON string quoting (src/common/json.h): whatever bytes a name holds, the output
// is valid UTF-8 and valid JSON. Checked against an independent, strict reader (nlohmann's,
// header-only, which refuses ill-formed UTF-8), byte by byte and through fabric-info's report.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "common/json.h"
#include "fabric/discovery.h"

namespace fabric::detail {
namespace {

// Whether `s` is well-formed UTF-8, decoded code point by code point (independently of
// json.h's byte table): no overlong form, no surrogate, nothing above U+10FFFF.
bool well_formed_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80           ? 1
                     : (c >> 5) == 0x6  ? 2
                     : (c >> 4) == 0xE  ? 3
                     : (c >> 3) == 0x1E ? 4
                                        : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    const uint32_t smallest[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < smallest[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

// What a strict JSON reader makes of json_string(s): it must parse, as one string.
std::string read_back(const std::string& s) {
  const std::string quoted = json_string(s);
  nlohmann::json parsed;
  try {
    parsed = nlohmann::json::parse(quoted);
  } catch (const nlohmann::json::exception& e) {
    ADD_FAILURE() << "not valid JSON (" << e.what() << "): " << quoted;
    return {};
  }
  EXPECT_TRUE(parsed.is_string()) << quoted;
  return parsed.is_string() ? parsed.get<std::string>() : std::string();
}

TEST(Json, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(json_string("a\"b\\c\nd\te\x01\x1f"), "\"a\\\"b\\\\c\\nd\\te\\u0001\\u001f\"");
  EXPECT_EQ(json_string(std::string("nul\0x", 5)), "\"nul\\u0000x\"");
  EXPECT_EQ(read_back("a\"b\\c\nd\te\x01\x7f"), "a\"b\\c\nd\te\x01\x7f");
}

TEST(Json, WellFormedUtf8IsCopiedAsItIs) {
  // 2, 3 and 4 bytes, the smallest and largest of each length, and U+FFFD itself.
  for (const std::string s :
       {"caf\xc3\xa9", "\xc2\x80\xdf\xbf", "\xe0\xa0\x80\xef\xbf\xbf", "\xed\x9f\xbf\xee\x80\x80",
        "\xf0\x90\x80\x80\xf4\x8f\xbf\xbf", "\xef\xbf\xbd", "\xf0\x9f\x98\x80 ok"}) {
    EXPECT_EQ(json_string(s), "\"" + s + "\"");
    EXPECT_EQ(read_back(s), s);
  }
}

TEST(Json, EachByteOutsideWellFormedUtf8IsWrittenAsBackslashX) {
  struct Case {
    std::string in, json;
  };
  const Case cases[] = {
      {"tc\xffp", R"("tc\\xffp")"},                                  // never in UTF-8
      {"\x80", R"("\\x80")"},                                        // a lone continuation byte
      {"\xc0\x80", R"("\\xc0\\x80")"},                               // overlong NUL
      {"\xc1\xbf", R"("\\xc1\\xbf")"},                               // overlong
      {"\xe0\x80\x80", R"("\\xe0\\x80\\x80")"},                      // overlong, 3 bytes
      {"\xf0\x80\x80\x80", R"("\\xf0\\x80\\x80\\x80")"},             // overlong, 4 bytes
      {"\xed\xa0\x80", R"("\\xed\\xa0\\x80")"},                      // a surrogate (U+D800)
      {"\xf4\x90\x80\x80", R"("\\xf4\\x90\\x80\\x80")"},             // above U+10FFFF
      {"\xf5\x80\x80\x80", R"("\\xf5\\x80\\x80\\x80")"},             // F5 never starts one
      {"e\xe2\x82", R"("e\\xe2\\x82")"},                             // truncated at the end
      {"\xe2\x82x\xe2\x82\xac", "\"\\\\xe2\\\\x82x\xe2\x82\xac\""},  // truncated, then a '€'
      {"\xc3\xa9\xa9", "\"\xc3\xa9\\\\xa9\""},                       // 'é' then a stray byte
      {"/fabric-shm.\xc9\xff", R"("/fabric-shm.\\xc9\\xff")"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(json_string(c.in), c.json) << c.json;
    std::string expected = c.json.substr(1, c.json.size() - 2);  // read back: "\\" is '\'
    for (size_t at = expected.find("\\\\"); at != std::string::npos;
         at = expected.find("\\\\", at + 1)) {
      expected.erase(at, 1);
    }
    EXPECT_EQ(read_back(c.in), expected) << c.json;
  }
}

TEST(Json, EveryStringOfOneOrTwoBytesAndRandomBytesGiveValidJson) {
  // Every 1- and 2-byte string, and random strings weighted towards bytes >= 0x80: the output
  // parses, and a string that was well-formed UTF-8 reads back unchanged.
  const auto check = [](const std::string& s) {
    const std::string back = read_back(s);
    if (well_formed_utf8(s)) {
      EXPECT_EQ(back, s);
    }
    return !::testing::Test::HasFailure();
  };
  for (int a = 0; a < 256; ++a) {
    ASSERT_TRUE(check(std::string(1, static_cast<char>(a))));
    for (int b = 0; b < 256; ++b) {
      ASSERT_TRUE(check(std::string{static_cast<char>(a), static_cast<char>(b)})) << a << " " << b;
    }
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> length(0, 12), low(0, 127), high(128, 255), pick(0, 3);
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    for (int k = length(rng); k > 0; --k) {
      s += static_cast<char>(pick(rng) == 0 ? low(rng) : high(rng));
    }
    ASSERT_TRUE(check(s));
  }
}

TEST(Json, UtfSequenceLengthFollowsTheTableOfWellFormedSequences) {
  EXPECT_EQ(utf8_sequence_length("a"), 1u);
  EXPECT_EQ(utf8_sequence_length("\xc3\xa9z"), 2u);
  EXPECT_EQ(utf8_sequence_length("\xe2\x82\xac"), 3u);
  EXPECT_EQ(utf8_sequence_length("\xf0\x9f\x98\x80"), 4u);
  EXPECT_EQ(utf8_sequence_length("\xc3"), 0u);              // truncated
  EXPECT_EQ(utf8_sequence_length("\xe2\x28\xa1"), 0u);      // a bad continuation
  EXPECT_EQ(utf8_sequence_length("\xed\x9f\xbf"), 3u);      // U+D7FF
  EXPECT_EQ(utf8_sequence_length("\xed\xa0\x80"), 0u);      // U+D800
  EXPECT_EQ(utf8_sequence_length("\xf4\x8f\xbf\xbf"), 4u);  // U+10FFFF
  EXPECT_EQ(utf8_sequence_length("\xf4\x90\x80\x80"), 0u);  // U+110000
}

TEST(Json, FabricInfoJsonStaysValidUtf8WithForeignBytesInNames) {
  // What `fabric-info --json` prints for a machine whose NIC and provider names hold bytes
  // that are not UTF-8 (e.g. FABRIC_NICS set to them): one document that a strict reader parses.
  MachineInfo m;
  m.libfabric_version = "1.17";
  m.auto_provider = "tc\xffp";
  m.providers = {{"tc\xffp", {{"l\xfeo", "fab\xc3", "tcp;ofi_rxm", true}}}};
  m.nics = {{"l\xfeo", "0000:3b:00.0", 0, {0}}};
  const std::string json = to_json(m);
  nlohmann::json parsed;
  ASSERT_NO_THROW(parsed = nlohmann::json::parse(json)) << json;
  EXPECT_EQ(parsed["auto_provider"], "tc\\xffp");
  EXPECT_EQ(parsed["nics"][0]["name"], "l\\xfeo") << json;
}

}  // namespace
}  // namespace fabric::detail
