// libFuzzer target: the DeepSpeed ZeRO reader (src/format/deepspeed/zero.cpp) on a fuzzed pickle.
//
// The folder is a small real ZeRO-2 checkpoint (data/zero/: world size 2, written by
// DeepSpeed, see make_seeds.py --zero-template) copied into a MemoryEnv. Each input
// replaces the data.pkl of one of its rank files, the rest of that zip (tensor records)
// kept as is:
//   byte 0   bits 0-6: which file (modulo the file count), bit 7: -o moments
//   the rest the new data.pkl
// Invariants: catalog invariants (valid layouts, every box inside its rank file, boxes
// adding up to the tensor), unique keys.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "codec/zip.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;

namespace {

struct Record {
  std::string name;
  std::string bytes;
};
struct RankFile {
  std::string path;       // in the in-memory folder
  std::string original;   // its bytes
  std::vector<Record> records;
  size_t pickle = 0;      // index of the data.pkl record
};

const std::string g_dir = "/fuzz/zero/global_step2";
std::shared_ptr<MemoryEnv> g_env;
std::vector<RankFile> g_files;
int g_dirty = -1;  // file whose pickle the last input replaced

void PutLE(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

// A stored zip archive of `records` (no CRCs: ckptfs never checks them).
std::string BuildZip(const std::vector<Record>& records) {
  std::string out, cd;
  for (const Record& r : records) {
    const uint64_t lho = out.size();
    PutLE(&out, 0x04034b50, 4), PutLE(&out, 20, 2), PutLE(&out, 0, 2), PutLE(&out, 0, 2);
    PutLE(&out, 0, 4), PutLE(&out, 0, 4), PutLE(&out, r.bytes.size(), 4), PutLE(&out, r.bytes.size(), 4);
    PutLE(&out, r.name.size(), 2), PutLE(&out, 0, 2);
    out += r.name;
    out += r.bytes;
    PutLE(&cd, 0x02014b50, 4), PutLE(&cd, 20, 2), PutLE(&cd, 20, 2), PutLE(&cd, 0, 2), PutLE(&cd, 0, 2);
    PutLE(&cd, 0, 4), PutLE(&cd, 0, 4), PutLE(&cd, r.bytes.size(), 4), PutLE(&cd, r.bytes.size(), 4);
    PutLE(&cd, r.name.size(), 2), PutLE(&cd, 0, 2), PutLE(&cd, 0, 2), PutLE(&cd, 0, 2), PutLE(&cd, 0, 2);
    PutLE(&cd, 0, 4), PutLE(&cd, lho, 4);
    cd += r.name;
  }
  const uint64_t cd_offset = out.size();
  out += cd;
  PutLE(&out, 0x06054b50, 4), PutLE(&out, 0, 2), PutLE(&out, 0, 2);
  PutLE(&out, records.size(), 2), PutLE(&out, records.size(), 2);
  PutLE(&out, cd.size(), 4), PutLE(&out, cd_offset, 4), PutLE(&out, 0, 2);
  return out;
}

void WriteWhole(const std::string& path, const std::string& bytes) {
  if (!g_env->WriteFile(path, bytes).ok()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  namespace fs = std::filesystem;
  const char* env = std::getenv("CKPTFS_FUZZ_DATA");
  const std::string templ = std::string(env ? env : CKPTFS_FUZZ_DATA) + "/zero";
  g_env = std::make_shared<MemoryEnv>();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(templ)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    RankFile rf;
    rf.path = g_dir + "/" + name;
    SourceFiles files;
    uint32_t file;
    ZipArchive zip;
    if (!files.Add(templ + "/" + name, &file).ok() || !zip.Open(files, files.whole(file)).ok()) std::abort();
    for (const ZipEntry& e : zip.entries()) {
      Record r{std::string(e.name), {}};
      if (!zip.ReadStored(e, 64u << 20, &r.bytes).ok()) std::abort();
      if (e.name.size() >= 9 && e.name.compare(e.name.size() - 9, 9, "/data.pkl") == 0) rf.pickle = rf.records.size();
      rf.records.push_back(std::move(r));
    }
    // Rebuilt by our writer, so that an input equal to the seed exercises the same bytes.
    rf.original = BuildZip(rf.records);
    WriteWhole(rf.path, rf.original);
    g_files.push_back(std::move(rf));
  }
  if (g_files.empty()) {
    std::fprintf(stderr, "fuzz_zero: no template files in %s\n", templ.c_str());
    std::abort();
  }
  // The untouched folder must read: otherwise the target fuzzes nothing.
  SourceOptions options;
  options.env = g_env;
  std::shared_ptr<const Catalog> catalog;
  Status st = OpenCatalog(g_dir, options, &catalog);
  if (!st.ok() || catalog->tensors.empty()) {
    std::fprintf(stderr, "fuzz_zero: the template folder does not read: %s\n", st.message().c_str());
    std::abort();
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t which = (data[0] & 0x7F) % g_files.size();
  if (g_dirty >= 0 && static_cast<size_t>(g_dirty) != which) WriteWhole(g_files[g_dirty].path, g_files[g_dirty].original);
  RankFile& rf = g_files[which];
  std::vector<Record> records = rf.records;
  records[rf.pickle].bytes.assign(reinterpret_cast<const char*>(data) + 1, size - 1);
  WriteWhole(rf.path, BuildZip(records));
  g_dirty = static_cast<int>(which);

  SourceOptions options;
  options.zero_moments = data[0] & 0x80;
  options.limits = ckptfs_fuzz::FuzzLimits();
  options.env = g_env;
  std::shared_ptr<const Catalog> catalog;
  Status st = OpenCatalog(g_dir, options, &catalog);
  if (!st.ok()) {
    FUZZ_CHECK(!st.message().empty());
    return 0;
  }
  ckptfs_fuzz::CheckCatalog(*catalog);
  std::set<std::string> keys;
  for (const TensorEntry& t : catalog->tensors) FUZZ_CHECK(keys.insert(t.key).second);
  return 0;
}
