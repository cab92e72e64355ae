// Reader for TorchScript archives (torch.jit.save of a scripted or traced module). The
// archive is a torch zip whose data.pkl holds the module tree: each module an object of a
// "__torch__..." class whose BUILD state is the dict of its attributes, tensors among them
// as in torch.save. Flattening that tree the way a torch.save pickle is flattened gives
// the names Module.state_dict() gives ("encoder.layer.1.bias"). constants.pkl holds the
// tensors the code refers to as CONSTANTS.c<i>, stored under constants/.
//
// The classes' code (code/*.py) is never read: nothing is compiled or run, the file names
// are only listed in the metadata. Layout facts: doc/FORMATS.md, "TorchScript archives".
#include <string>
#include <unordered_set>

#include "format/readers.hpp"
#include "format/torch/torch_archive.hpp"

namespace ckptfs {

using json = nlohmann::json;

Status ReadTorchScript(const std::string& path, Catalog* catalog, json* metadata, const ReadLimits& limits) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  const FileWindow window = catalog->files->whole(file);

  ArchiveRecords records;
  records.torchscript = true;
  TorchArchive data;
  CKPTFS_RETURN_IF_ERROR(data.Open(*catalog->files, window, limits, records));
  const std::string& prefix = data.prefix();
  const size_t first_tensor = catalog->tensors.size();
  json module;
  CKPTFS_RETURN_IF_ERROR(FlattenTorchObject(data.root(), data.value_count(), data, catalog, limits, &module));
  CKPTFS_RETURN_IF_ERROR(
      NoTensorsFromTensorData(catalog->tensors.size() - first_tensor, data.storage_records(), data.path(), "storage records"));

  // constants.pkl: a tuple, the i-th item being CONSTANTS.c<i> in the code.
  records.pickle = "constants.pkl";
  records.storage_dir = "constants/";
  TorchArchive constants;
  CKPTFS_RETURN_IF_ERROR(constants.Open(*catalog->files, window, limits, records));
  const PyValue* table = constants.root();
  if (table->kind() != PyValue::Kind::kTuple)
    return Status::Corruption(path, prefix + "constants.pkl does not hold a tuple");
  json other_constants = json::object();
  for (size_t i = 0; i < table->items().size(); ++i) {
    const std::string name = "c" + std::to_string(i);
    TensorEntry t;
    bool is_tensor = false;
    CKPTFS_RETURN_IF_ERROR(constants.AsTensor(table->items()[i], &t, &is_tensor));
    if (!is_tensor) {
      // Ints, strings and the like are inlined in the code; script objects are not data.
      const std::string cls = table->items()[i]->CallableName();
      other_constants[name] = cls.empty() ? "not a tensor" : cls;
      continue;
    }
    if (catalog->tensors.size() >= limits.tensors)
      return Status::Refused(path, "more than " + std::to_string(limits.tensors) + " tensors");
    t.path = {std::string("CONSTANTS"), name};
    t.key = "CONSTANTS." + name;
    catalog->tensors.push_back(std::move(t));
  }
  std::unordered_set<std::string_view> keys;
  for (size_t i = first_tensor; i < catalog->tensors.size(); ++i)
    if (!keys.insert(catalog->tensors[i].key).second)
      return Status::NotSupported(path, "two tensors flatten to the same key '" + catalog->tensors[i].key + "'");

  // What the archive holds besides the tensors, by record name: the code is listed, never read.
  json code = json::array(), others = json::array();
  for (const ZipEntry& e : data.zip().entries()) {
    if (e.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name(e.name.substr(prefix.size()));
    if (name.compare(0, 5, "code/") == 0) code.push_back(name);
    else if (name.compare(0, 5, "data/") != 0 && name.compare(0, 10, "constants/") != 0) others.push_back(name);
  }
  *metadata = json::object();
  (*metadata)["module"] = std::move(module);
  json& ts = (*metadata)["torchscript"];
  ts["code_files"] = std::move(code);
  ts["other_records"] = std::move(others);
  if (!other_constants.empty()) ts["non_tensor_constants"] = std::move(other_constants);
  return Status::OK();
}

namespace {

Status DetectTorchScript(SourceProbe& probe, bool* is_format) {
  return IsTorchZipOfKind(probe, "torchscript", is_format);
}

}  // namespace

extern const ReaderEntry kTorchScriptReader = {
    "torchscript", "TorchScript archive (torch.jit.save)", {"torchscript"}, DetectTorchScript,
    [](SourceProbe& p, const SourceOptions& o, Catalog* c) { return ReadTorchScript(p.source(), c, &c->metadata, o.limits); }};

}  // namespace ckptfs
