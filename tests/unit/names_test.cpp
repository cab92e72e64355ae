// Tensor key <-> file name mapping: escaping round trips, and the shortening of names
// past NAME_MAX (255 bytes) without splitting a UTF-8 character or a %XX escape.
#define BOOST_TEST_MODULE names_test
#include <boost/test/unit_test.hpp>

#include <cstdio>
#include <string>
#include <string_view>

// Header-only XXH3, to compute the hash tag the library should append.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "ckptfs/names.hpp"

using ckptfs::kMaxFileName;
using ckptfs::TensorFileName;
using ckptfs::UnescapeKey;

namespace {

constexpr std::string_view kSuffix = ".safetensors";
constexpr size_t kTagSize = 17;  // "~" + 16 hex digits

std::string HashTag(std::string_view key) {
  char tag[kTagSize + 1];
  std::snprintf(tag, sizeof tag, "~%016llx", static_cast<unsigned long long>(XXH3_64bits(key.data(), key.size())));
  return tag;
}

bool StartsWith(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }
bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// True when `s` is well-formed UTF-8 (no truncated or stray continuation bytes).
bool ValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

// Escapes like the library documents: '%' -> "%25", '/' -> "%2F", NUL -> "%00".
std::string Escape(std::string_view key) {
  std::string out;
  for (char c : key) {
    if (c == '%') out += "%25";
    else if (c == '/') out += "%2F";
    else if (c == '\0') out += "%00";
    else out += c;
  }
  return out;
}

// A shortened name is "<cut of the escaped key>~<16 hex of XXH3(key)>.safetensors", at
// most 255 bytes, cut only where neither a UTF-8 character nor an escape is split.
void CheckShortened(std::string_view key, const std::string& name) {
  BOOST_TEST(name.size() <= kMaxFileName);
  BOOST_TEST(EndsWith(name, HashTag(key) + std::string(kSuffix)), name);
  const std::string_view cut = std::string_view(name).substr(0, name.size() - kTagSize - kSuffix.size());
  BOOST_TEST(StartsWith(Escape(key), cut));
  BOOST_TEST(ValidUtf8(name), name);
  auto unescaped = UnescapeKey(cut);
  BOOST_TEST(unescaped.has_value(), "cut splits an escape: " << cut);
  if (unescaped) BOOST_TEST(StartsWith(key, *unescaped));
  // Only as many bytes as one character or escape (at most 3 of a 4-byte one) are given up.
  BOOST_TEST(cut.size() + 3 >= kMaxFileName - kTagSize - kSuffix.size());
}

}  // namespace

BOOST_AUTO_TEST_CASE(plain_keys_map_to_key_plus_suffix) {
  BOOST_TEST(TensorFileName("model.0.weight") == "model.0.weight.safetensors");
  BOOST_TEST(TensorFileName("") == ".safetensors");
  BOOST_TEST(TensorFileName("a~b") == "a~b.safetensors");
}

BOOST_AUTO_TEST_CASE(escaping_round_trips) {
  const std::string keys[] = {
      "model/layers/0/attn.q_proj.weight",  // slashes (DCP / JAX style keys)
      "100%_sparse",                          // percent
      "%2F literally",                        // text that looks like an escape
      "a//b%%c/",
      "\xe6\x9d\x83\xe9\x87\x8d/\xce\xb1\xce\xb2/\xf0\x9f\x98\x80",  // CJK, Greek, emoji
      "tab\there",
      std::string("nul\0inside", 10),  // file names end at NUL, so it must be escaped
  };
  for (const std::string& key : keys) {
    const std::string name = TensorFileName(key);
    BOOST_TEST_CONTEXT("key " << key) {
      BOOST_TEST(EndsWith(name, kSuffix));
      BOOST_TEST(name.find('/') == std::string::npos);
      BOOST_TEST(name.find('\0') == std::string::npos);
      BOOST_TEST(std::string(name.substr(0, name.size() - kSuffix.size())) == Escape(key));
      auto back = UnescapeKey(std::string_view(name).substr(0, name.size() - kSuffix.size()));
      BOOST_REQUIRE(back.has_value());
      BOOST_TEST(*back == key);
    }
  }
  BOOST_TEST(TensorFileName("a/b%c") == "a%2Fb%25c.safetensors");
  BOOST_TEST(TensorFileName(std::string("x\0", 2)) == "x%00.safetensors");
}

BOOST_AUTO_TEST_CASE(malformed_escapes_do_not_unescape) {
  BOOST_TEST(!UnescapeKey("a%").has_value());
  BOOST_TEST(!UnescapeKey("a%2").has_value());
  BOOST_TEST(!UnescapeKey("a%2f").has_value());  // only the upper-case form is produced
  BOOST_TEST(!UnescapeKey("%41").has_value());
  BOOST_TEST(UnescapeKey("plain").value() == "plain");
  BOOST_TEST(UnescapeKey("%25%2F").value() == "%/");
}

BOOST_AUTO_TEST_CASE(longest_unshortened_name_is_255_bytes) {
  const std::string key(kMaxFileName - kSuffix.size() - 1, 'k');
  bool shortened = true;
  BOOST_TEST(TensorFileName(key + "~", &shortened) == key + "~.safetensors");
  BOOST_TEST(!shortened);  // 255 bytes and a '~', but not shortened
  const std::string longer = key + "kk";
  const std::string name = TensorFileName(longer, &shortened);
  BOOST_TEST(shortened);
  BOOST_TEST(name.size() == kMaxFileName);
  BOOST_TEST(EndsWith(name, HashTag(longer) + ".safetensors"));
}

BOOST_AUTO_TEST_CASE(ascii_key_of_400_bytes) {
  std::string key;
  while (key.size() < 400) key += "layer." + std::to_string(key.size()) + ".";
  key.resize(400);
  const std::string name = TensorFileName(key);
  BOOST_TEST(name.size() == kMaxFileName);
  BOOST_TEST(name == key.substr(0, 226) + HashTag(key) + ".safetensors");
  CheckShortened(key, name);
  // Keys that differ only past the cut still get different names.
  std::string other = key;
  other.back() = 'X';
  BOOST_TEST(TensorFileName(other) != name);
  BOOST_TEST(TensorFileName(other).size() == kMaxFileName);
}

BOOST_AUTO_TEST_CASE(multibyte_characters_are_not_split) {
  // Shift the character boundaries by 0..3 bytes so the cut at byte 226 lands inside a
  // 2-, 3- and 4-byte character in turn.
  const std::string chars[] = {"\xc3\xa9", "\xe6\x9d\x83", "\xf0\x9f\x98\x80"};
  for (const std::string& ch : chars) {
    for (size_t lead = 0; lead < 4; ++lead) {
      std::string key(lead, 'a');
      while (key.size() < 400) key += ch;
      bool shortened = false;
      const std::string name = TensorFileName(key, &shortened);
      BOOST_TEST_CONTEXT("char of " << ch.size() << " bytes, lead " << lead) {
        BOOST_TEST(shortened);
        CheckShortened(key, name);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(escapes_are_not_split) {
  for (size_t lead = 0; lead < 3; ++lead) {
    std::string key(lead, 'a');
    while (key.size() < 200) key += std::string("/%\0", 3);
    const std::string name = TensorFileName(key);
    BOOST_TEST_CONTEXT("lead " << lead) { CheckShortened(key, name); }
  }
}
