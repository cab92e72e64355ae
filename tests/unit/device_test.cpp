// The device pipeline (src/device/) over the host back end: every tensor's "device" bytes
// must equal what the View serves for the tensor's own file (read through the View's segment
// path, independently of the pipeline's route), for ring buffers smaller than a tensor,
// 1..N buffers, 1..3 I/O threads, tensors split over several files, gathers, conversions,
// O_DIRECT and buffered reads, and the emulated direct (cuFile-like) route. Errors mid-stream
// (source changed, truncated, back-end copy failure, cancellation) must return a status that
// names the file, after draining the copies in flight, leaving nothing allocated.
#define BOOST_TEST_MODULE device_test
#include <boost/test/unit_test.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "ckptfs/device.hpp"
#include "ckptfs/tensor_map.hpp"
#include "ckptfs/view.hpp"
#include "device/plan.hpp"
#include "test_util.hpp"

namespace ckptfs {
// For BOOST_TEST's messages.
inline std::ostream& operator<<(std::ostream& out, Status::Code code) { return out << static_cast<int>(code); }
}  // namespace ckptfs

using ckptfs::Box;
using ckptfs::Catalog;
using ckptfs::DeviceBackend;
using ckptfs::DeviceDestination;
using ckptfs::DeviceLoadOptions;
using ckptfs::DeviceLoadStats;
using ckptfs::DeviceTensor;
using ckptfs::DType;
using ckptfs::HostBackendOptions;
using ckptfs::Status;
using ckptfs::TensorEntry;
using ckptfs::View;
using ckptfs::ViewOptions;
using namespace ckptfs_test;

namespace {

// A safetensors file of tensors with awkward sizes: 3 bytes of U8, 1000 floats (not a
// multiple of 4 KiB), one of 300 KiB (bigger than small ring buffers), a zero-size tensor,
// bf16 and int64 tensors.
struct SafetensorsSource {
  TempDir dir;
  std::string path;
  explicit SafetensorsSource(const std::string& where = "") {
    path = (where.empty() ? dir.path() : where) + "/model.safetensors";
    struct T {
      std::string key, dtype, shape;
      size_t bytes;
    };
    const std::vector<T> tensors = {
        {"a.u8", "U8", "[3]", 3},
        {"b.f32", "F32", "[10,100]", 4000},
        {"c.big", "F32", "[300,256]", 300 * 256 * 4},
        {"d.empty", "F32", "[0,4]", 0},
        {"e.bf16", "BF16", "[777]", 1554},
        {"f.i64", "I64", "[5]", 40},
    };
    std::string header = "{", data;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const T& t = tensors[i];
      std::string bytes = PatternBytes(t.bytes, static_cast<uint32_t>(i + 1));
      if (t.dtype == "F32" || t.dtype == "BF16") {
        // Finite values only, so a conversion is well defined (exponent bits never all ones).
        for (size_t k = t.dtype == "F32" ? 3 : 1; k < bytes.size(); k += t.dtype == "F32" ? 4 : 2)
          bytes[k] = static_cast<char>(bytes[k] & 0x3F);
      }
      if (i) header += ",";
      header += "\"" + t.key + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":" + t.shape + ",\"data_offsets\":[" +
                std::to_string(data.size()) + "," + std::to_string(data.size() + bytes.size()) + "]}";
      data += bytes;
    }
    header += "}";
    while ((8 + header.size()) % 8) header += ' ';
    WriteFile(path, SafetensorsBytes(header, data));
  }
};

std::unique_ptr<View> MustView(std::shared_ptr<const Catalog> catalog, ViewOptions options = {}) {
  std::unique_ptr<View> view;
  Status s = View::Build(std::move(catalog), options, &view);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return view;
}

std::unique_ptr<View> MustOpenView(const std::string& path, ViewOptions options = {}) {
  std::shared_ptr<const Catalog> catalog;
  Status s = ckptfs::OpenCatalog(path, &catalog);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return MustView(catalog, options);
}

// Tensor i's bytes as its tensors/<key>.safetensors file serves them (after the header).
std::string Expected(const View& view, size_t i) {
  const View::NodeId id = view.TensorFile(i);
  std::string whole(view.node(id).size, '\0');
  size_t n = 0;
  Status s = view.Read(id, 0, whole.size(), whole.data(), &n);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  const uint64_t nbytes = view.served()[i].nbytes();
  return whole.substr(whole.size() - nbytes);
}

void CheckLoaded(const View& view, const std::vector<DeviceTensor>& tensors, const std::string& what) {
  for (const DeviceTensor& t : tensors) {
    const std::string want = Expected(view, t.index);
    BOOST_REQUIRE_EQUAL(t.nbytes, want.size());
    BOOST_REQUIRE_MESSAGE(t.nbytes == 0 || std::memcmp(t.device_ptr, want.data(), want.size()) == 0,
                          what << ": tensor " << t.key << " differs");
  }
}

void CheckNothingLeft(const DeviceBackend& backend, const std::string& what) {
  const auto st = ckptfs::GetHostBackendStats(backend);
  BOOST_TEST_CONTEXT(what) {
    BOOST_TEST(st.live_device_allocs == 0u);
    BOOST_TEST(st.live_pinned_allocs == 0u);
    BOOST_TEST(st.live_streams == 0u);
    BOOST_TEST(st.live_events == 0u);
    BOOST_TEST(st.freed_while_in_flight == 0u);
    BOOST_TEST(st.unregistered_direct_reads == 0u);
  }
}

// Loads with `options`, checks every byte and that everything is freed.
DeviceLoadStats LoadAndCheck(const View& view, const DeviceLoadOptions& options, const HostBackendOptions& host,
                             const std::string& what) {
  auto backend = ckptfs::MakeHostBackend(host);
  std::vector<DeviceTensor> tensors;
  DeviceLoadStats stats;
  Status s = ckptfs::LoadToDevice(view, *backend, options, &tensors, &stats);
  BOOST_REQUIRE_MESSAGE(s.ok(), what << ": " << s.message());
  CheckLoaded(view, tensors, what);
  Status v = ckptfs::VerifyDeviceTensors(view, *backend, tensors);
  BOOST_REQUIRE_MESSAGE(v.ok(), what << ": " << v.message());
  ckptfs::FreeDeviceTensors(*backend, &tensors);
  CheckNothingLeft(*backend, what);
  return stats;
}

// Two source files, tensors split across them (as ZeRO serves a parameter from every rank
// file), a strided tensor (a transposed matrix), an int tensor, a matrix tiled by columns
// over both files.
struct SplitSource {
  TempDir dir;
  std::shared_ptr<Catalog> catalog = std::make_shared<Catalog>();
  std::string rank0, rank1;
  explicit SplitSource(const std::string& where = "") {
    const std::string base = where.empty() ? dir.path() : where;
    rank0 = base + "/rank0.bin";
    rank1 = base + "/rank1.bin";
    std::string b0 = PatternBytes(200000, 7), b1 = PatternBytes(150000, 8);
    for (std::string* b : {&b0, &b1})
      for (size_t k = 3; k < b->size(); k += 4) (*b)[k] = static_cast<char>((*b)[k] & 0x3F);
    WriteFile(rank0, b0);
    WriteFile(rank1, b1);
    catalog->format = "test";
    catalog->source = base;
    uint32_t f0 = 0, f1 = 0;
    BOOST_REQUIRE(catalog->files->Add(rank0, &f0).ok());
    BOOST_REQUIRE(catalog->files->Add(rank1, &f1).ok());
    auto add = [&](std::string key, DType dtype, std::vector<uint64_t> shape) -> TensorEntry& {
      TensorEntry t;
      t.path = {key};
      t.key = std::move(key);
      t.dtype = dtype;
      t.shape = std::move(shape);
      catalog->tensors.push_back(std::move(t));
      return catalog->tensors.back();
    };
    // 30000 floats: 20000 from rank 0 at 100, 10000 from rank 1 at 52 (odd offsets).
    add("w.split", DType::kF32, {300, 100}).boxes = {Box::Range(f0, 100, 0, 20000), Box::Range(f1, 52, 20000, 10000)};
    // Adjacent in rank 0 right after w.split's part, then rank 1: merged reads.
    add("x.split", DType::kF32, {1000}).boxes = {Box::Range(f0, 80100, 0, 500), Box::Range(f1, 40052, 500, 500)};
    // Three ranges, one of them 4 bytes.
    add("y.three", DType::kF32, {2001}).boxes = {Box::Range(f1, 50000, 0, 1000), Box::Range(f0, 100000, 1000, 1),
                                                  Box::Range(f1, 60000, 1001, 1000)};
    // A transposed 64 x 48 float matrix stored row-major as 48 x 64 in rank 0 at 120000.
    add("z.strided", DType::kF32, {64, 48}).boxes = {Box::Strided(f0, 120000, {64, 48}, {1, 64})};
    add("i.int", DType::kI32, {100}).boxes = {Box::Range(f1, 100000, 0, 100)};
    // A 40 x 30 float matrix split by columns: 10 row-major in rank 0, 20 transposed in rank 1.
    add("g.cols", DType::kF32, {40, 30}).boxes = {Box{f0, 140000, {0, 0}, {40, 10}, {10, 1}},
                                                  Box{f1, 110000, {0, 10}, {40, 20}, {1, 40}}};
    for (const TensorEntry& t : catalog->tensors) {
      Status valid = ckptfs::ValidateLayout(t, *catalog->files, catalog->source);
      BOOST_REQUIRE_MESSAGE(valid.ok(), valid.message());
    }
  }
};

}  // namespace

BOOST_AUTO_TEST_CASE(small_buffers_threads_and_ring_sizes) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  for (size_t buffer : {size_t{4096}, size_t{8192}, size_t{65536}, size_t{16} << 20}) {
    for (int buffers : {1, 2, 3, 5}) {
      for (int threads : {1, 3}) {
        DeviceLoadOptions o;
        o.buffer_bytes = buffer;
        o.buffers = buffers;
        o.io_threads = threads;
        HostBackendOptions h;
        h.copy_delay_us = buffer <= 8192 ? 20 : 200;  // copies lag behind the reads
        LoadAndCheck(*view, o, h,
                     "buffer " + std::to_string(buffer) + " x" + std::to_string(buffers) + " threads " +
                         std::to_string(threads));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(split_strided_and_converted_tensors) {
  SplitSource src;
  for (auto dtype : {std::optional<DType>(), std::optional<DType>(DType::kBF16), std::optional<DType>(DType::kF16)}) {
    ViewOptions vo;
    vo.dtype = dtype;
    auto view = MustView(src.catalog, vo);
    for (size_t buffer : {size_t{4096}, size_t{12288}, size_t{1} << 20}) {
      for (int buffers : {1, 4}) {
        DeviceLoadOptions o;
        o.buffer_bytes = buffer;
        o.buffers = buffers;
        HostBackendOptions h;
        h.copy_delay_us = 10;
        const auto stats = LoadAndCheck(*view, o, h, "split dtype " + std::string(dtype ? "conv" : "none"));
        BOOST_TEST(stats.tensors == 6u);
        if (dtype) BOOST_TEST(stats.view_bytes > 0u);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(emulated_direct_route) {
  SplitSource split;
  SafetensorsSource st;
  for (const View* v : {MustView(split.catalog).release(), MustOpenView(st.path).release()}) {
    std::unique_ptr<const View> view(v);
    for (size_t buffer : {size_t{4096}, size_t{1} << 20}) {
      DeviceLoadOptions o;
      o.buffer_bytes = buffer;
      o.buffers = 2;
      HostBackendOptions h;
      h.emulate_direct = true;
      h.copy_delay_us = 10;
      const auto stats = LoadAndCheck(*view, o, h, "direct " + std::to_string(buffer));
      BOOST_TEST(stats.direct_bytes > 0u);
    }
  }
}

// The caller's stream still holds slow writes to a destination when the load starts (a block
// the caching allocator handed out while kernels queued on it still use it): with
// after_stream the load's bytes land after them, so they are what the destination holds.
BOOST_AUTO_TEST_CASE(after_stream_orders_the_load_behind_the_callers_work) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  HostBackendOptions h;
  h.copy_delay_us = 20000;
  auto backend = ckptfs::MakeHostBackend(h);
  const size_t index = 2;  // c.big
  const std::string want = Expected(*view, index);
  void* dst = nullptr;
  BOOST_REQUIRE(backend->AllocDevice(want.size(), &dst).ok());
  const std::string junk(want.size(), '\x5a');
  ckptfs::DeviceStream caller = nullptr;
  BOOST_REQUIRE(backend->CreateStream(&caller).ok());
  for (int i = 0; i < 5; ++i)
    BOOST_REQUIRE(backend->CopyAsync(dst, junk.data(), junk.size(), ckptfs::CopyKind::kHostToDevice, caller).ok());
  DeviceLoadOptions o;
  o.after_stream = caller;
  Status s = ckptfs::LoadIntoDevice(*view, *backend, o, {DeviceDestination{index, dst, want.size()}});
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE(backend->Synchronize(caller).ok());
  BOOST_TEST(std::memcmp(dst, want.data(), want.size()) == 0, "a write queued before the load landed after it");
  backend->DestroyStream(caller);
  backend->FreeDevice(dst);
  CheckNothingLeft(*backend, "after_stream");
}

BOOST_AUTO_TEST_CASE(buffered_fallback_on_tmpfs) {
  if (!std::filesystem::is_directory("/dev/shm")) return;
  TempDir shm_dir_holder;  // unused; the source goes to /dev/shm
  char tmpl[] = "/dev/shm/ckptfs-device-XXXXXX";
  BOOST_REQUIRE(::mkdtemp(tmpl));
  const std::string where = tmpl;
  {
    SafetensorsSource src(where);
    auto view = MustOpenView(src.path);
    DeviceLoadOptions o;
    o.buffer_bytes = 8192;
    const auto stats = LoadAndCheck(*view, o, {}, "tmpfs");
    // tmpfs refuses O_DIRECT before Linux 6.6 (buffered reads then); newer kernels take it.
    BOOST_TEST_MESSAGE("tmpfs: O_DIRECT used: " << stats.used_o_direct);
  }
  std::filesystem::remove_all(where);
}

BOOST_AUTO_TEST_CASE(o_direct_on_a_disk_file_system) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  DeviceLoadOptions o;
  o.buffer_bytes = 8192;
  const auto stats = LoadAndCheck(*view, o, {}, "disk");
  // Not every file system takes O_DIRECT; where it does, the reads widened and trimmed.
  BOOST_TEST_MESSAGE("O_DIRECT used: " << stats.used_o_direct << ", read " << stats.bytes_read << " for "
                                       << stats.bytes);
  DeviceLoadOptions b = o;
  b.direct_io = false;
  BOOST_TEST(!LoadAndCheck(*view, b, {}, "buffered").used_o_direct);
}

BOOST_AUTO_TEST_CASE(selection) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  std::vector<size_t> idx;
  BOOST_REQUIRE(ckptfs::SelectTensors(*view, {"b.f32", "e.*"}, &idx).ok());
  BOOST_TEST(idx.size() == 2u);
  DeviceLoadOptions o;
  o.select = {"c.*", "a.u8"};
  auto backend = ckptfs::MakeHostBackend();
  std::vector<DeviceTensor> tensors;
  BOOST_REQUIRE(ckptfs::LoadToDevice(*view, *backend, o, &tensors).ok());
  BOOST_REQUIRE_EQUAL(tensors.size(), 2u);
  BOOST_TEST(tensors[0].key == "a.u8");
  BOOST_TEST(tensors[1].key == "c.big");
  CheckLoaded(*view, tensors, "selection");
  ckptfs::FreeDeviceTensors(*backend, &tensors);
  o.select = {"nope.*"};
  Status s = ckptfs::LoadToDevice(*view, *backend, o, &tensors);
  BOOST_TEST(s.code() == Status::Code::kNotFound);
  BOOST_TEST(Contains(s.message(), "nope.*"));
  CheckNothingLeft(*backend, "selection");
}

BOOST_AUTO_TEST_CASE(adjacent_tensors_share_reads) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  std::vector<DeviceDestination> dests;
  std::vector<std::string> storage;
  for (size_t i = 0; i < view->served().size(); ++i) {
    storage.emplace_back(view->served()[i].nbytes(), '\0');
    dests.push_back({i, storage.back().data(), storage.back().size()});
  }
  ckptfs::device::Plan plan;
  BOOST_REQUIRE(ckptfs::device::MakePlan(*view, dests, size_t{1} << 20, nullptr, &plan).ok());
  // Everything fits one 1 MiB buffer, as one read of one contiguous range.
  BOOST_TEST(plan.batches.size() == 1u);
  BOOST_TEST(plan.batches[0].reads.size() == 1u);
  BOOST_REQUIRE(ckptfs::device::MakePlan(*view, dests, 4096, nullptr, &plan).ok());
  for (const auto& b : plan.batches) {
    uint64_t end = 0;
    for (const auto& r : b.reads) end = std::max(end, r.buffer_offset + ckptfs::device::AlignUp(r.offset + r.length) -
                                                           ckptfs::device::AlignDown(r.offset));
    BOOST_TEST(end <= plan.buffer_capacity);
  }
  // A destination of the wrong size is refused.
  dests[1].nbytes -= 1;
  BOOST_TEST(ckptfs::LoadIntoDevice(*view, *ckptfs::MakeHostBackend(), {}, dests).code() ==
             Status::Code::kInvalidArgument);
}

BOOST_AUTO_TEST_CASE(source_changed_mid_stream) {
  for (int threads : {1, 2}) {
    for (bool emulate_direct : {false, true}) {
      SplitSource src;
      auto view = MustView(src.catalog);
      auto backend = ckptfs::MakeHostBackend({.copy_delay_us = 200, .fail_copy_at = 0, .emulate_direct = emulate_direct});
      DeviceLoadOptions o;
      o.buffer_bytes = 4096;
      o.buffers = 3;
      o.io_threads = threads;
      int calls = 0;
      const std::string rank1 = src.rank1;
      o.cancelled = [&] {
        if (++calls == 6) {
          // Rewrite rank 1 in place (same size): its mtime/ctime change.
          std::string bytes = ReadFile(rank1);
          bytes[0] ^= 1;
          ::usleep(10000);
          WriteFile(rank1, bytes);
        }
        return false;
      };
      std::vector<DeviceTensor> tensors;
      Status s = ckptfs::LoadToDevice(*view, *backend, o, &tensors);
      BOOST_TEST(s.code() == Status::Code::kSourceChanged, s.message());
      BOOST_TEST(Contains(s.message(), "rank1.bin"), s.message());
      BOOST_TEST(tensors.empty());
      CheckNothingLeft(*backend, "source change");
    }
  }
}

BOOST_AUTO_TEST_CASE(truncated_mid_stream) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  auto backend = ckptfs::MakeHostBackend({.copy_delay_us = 100});
  DeviceLoadOptions o;
  o.buffer_bytes = 4096;
  int calls = 0;
  o.cancelled = [&] {
    if (++calls == 10) BOOST_REQUIRE(::truncate(src.path.c_str(), 20000) == 0);
    return false;
  };
  std::vector<DeviceTensor> tensors;
  Status s = ckptfs::LoadToDevice(*view, *backend, o, &tensors);
  BOOST_TEST(s.code() == Status::Code::kSourceChanged, s.message());
  BOOST_TEST(Contains(s.message(), "model.safetensors"), s.message());
  CheckNothingLeft(*backend, "truncated");
}

BOOST_AUTO_TEST_CASE(backend_copy_failure) {
  SplitSource src;
  auto view = MustView(src.catalog);
  for (uint64_t at : {1u, 7u, 30u}) {
    auto backend = ckptfs::MakeHostBackend({.copy_delay_us = 100, .fail_copy_at = at});
    DeviceLoadOptions o;
    o.buffer_bytes = 4096;
    o.io_threads = 2;
    std::vector<DeviceTensor> tensors;
    Status s = ckptfs::LoadToDevice(*view, *backend, o, &tensors);
    BOOST_TEST(s.code() == Status::Code::kIOError, s.message());
    BOOST_TEST(Contains(s.message(), "injected copy failure"));
    CheckNothingLeft(*backend, "copy failure at " + std::to_string(at));
  }
}

BOOST_AUTO_TEST_CASE(cancellation) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  for (int after : {0, 1, 5}) {
    auto backend = ckptfs::MakeHostBackend({.copy_delay_us = 100});
    DeviceLoadOptions o;
    o.buffer_bytes = 4096;
    o.io_threads = 2;
    int calls = 0;
    o.cancelled = [&] { return ++calls > after; };
    std::vector<DeviceTensor> tensors;
    Status s = ckptfs::LoadToDevice(*view, *backend, o, &tensors);
    BOOST_TEST(s.sys_errno() == ECANCELED, s.message());
    BOOST_TEST(calls == after + 1);  // no buffer starts after the cancellation
    CheckNothingLeft(*backend, "cancel after " + std::to_string(after));
  }
}

BOOST_AUTO_TEST_CASE(read_tensor_data_bounds) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  char buf[16];
  BOOST_TEST(view->ReadTensorData(0, 0, 3, buf).ok());
  BOOST_TEST(view->ReadTensorData(0, 1, 3, buf).code() == Status::Code::kInvalidArgument);
  BOOST_TEST(view->ReadTensorData(99, 0, 1, buf).code() == Status::Code::kInvalidArgument);
}

BOOST_AUTO_TEST_CASE(cuda_backend_without_gpu_says_so) {
  std::unique_ptr<DeviceBackend> backend;
  Status s = ckptfs::OpenBackend("cuda", 0, &backend);
  if (s.ok()) {
    BOOST_TEST_MESSAGE("a CUDA device is present: " << backend->Describe());
    return;
  }
  BOOST_TEST(s.message().rfind("no CUDA device: ", 0) == 0u, s.message());
  BOOST_TEST(s.message().find('\n') == std::string::npos);
  // auto never falls back to the host.
  BOOST_TEST(ckptfs::OpenBackend("auto", 0, &backend).message().rfind("no CUDA device: ", 0) == 0u);
  BOOST_TEST(ckptfs::OpenBackend("gpu", 0, &backend).code() == Status::Code::kInvalidArgument);
}

// The CPU load's map-or-copy decision: a view of the file only for one local range as stored,
// not empty and aligned for its type. SafetensorsSource packs tensors after a 3-byte one, so
// only that one starts aligned.
BOOST_AUTO_TEST_CASE(cpu_placement_and_mapped_load) {
  SafetensorsSource src;
  auto view = MustOpenView(src.path);
  const ckptfs::ServedTensors& tensors = view->served();
  const ckptfs::SourceFiles& files = *view->source().files;
  std::vector<std::string> placed;
  for (size_t i = 0; i < tensors.size(); ++i)
    placed.push_back(ckptfs::CpuPlacementName(ckptfs::PlaceOnCpu(tensors[i], files)));
  const std::vector<std::string> want = {"file_map", "copy", "copy", "copy", "copy", "copy"};
  BOOST_TEST(placed == want, boost::test_tools::per_element());

  std::vector<size_t> all(tensors.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  ckptfs::TensorRegion region;
  DeviceLoadStats stats;
  BOOST_REQUIRE(ckptfs::LoadMapped(*view, all, &region, &stats).ok());
  uint64_t bytes = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const std::string expected = Expected(*view, i);
    bytes += expected.size();
    BOOST_TEST(std::memcmp(static_cast<char*>(region.base) + region.offsets[i], expected.data(), expected.size()) == 0,
               "tensor " << tensors[i].key() << " differs in the region");
  }
  BOOST_TEST(stats.tensors == all.size());
  BOOST_TEST(stats.bytes == bytes);
  BOOST_TEST(stats.bytes_read + stats.mapped_bytes == bytes);
  BOOST_REQUIRE(ckptfs::UnmapRegion(region.base, region.size).ok());

  // A file rewritten since it was indexed is never mapped.
  int fd = -1;
  BOOST_REQUIRE(ckptfs::OpenUnchangedForMap(files, 0, &fd).ok());
  ::close(fd);
  const struct timespec times[2] = {{0, UTIME_OMIT}, {1, 0}};
  BOOST_REQUIRE(::utimensat(AT_FDCWD, src.path.c_str(), times, 0) == 0);
  Status s = ckptfs::OpenUnchangedForMap(files, 0, &fd);
  BOOST_TEST(s.code() == Status::Code::kSourceChanged);
  BOOST_TEST(Contains(s.message(), "changed since it was indexed"));
  BOOST_TEST(fd == -1);
}

// `ckptfs load --json` and ckptfs_last_load_stats share these keys; scripts read them.
BOOST_AUTO_TEST_CASE(load_statistics_json_keys) {
  DeviceLoadStats stats;
  stats.bytes = 2000000000;
  stats.seconds = 2;
  stats.maps = 3;
  const nlohmann::json piped = nlohmann::json::parse(ckptfs::LoadStatsJson(stats, "host", "host memory", true));
  std::vector<std::string> keys;
  for (const auto& [key, value] : piped.items()) keys.push_back(key);
  const std::vector<std::string> want = {"backend",        "bytes",    "bytes_read", "device",
                                         "direct_bytes",   "gb_per_s", "o_direct",   "seconds",
                                         "buffers_filled", "tensors",  "verified",   "view_bytes"};
  std::vector<std::string> sorted_want = want;
  std::sort(sorted_want.begin(), sorted_want.end());
  BOOST_TEST(keys == sorted_want, boost::test_tools::per_element());
  BOOST_TEST(piped["gb_per_s"].get<double>() == 1.0);
  BOOST_TEST(piped["verified"].get<bool>());
  const nlohmann::json mapped = nlohmann::json::parse(ckptfs::LoadStatsJson(stats, ckptfs::kMapLoadBackend, "", false));
  BOOST_TEST(mapped.size() == want.size() + 2);
  BOOST_TEST(mapped["maps"].get<uint64_t>() == 3u);
  BOOST_TEST(mapped.contains("mapped_bytes"));
}
