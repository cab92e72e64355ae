// Reader for torch.export.save packages (.pt2, the PT2 archive format). The package is a
// torch-style zip: <archive>/archive_format holds "pt2"; for each exported program
// models/<name>.json holds its graph (never read here), and two JSON configs map state-dict
// names to raw tensor records:
//   data/weights/<name>_weights_config.json     parameters and persistent buffers
//   data/constants/<name>_constants_config.json constants and non-persistent buffers
// Each config entry gives a record (path_name) holding a whole untyped storage and the
// tensor's dtype, sizes, strides and storage offset in it; entries naming one record share
// storage (tied weights). Pickled entries (tensor subclasses, script objects) are refused
// with their record named. Layout facts: doc/FORMATS.md, "torch.export packages".
#include <algorithm>
#include <string>
#include <unordered_set>

#include "format/readers.hpp"
#include "format/torch/torch_archive.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

constexpr std::string_view kWeightsDir = "data/weights/";
constexpr std::string_view kConstantsDir = "data/constants/";
constexpr std::string_view kModelsDir = "models/";

// torch._export.serde.schema.ScalarType.
std::optional<DType> DTypeFromScalarType(int64_t v) {
  switch (v) {
    case 1: return DType::kU8;
    case 2: return DType::kI8;
    case 3: return DType::kI16;
    case 4: return DType::kI32;
    case 5: return DType::kI64;
    case 6: return DType::kF16;
    case 7: return DType::kF32;
    case 8: return DType::kF64;
    case 9: return DType::kC32;
    case 10: return DType::kC64;
    case 11: return DType::kC128;
    case 12: return DType::kBool;
    case 13: return DType::kBF16;
    case 28: return DType::kU16;
    case 29: return DType::kF8_E4M3;
    case 30: return DType::kF8_E5M2;
    case 31: return DType::kF8_E4M3FNUZ;
    case 32: return DType::kF8_E5M2FNUZ;
    case 33: return DType::kF8_E8M0;
    case 34: return DType::kU32;
    case 35: return DType::kU64;
    default: return std::nullopt;
  }
}
constexpr int64_t kLayoutStrided = 7;

class ExportReader {
 public:
  ExportReader(const std::string& path, Catalog* catalog, const ReadLimits& limits)
      : path_(path), catalog_(catalog), limits_(limits) {}

  Status Read(json* metadata);

 private:
  Status Bad(const std::string& what) const { return Status::Corruption(path_, what); }
  Status ReadRecord(const std::string& name, uint64_t max_size, std::string* out) const;
  Status ReadConfig(const std::string& name, nlohmann::ordered_json* config) const;
  Status AddPayloads(const std::string& config_name, std::string_view dir, const std::string& key_prefix);
  Status AddPayload(const std::string& config_name, std::string_view dir, const std::string& key,
                    const nlohmann::ordered_json& meta);
  // A SymInt that must be a plain integer: {"as_int": n}.
  bool AsInt(const nlohmann::ordered_json& sym, int64_t* out) const;

  std::string path_;
  Catalog* catalog_;
  ReadLimits limits_;
  TorchArchive archive_;
  std::unordered_set<std::string> keys_;
};

Status ExportReader::ReadRecord(const std::string& name, uint64_t max_size, std::string* out) const {
  const ZipEntry* e = archive_.zip().Find(archive_.prefix() + name);
  if (!e) return Bad("torch.export package without the record " + archive_.prefix() + name);
  if (e->uncompressed_size > max_size)
    return Status::Refused(path_, "record " + archive_.prefix() + name + " is " + std::to_string(e->uncompressed_size) +
                                      " bytes, over the limit of " + std::to_string(max_size))
                                          .WithLimitOption("max_header");
  return archive_.zip().ReadStored(*e, max_size, out);
}

Status ExportReader::ReadConfig(const std::string& name, nlohmann::ordered_json* config) const {
  std::string text;
  CKPTFS_RETURN_IF_ERROR(ReadRecord(name, limits_.header_bytes, &text));
  // Ordered: tensors are served in the order torch wrote the state dict.
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("config") || !doc["config"].is_object())
    return Bad("record " + archive_.prefix() + name + " is not a payload config ({\"config\": {...}})");
  *config = std::move(doc["config"]);
  return Status::OK();
}

bool ExportReader::AsInt(const nlohmann::ordered_json& sym, int64_t* out) const {
  if (!sym.is_object() || sym.size() != 1 || !sym.contains("as_int") || !sym["as_int"].is_number_integer())
    return false;
  *out = sym["as_int"].get<int64_t>();
  return true;
}

Status ExportReader::AddPayload(const std::string& config_name, std::string_view dir, const std::string& key,
                                const nlohmann::ordered_json& meta) {
  const std::string entry = "entry '" + key + "' of " + archive_.prefix() + config_name;
  if (!meta.is_object() || !meta.contains("path_name") || !meta["path_name"].is_string())
    return Bad(entry + " has no path_name");
  const std::string record = std::string(dir) + meta["path_name"].get<std::string>();
  const std::string record_name = archive_.prefix() + record;
  const bool pickled = meta.contains("use_pickle") && meta["use_pickle"].is_boolean() && meta["use_pickle"].get<bool>();
  if (pickled || !meta.contains("tensor_meta") || !meta["tensor_meta"].is_object())
    return Status::NotSupported(path_, "record " + record_name + " (" + key +
                                           ") is a pickled object (a tensor subclass or script object), which "
                                           "ckptfs does not read");
  const nlohmann::ordered_json& tm = meta["tensor_meta"];
  if (!tm.contains("dtype") || !tm["dtype"].is_number_integer()) return Bad(entry + " has no dtype");
  std::optional<DType> dtype = DTypeFromScalarType(tm["dtype"].get<int64_t>());
  if (!dtype)
    return Status::NotSupported(path_, "record " + record_name + " (" + key + ") has the unsupported dtype " +
                                           std::to_string(tm["dtype"].get<int64_t>()));
  if (tm.contains("layout") && (!tm["layout"].is_number_integer() || tm["layout"].get<int64_t>() != kLayoutStrided))
    return Status::NotSupported(path_, "record " + record_name + " (" + key + ") is not a strided (dense) tensor");
  TensorEntry t;
  t.dtype = *dtype;
  std::vector<uint64_t> stride;
  int64_t storage_offset = 0;
  if (!tm.contains("sizes") || !tm["sizes"].is_array() || !tm.contains("strides") || !tm["strides"].is_array() ||
      tm["sizes"].size() != tm["strides"].size() || !tm.contains("storage_offset"))
    return Bad(entry + " has malformed sizes or strides");
  for (size_t d = 0; d < tm["sizes"].size(); ++d) {
    int64_t size, step;
    if (!AsInt(tm["sizes"][d], &size) || !AsInt(tm["strides"][d], &step))
      return Status::NotSupported(path_, "record " + record_name + " (" + key +
                                             ") has a symbolic or malformed size or stride");
    if (size < 0 || step < 0) return Status::NotSupported(path_, entry + " has a negative size or stride");
    t.shape.push_back(static_cast<uint64_t>(size));
    stride.push_back(static_cast<uint64_t>(step));
  }
  if (!AsInt(tm["storage_offset"], &storage_offset) || storage_offset < 0)
    return Status::NotSupported(path_, entry + " has a symbolic or negative storage offset");

  const ZipEntry* e = archive_.zip().Find(record_name);
  if (!e) return Bad(entry + " names the record " + record_name + ", which the package does not hold");
  if (e->method != ZipArchive::kMethodStored)
    return Status::NotSupported(path_, "record " + record_name + " is compressed (method " + std::to_string(e->method) +
                                           "); tensor data must be stored uncompressed");
  StorageBytes rec;
  rec.file = archive_.file();
  rec.nbytes = e->uncompressed_size;
  rec.key = record;
  CKPTFS_RETURN_IF_ERROR(archive_.zip().DataOffset(*e, &rec.data_offset));
  // torch reads the record as a flat tensor of its dtype, then views it (as_strided).
  if (rec.nbytes % Info(t.dtype).itemsize != 0)
    return Bad("record " + record_name + " holds " + std::to_string(rec.nbytes) + " bytes, not a whole number of " +
               std::string(Info(t.dtype).torch_name) + " elements");
  uint64_t numel = 1;
  for (uint64_t n : t.shape)
    if (!CheckedMul(numel, n, &numel)) return Bad(entry + ": tensor shape overflows");
  if (rec.nbytes == 0 && numel > 0)
    return Status::NotSupported(path_, "record " + record_name + " (" + key +
                                           ") holds no bytes: torch.export saved it without data (a fake tensor)");
  CKPTFS_RETURN_IF_ERROR(PlaceStridedTensor(rec, static_cast<uint64_t>(storage_offset), std::move(stride), path_, &t));
  t.storage_id = "pt2:" + std::to_string(rec.file) + ":" + record;
  if (catalog_->tensors.size() >= limits_.tensors)
    return Status::Refused(path_, "more than " + std::to_string(limits_.tensors) + " tensors");
  if (!keys_.insert(key).second) return Status::NotSupported(path_, "two tensors are named '" + key + "'");
  t.key = key;
  t.path = {key};
  catalog_->tensors.push_back(std::move(t));
  return Status::OK();
}

Status ExportReader::AddPayloads(const std::string& config_name, std::string_view dir, const std::string& key_prefix) {
  nlohmann::ordered_json config;
  CKPTFS_RETURN_IF_ERROR(ReadConfig(config_name, &config));
  for (const auto& [fqn, meta] : config.items())
    CKPTFS_RETURN_IF_ERROR(AddPayload(config_name, dir, key_prefix + fqn, meta));
  return Status::OK();
}

Status ExportReader::Read(json* metadata) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog_->files->Add(path_, &file));
  ArchiveRecords records;
  records.pickle.clear();  // no pickle: the configs are JSON
  CKPTFS_RETURN_IF_ERROR(archive_.Open(*catalog_->files, catalog_->files->whole(file), limits_, records));
  const std::string& prefix = archive_.prefix();

  std::string format, version;
  CKPTFS_RETURN_IF_ERROR(ReadRecord("archive_format", 64, &format));
  if (format != "pt2") return Status::NotSupported(path_, "archive_format record says '" + format + "', not 'pt2'");
  if (archive_.zip().Find(prefix + "archive_version")) CKPTFS_RETURN_IF_ERROR(ReadRecord("archive_version", 64, &version));

  // The exported programs: models/<name>.json.
  std::vector<std::string> models;
  json records_listed = json::array();
  for (const ZipEntry& e : archive_.zip().entries()) {
    if (e.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name(e.name.substr(prefix.size()));
    if (name.compare(0, kWeightsDir.size(), kWeightsDir) != 0 && name.compare(0, kConstantsDir.size(), kConstantsDir) != 0)
      records_listed.push_back(name);
    if (name.size() > kModelsDir.size() + 5 && name.compare(0, kModelsDir.size(), kModelsDir) == 0 &&
        name.compare(name.size() - 5, 5, ".json") == 0 && name.find('/', kModelsDir.size()) == std::string::npos)
      models.push_back(name.substr(kModelsDir.size(), name.size() - kModelsDir.size() - 5));
  }
  if (models.empty()) return Bad("torch.export package without an exported program (no " + prefix + "models/<name>.json)");
  std::sort(models.begin(), models.end());
  for (const std::string& model : models) {
    // Packages of several programs name each one's tensors under its name.
    const std::string key_prefix = models.size() > 1 ? model + "." : "";
    const std::string legacy = std::string(kWeightsDir) + model + ".pt";
    if (archive_.zip().Find(prefix + legacy))
      return Status::NotSupported(path_, "record " + prefix + legacy +
                                             " holds the weights in an older torch.export.save format (one pickled "
                                             "state dict); save the program again with a newer torch");
    CKPTFS_RETURN_IF_ERROR(AddPayloads(std::string(kWeightsDir) + model + "_weights_config.json", kWeightsDir, key_prefix));
    CKPTFS_RETURN_IF_ERROR(
        AddPayloads(std::string(kConstantsDir) + model + "_constants_config.json", kConstantsDir, key_prefix));
  }
  *metadata = json::object();
  json& ep = (*metadata)["torch_export"];
  ep["archive_format"] = format;
  if (!version.empty()) ep["archive_version"] = version;
  ep["programs"] = models;
  ep["other_records"] = std::move(records_listed);
  return Status::OK();
}

}  // namespace

Status ReadTorchExport(const std::string& path, Catalog* catalog, json* metadata, const ReadLimits& limits) {
  ExportReader reader(path, catalog, limits);
  return reader.Read(metadata);
}

namespace {

Status DetectTorchExport(SourceProbe& probe, bool* is_format) {
  return IsTorchZipOfKind(probe, "torch-export", is_format);
}

}  // namespace

extern const ReaderEntry kTorchExportReader = {
    "torch-export", "torch.export package (.pt2)", {"torch-export"}, DetectTorchExport,
    [](SourceProbe& p, const SourceOptions& o, Catalog* c) { return ReadTorchExport(p.source(), c, &c->metadata, o.limits); }};

}  // namespace ckptfs
