// libFuzzer target: the View's read mapping (src/view) over a catalog read from a fuzzed
// torch.save or safetensors file.
//
// Input: 64 control bytes, then the checkpoint file.
//   byte 0   bits 0-1 dtype (none, bf16, fp16, fp32), bit 2 checksums, bit 3 root = the first
//            key component of the first tensor
//   byte 1,2 shard_size = byte1 * 64 + byte2 when byte1 != 0
//   8..15    seed of the read pattern
// Invariants: the tree is consistent (sorted children, parents, Lookup(PathOf(n)) == n);
// a read never returns more than the file holds and is short only at the end of the file;
// any range read equals the same range cut from smaller reads; every per-tensor file and
// model.safetensors parse back as valid safetensors with the served dtype and shape.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/view.hpp"
#include "format/readers.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;
using ckptfs_fuzz::Rng;

namespace {

constexpr size_t kControl = 64;
constexpr uint64_t kMaxFullRead = 4u << 20;  // files above this are only range-checked

// A second in-memory file, for parsing served files back.
ckptfs_fuzz::MemFile& OutFile() {
  static ckptfs_fuzz::MemFile f;
  return f;
}

std::string ReadAll(const View& view, View::NodeId id) {
  const uint64_t size = view.node(id).size;
  std::string all(size + 16, '\0');
  size_t nread = 0;
  FUZZ_CHECK(view.Read(id, 0, all.size(), all.data(), &nread).ok());
  FUZZ_CHECK(nread == size);  // never more than the file, short only at its end
  all.resize(nread);
  return all;
}

void CheckReads(const View& view, View::NodeId id, Rng* rng) {
  const uint64_t size = view.node(id).size;
  std::vector<char> buf;
  size_t nread = 99;
  // At and past the end: nothing.
  buf.resize(8);
  FUZZ_CHECK(view.Read(id, size, 8, buf.data(), &nread).ok() && nread == 0);
  FUZZ_CHECK(view.Read(id, size + 1 + rng->Below(1000), 8, buf.data(), &nread).ok() && nread == 0);
  if (size > kMaxFullRead) {
    // Only the end: a read straddling it is short by exactly the overhang.
    const uint64_t tail = std::min<uint64_t>(size, 64);
    buf.resize(tail + 32);
    FUZZ_CHECK(view.Read(id, size - tail, buf.size(), buf.data(), &nread).ok() && nread == tail);
    return;
  }
  const std::string all = ReadAll(view, id);
  // The whole file again as consecutive pieces of fuzz-chosen sizes.
  const uint64_t max_piece = 1 + rng->Below(rng->Below(2) ? 64 : size + 1);
  uint64_t pos = 0;
  for (int reads = 0; pos < size && reads < 256; ++reads) {
    const uint64_t len = std::min<uint64_t>(size - pos, 1 + rng->Below(max_piece));
    buf.resize(len);
    FUZZ_CHECK(view.Read(id, pos, len, buf.data(), &nread).ok());
    FUZZ_CHECK(nread == len);
    FUZZ_CHECK(std::memcmp(buf.data(), all.data() + pos, len) == 0);
    pos += len;
  }
  // Arbitrary ranges, possibly running past the end.
  for (int i = 0; i < 16; ++i) {
    const uint64_t off = rng->Below(size + 8);
    const uint64_t len = rng->Below(size + 16);
    buf.resize(len + 1);
    FUZZ_CHECK(view.Read(id, off, len, buf.data(), &nread).ok());
    const uint64_t expect = off >= size ? 0 : std::min<uint64_t>(len, size - off);
    FUZZ_CHECK(nread == expect);
    if (expect) FUZZ_CHECK(std::memcmp(buf.data(), all.data() + off, expect) == 0);
  }
}

// A served safetensors file must be valid safetensors (our own reader enforces the
// reference implementation's rules) with the tensors as served.
void CheckServedSafetensors(const View& view, View::NodeId id, const ServedTensor* single) {
  if (view.node(id).size > kMaxFullRead) return;
  const std::string all = ReadAll(view, id);
  const std::string& path = OutFile().Write(reinterpret_cast<const uint8_t*>(all.data()), all.size());
  Catalog parsed;
  parsed.files = std::make_shared<SourceFiles>(OutFile().env());
  nlohmann::json metadata;
  Status st = ReadSafetensorsFile(path, &parsed, &metadata, ckptfs_fuzz::FuzzLimits());
  if (!st.ok()) std::fprintf(stderr, "served %s: %s\n", view.PathOf(id).c_str(), st.message().c_str());
  FUZZ_CHECK(st.ok());
  if (single) {
    FUZZ_CHECK(parsed.tensors.size() == 1);
    std::string_view dtype;
    std::vector<uint64_t> shape;
    ServedDTypeAndShape(*single, &dtype, &shape);
    FUZZ_CHECK(parsed.tensors[0].shape == shape);
    FUZZ_CHECK(Info(parsed.tensors[0].dtype).safetensors_name == dtype);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kControl + 4) return 0;
  const uint8_t* control = data;
  ckptfs_fuzz::MemFile& input = ckptfs_fuzz::MemFile::Get();
  const std::string& path = input.Write(data + kControl, size - kControl);
  SourceOptions source_options;
  source_options.limits = ckptfs_fuzz::FuzzLimits();
  source_options.env = input.env();
  std::shared_ptr<const Catalog> catalog;
  if (!OpenCatalog(path, source_options, &catalog).ok()) return 0;
  ckptfs_fuzz::CheckCatalog(*catalog);

  ViewOptions options;
  static const std::optional<DType> kDtypes[] = {std::nullopt, DType::kBF16, DType::kF16, DType::kF32};
  options.dtype = kDtypes[control[0] & 3];
  options.checksums = control[0] & 4;
  if ((control[0] & 8) && !catalog->tensors.empty()) {
    const std::string& key = catalog->tensors[0].key;
    options.root = key.substr(0, key.find('.'));
  }
  if (control[1]) options.shard_size = uint64_t{control[1]} * 64 + control[2];
  uint64_t seed = 0;
  std::memcpy(&seed, control + 8, sizeof seed);
  Rng rng(seed);

  std::unique_ptr<View> view;  // as the daemon does: Build applies the options
  if (!View::Build(catalog, options, &view).ok()) return 0;

  // Tree consistency.
  for (View::NodeId id = 0; id < view->node_count(); ++id) {
    const View::Node n = view->node(id);
    if (id != View::kRoot) FUZZ_CHECK(n.parent < view->node_count() && view->IsDir(n.parent));
    FUZZ_CHECK(n.is_dir == view->IsDir(id) && n.parent == view->ParentOf(id) && n.name == view->NameOf(id) &&
               n.size == view->SizeOf(id));
    const size_t children = n.is_dir ? view->ChildCount(id) : 0;
    for (size_t i = 0; i < children; ++i) {
      const View::NodeId child = view->ChildAt(id, i);
      FUZZ_CHECK(child < view->node_count());
      FUZZ_CHECK(view->ParentOf(child) == id);
      if (i) FUZZ_CHECK(view->NameOf(view->ChildAt(id, i - 1)) < view->NameOf(child));
      auto by_name = view->Child(id, view->NameOf(child));
      FUZZ_CHECK(by_name && *by_name == child);
    }
    auto found = view->Lookup(view->PathOf(id));
    FUZZ_CHECK(found && *found == id);
  }
  // Reads of every file (a fuzz-chosen subset when there are many).
  int files = 0;
  for (View::NodeId id = 0; id < view->node_count(); ++id) {
    if (view->node(id).is_dir) continue;
    if (++files > 32 && rng.Below(8)) continue;
    CheckReads(*view, id, &rng);
  }
  const ServedTensors& served = view->served();
  for (size_t i = 0; i < served.size() && i < 8; ++i) {
    const View::NodeId id = view->TensorFile(i);
    const ServedTensor t = served[i];
    FUZZ_CHECK(!view->node(id).is_dir);
    FUZZ_CHECK(view->node(id).size >= t.nbytes() + 8);
    CheckServedSafetensors(*view, id, &t);
  }
  if (auto model = view->Lookup("model.safetensors")) CheckServedSafetensors(*view, *model, nullptr);
  return 0;
}
