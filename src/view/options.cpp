// View options: parsing, and the catalog a view presents (root subtree, conversion marks).
#include <algorithm>
#include <cctype>
#include <set>

#include "ckptfs/view.hpp"
#include "view/convert.hpp"

namespace ckptfs {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

Status ParseSize(std::string_view text, uint64_t* bytes) {
  const std::string t = Lower(text);
  size_t digits = 0;
  while (digits < t.size() && std::isdigit(static_cast<unsigned char>(t[digits]))) ++digits;
  static const std::pair<const char*, uint64_t> kUnits[] = {
      {"", 1}, {"b", 1}, {"kb", 1000}, {"mb", 1000000}, {"gb", 1000000000}, {"tb", 1000000000000},
      {"kib", 1ull << 10}, {"mib", 1ull << 20}, {"gib", 1ull << 30}, {"tib", 1ull << 40}};
  if (digits == 0 || digits > 15) return Status::InvalidArgument(text, "not a size (e.g. 5GB, 2GiB, 500MB)");
  const uint64_t n = std::stoull(t.substr(0, digits));
  for (const auto& [unit, scale] : kUnits) {
    if (t.substr(digits) == unit) {
      if (n == 0) return Status::InvalidArgument(text, "a size must be positive");
      if (__builtin_mul_overflow(n, scale, bytes)) return Status::InvalidArgument(text, "size too large");
      return Status::OK();
    }
  }
  return Status::InvalidArgument(text, "unknown size unit (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

Status ParseViewOption(std::string_view key, std::string_view value, ViewOptions* options, bool* known) {
  *known = true;
  if (key == "dtype") {
    const std::string v = Lower(value);
    if (v == "bf16" || v == "bfloat16") options->dtype = DType::kBF16;
    else if (v == "fp16" || v == "f16" || v == "float16" || v == "half") options->dtype = DType::kF16;
    else if (v == "fp32" || v == "f32" || v == "float32" || v == "float") options->dtype = DType::kF32;
    else return Status::InvalidArgument("dtype=" + std::string(value), "the target dtype must be bf16, fp16 or fp32");
    return Status::OK();
  }
  if (key == "root") {
    if (value.empty()) return Status::InvalidArgument("root=", "needs a key prefix, e.g. root=model");
    options->root.assign(value);
    return Status::OK();
  }
  if (key == "shard_size") {
    Status s = ParseSize(value, &options->shard_size);
    return s.ok() ? s : Status::InvalidArgument("shard_size=" + std::string(value), s.message());
  }
  if (key == "checksums") {
    options->checksums = true;
    return Status::OK();
  }
  *known = false;
  return Status::OK();
}

Status ApplyViewOptions(std::shared_ptr<const Catalog> catalog, const ViewOptions& options,
                        std::shared_ptr<const Catalog>* out) {
  if (options.root.empty() && !options.dtype) {
    *out = std::move(catalog);
    return Status::OK();
  }
  auto view = std::make_shared<Catalog>();
  view->format = catalog->format;
  view->source = catalog->source;
  view->files = catalog->files;
  view->sibling_files = catalog->sibling_files;
  view->metadata = catalog->metadata;
  const std::string prefix = options.root.empty() ? "" : options.root + ".";
  for (const TensorEntry& t : catalog->tensors) {
    if (!prefix.empty() && t.key.compare(0, prefix.size(), prefix) != 0) continue;
    TensorEntry copy = t;
    copy.key = t.key.substr(prefix.size());
    if (options.dtype && ConvertsTo(t.dtype, *options.dtype)) copy.convert_to = options.dtype;
    view->tensors.push_back(std::move(copy));
  }
  if (!prefix.empty()) {
    if (view->tensors.empty()) {
      std::set<std::string> tops;
      for (const TensorEntry& t : catalog->tensors) tops.insert(t.key.substr(0, t.key.find('.')));
      std::string list;
      for (const auto& top : tops) list += (list.empty() ? "" : ", ") + top;
      return Status::InvalidArgument("root=" + options.root,
                                     "no tensor keys start with '" + prefix + "'; top-level prefixes: " + list);
    }
    // The metadata of the subtree, when the checkpoint nests it the same way.
    nlohmann::json narrowed = nlohmann::json::object();
    const nlohmann::json* node = &catalog->metadata;
    size_t start = 0;
    bool found = true;
    while (found && start <= options.root.size()) {
      const size_t dot = options.root.find('.', start);
      const std::string part = options.root.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      found = node->is_object() && node->contains(part);
      if (found) node = &(*node)[part];
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    view->metadata = found ? *node : narrowed;
  }
  *out = std::move(view);
  return Status::OK();
}

}  // namespace ckptfs
