// Reader for the folders torch's Hugging Face storage writer fills when each rank saves its
// own shards (HuggingFaceStorageWriter(save_distributed=True), torch.distributed.checkpoint
// .hf_storage): shard-<rank>-model-<i>-of-<n>.safetensors files, and no .metadata. Each file's
// __metadata__ DCP_SHARDING_INFO gives, for every tensor in it, its saved_offsets in the full
// tensor; the full shape is where the chunks end, as torch's own reader and consolidator infer
// it. Each chunk is a tensor of a shard file, read in place, and becomes a box of the full
// tensor. Layout facts: doc/FORMATS.md, "DCP layout".
#include <algorithm>
#include <map>
#include <set>
#include <unordered_map>

#include "codec/safetensors_header.hpp"
#include "format/chunk_boxes.hpp"
#include "format/readers.hpp"
#include "format/sibling_files.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

// "shard-00001-model-00001-of-00002.safetensors"
bool IsShardFileName(std::string_view name) {
  auto digits = [&](std::string_view* s) {
    size_t n = 0;
    while (n < s->size() && (*s)[n] >= '0' && (*s)[n] <= '9') ++n;
    s->remove_prefix(n);
    return n > 0;
  };
  auto literal = [&](std::string_view* s, std::string_view text) {
    if (s->substr(0, text.size()) != text) return false;
    s->remove_prefix(text.size());
    return true;
  };
  std::string_view s = name;
  return literal(&s, "shard-") && digits(&s) && literal(&s, "-model-") && digits(&s) && literal(&s, "-of-") &&
         digits(&s) && s == ".safetensors";
}

struct ShardChunk {
  uint32_t file = 0;
  std::vector<uint64_t> offsets;
  SafetensorsTensor tensor;
};

Status ListShardFiles(Env& env, const std::string& dir, std::vector<std::string>* shards,
                      std::vector<std::string>* others) {
  std::vector<std::string> names;
  CKPTFS_RETURN_IF_ERROR(ListFolderFiles(env, dir, &names));
  for (std::string& name : names) (IsShardFileName(name) ? shards : others)->push_back(std::move(name));
  std::sort(shards->begin(), shards->end());
  std::sort(others->begin(), others->end());
  return Status::OK();
}

// The chunks of one shard file, with their offsets from DCP_SHARDING_INFO.
Status ReadShardFile(Catalog* catalog, const std::string& path, const ReadLimits& limits,
                     std::vector<ShardChunk>* chunks) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  const FileWindow whole = catalog->files->whole(file);
  if (!LooksLikeSafetensors(*catalog->files, whole))
    return Status::NotSupported(path, "does not start with a safetensors header (the Hugging Face storage writer "
                                      "writes pickled non-tensor values before it when the state dict has any; "
                                      "only tensor-only saves can be served)");
  SafetensorsHeader header;
  CKPTFS_RETURN_IF_ERROR(ParseSafetensorsHeader(*catalog->files, whole, limits, &header));
  auto info = header.metadata.find("DCP_SHARDING_INFO");
  if (info == header.metadata.end())
    return Status::NotSupported(path, "a shard file without DCP_SHARDING_INFO in its __metadata__: where its tensors "
                                      "go in the full tensors is unknown");
  const json sharding = json::parse(info->get<std::string>(), nullptr, /*allow_exceptions=*/false);
  if (sharding.is_discarded() || !sharding.is_object())
    return Status::Corruption(path, "safetensors: __metadata__ DCP_SHARDING_INFO is not a JSON object");
  for (SafetensorsTensor& t : header.tensors) {
    ShardChunk chunk;
    chunk.file = file;
    auto entry = sharding.find(t.key);
    const json* saved = entry != sharding.end() && entry->is_object() && entry->contains("saved_offsets")
                            ? &(*entry)["saved_offsets"]
                            : nullptr;
    if (!saved) return Status::Corruption(path, "'" + t.key + "': DCP_SHARDING_INFO gives no saved_offsets for it");
    if (!saved->is_array() || saved->size() != t.shape.size())
      return Status::Corruption(path, "'" + t.key + "': saved_offsets " + saved->dump() +
                                          " is not a list of one offset per dimension");
    for (const json& o : *saved) {
      if (!o.is_number_unsigned()) return Status::Corruption(path, "'" + t.key + "': saved_offsets " + saved->dump() +
                                                                       " holds something other than offsets");
      chunk.offsets.push_back(o.get<uint64_t>());
    }
    chunk.tensor = std::move(t);
    chunks->push_back(std::move(chunk));
  }
  return Status::OK();
}

}  // namespace

bool IsDcpHfShardFolder(Env& env, const std::string& dir) {
  std::vector<std::string> shards, others;
  return ListShardFiles(env, dir, &shards, &others).ok() && !shards.empty();
}

Status ReadDcpHfShards(const std::string& dir, const SourceOptions& options, Catalog* catalog) {
  catalog->format = "dcp-hf-shards";
  std::vector<std::string> shards, others;
  CKPTFS_RETURN_IF_ERROR(ListShardFiles(catalog->files->env(), dir, &shards, &others));
  // key -> its chunks, keys in the order they first appear.
  std::vector<std::string> order;
  std::unordered_map<std::string, std::vector<ShardChunk>> by_key;
  for (const std::string& name : shards) {
    std::vector<ShardChunk> chunks;
    CKPTFS_RETURN_IF_ERROR(ReadShardFile(catalog, JoinPath(dir, name), options.limits, &chunks));
    for (ShardChunk& c : chunks) {
      auto [it, added] = by_key.try_emplace(c.tensor.key);
      if (added) order.push_back(c.tensor.key);
      it->second.push_back(std::move(c));
    }
  }
  for (const std::string& key : order) {
    std::vector<ShardChunk>& chunks = by_key[key];
    const ShardChunk& first = chunks.front();
    TensorEntry entry;
    entry.key = key;
    entry.path = {key};
    entry.dtype = first.tensor.dtype;
    entry.shape.assign(first.tensor.shape.size(), 0);
    std::set<std::vector<uint64_t>> seen;
    for (const ShardChunk& c : chunks) {
      const std::string& path = catalog->files->path(c.file);
      if (c.tensor.dtype != entry.dtype)
        return Status::Corruption(path, "'" + key + "': a chunk is " + std::string(Info(c.tensor.dtype).torch_name) +
                                            " where another file's is " + std::string(Info(entry.dtype).torch_name));
      if (c.tensor.shape.size() != entry.shape.size())
        return Status::Corruption(path, "'" + key + "': chunks of different ranks in different files");
      for (size_t d = 0; d < entry.shape.size(); ++d) {
        uint64_t end;
        if (!CheckedAdd(c.offsets[d], c.tensor.shape[d], &end))
          return Status::Corruption(path, "'" + key + "': saved_offsets + shape overflows");
        entry.shape[d] = std::max(entry.shape[d], end);
      }
    }
    // A chunk saved by two ranks (a replicated tensor) is served once.
    std::vector<ShardChunk*> distinct;
    for (ShardChunk& c : chunks)
      if (seen.insert(c.offsets).second) distinct.push_back(&c);
    const bool whole = distinct.size() == 1 && distinct.front()->tensor.shape == entry.shape;
    for (ShardChunk* c : distinct) {
      std::vector<Box> stored;
      if (c->tensor.nbytes > 0)
        stored.push_back(Box::Range(c->file, c->tensor.data_offset, 0, c->tensor.nbytes / Info(c->tensor.dtype).itemsize));
      if (whole) {
        entry.boxes = std::move(stored);  // the whole tensor in one file: its bytes as they are
      } else if (!PlaceChunkBoxes(std::move(stored), c->offsets, c->tensor.shape, &entry.boxes)) {
        return Status::Corruption(catalog->files->path(c->file), "'" + key + "': chunk size overflows");
      }
    }
    catalog->tensors.push_back(std::move(entry));
  }
  CKPTFS_RETURN_IF_ERROR(AddSiblingFiles(dir, others, {}, catalog));
  catalog->layout_file = dir;
  catalog->metadata["dcp"] = json{{"writer", "HuggingFaceStorageWriter (save_distributed)"},
                                  {"shard_files", shards.size()},
                                  {"tensors", order.size()}};
  return Status::OK();
}

extern const ReaderEntry kDcpHfShardsReader = {
    "dcp-hf-shards", "DCP Hugging Face storage shards folder (save_distributed=True)", {"dcp-hf-shards"},
    DetectFolderOf<IsDcpHfShardFolder>, ReadFolderOf<ReadDcpHfShards>};

}  // namespace ckptfs
