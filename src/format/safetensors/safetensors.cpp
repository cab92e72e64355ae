// Reader for safetensors files: the header (codec/safetensors_header.hpp) becomes the
// catalog's tensors, one box each.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "codec/safetensors_header.hpp"
#include "format/readers.hpp"

namespace ckptfs {

using json = nlohmann::json;

Status ReadSafetensorsFile(const std::string& path, Catalog* catalog, json* metadata, const ReadLimits& limits) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  SafetensorsHeader header;
  CKPTFS_RETURN_IF_ERROR(ParseSafetensorsHeader(*catalog->files, catalog->files->whole(file), limits, &header));
  const auto format = header.metadata.find("format");
  const bool says_pt = format != header.metadata.end() && *format == "pt";
  *metadata = std::move(header.metadata);
  // Room for them at once: growing by doubling would hold the old and the new array together
  // at the peak. A folder's shards add to the catalog one file at a time, so the room still
  // grows geometrically there.
  std::vector<TensorEntry>& tensors = catalog->tensors;
  if (const size_t need = tensors.size() + header.tensors.size(); need > tensors.capacity())
    tensors.reserve(std::max(need, 2 * tensors.capacity()));
  // Served as it is where a view keeps its tensors, if its header says "pt" as every header
  // ckptfs writes does (loaders check the format; a file without it gets a header that has it).
  if (says_pt)
    catalog->whole_safetensors_files.push_back(
        WholeSafetensorsFile{file, header.data_start, tensors.size(), header.tensors.size(), /*key_prefix=*/0});
  for (SafetensorsTensor& p : header.tensors) {
    TensorEntry t;
    t.path = {p.key};
    t.key = std::move(p.key);
    t.dtype = p.dtype;
    t.shape = std::move(p.shape);
    if (p.nbytes > 0) t.boxes.push_back(Box::Range(file, p.data_offset, 0, t.numel()));
    tensors.push_back(std::move(t));
  }
  return Status::OK();
}

namespace {

// By content (byte 8 opens the JSON header), or by name so that a damaged header gets a
// safetensors error message.
Status DetectSafetensors(SourceProbe& probe, bool* is_format) {
  std::string_view head;
  if (probe.is_file()) CKPTFS_RETURN_IF_ERROR(probe.Head(&head));
  *is_format = probe.is_file() && ((head.size() >= 9 && head[8] == '{') || probe.NameEndsWith(".safetensors"));
  return Status::OK();
}

}  // namespace

extern const ReaderEntry kSafetensorsReader = {
    "safetensors", "safetensors file", {"safetensors"}, DetectSafetensors,
    [](SourceProbe& p, const SourceOptions& o, Catalog* c) { return ReadSafetensorsFile(p.source(), c, &c->metadata, o.limits); }};

}  // namespace ckptfs
