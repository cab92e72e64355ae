// Writing JSON text directly, for outputs with one entry per tensor where building a
// nlohmann::json tree first would dominate the run time.
#ifndef CKPTFS_IO_JSON_TEXT_HPP_
#define CKPTFS_IO_JSON_TEXT_HPP_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ckptfs {

// `s` as a JSON string literal (quotes included). Valid UTF-8 passes through unchanged;
// each byte of an invalid sequence becomes \ufffd.
void AppendJsonString(std::string* out, std::string_view s);

// `value` in decimal, without allocating (to_string would, once per number of a million-entry header).
void AppendDecimal(std::string* out, uint64_t value);

// `[a,b,c]`
void AppendJsonArray(std::string* out, const std::vector<uint64_t>& values);

}  // namespace ckptfs

#endif  // CKPTFS_IO_JSON_TEXT_HPP_
