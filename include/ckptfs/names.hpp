// The reversible mapping between tensor keys and file names in the virtual tree.
#ifndef CKPTFS_NAMES_HPP_
#define CKPTFS_NAMES_HPP_

#include <optional>
#include <string>
#include <string_view>

namespace ckptfs {

// Longest file name Linux file systems accept (NAME_MAX).
constexpr size_t kMaxFileName = 255;
constexpr std::string_view kTensorFileSuffix = ".safetensors";

// "%" -> "%25", "/" -> "%2F" and NUL -> "%00", so every key maps to one legal name and back. A name
// that would exceed kMaxFileName is cut (at a UTF-8 character boundary) and gets
// "~" + 16 hex digits of XXH3-64(key) before the suffix; such names are not reversible
// by UnescapeKey and are listed in manifest.json; `*shortened` (if given) tells which.
std::string TensorFileName(std::string_view key, bool* shortened = nullptr);
// The same name appended to *out (no temporary string per key).
void AppendTensorFileName(std::string* out, std::string_view key, bool* shortened = nullptr);

// Inverse of the escaping (without the suffix); nullopt for a malformed escape.
std::optional<std::string> UnescapeKey(std::string_view escaped);

}  // namespace ckptfs

#endif  // CKPTFS_NAMES_HPP_
