// Composing tensors of private file maps: one anonymous reservation, file pages mapped over it
// with MAP_FIXED where a tensor's byte offset within a page matches its source's.
//
// Why maps: a tensor loaded by copying pays a fault and a zeroed page for every 4 KiB of new
// anonymous memory plus the copy, several times what mapping pages already in the page cache
// costs (doc in tests/bench/README.md, bench_python_load.py). A ZeRO-3 parameter is one range
// of every rank's flat fp32 partition; those partitions sit at the same offset within a page
// in every rank's file, and the ranges have whole-page lengths for ordinary shapes, so all but
// the page where two ranks' ranges meet can be the files' own pages.
#include "ckptfs/tensor_map.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <system_error>
#include <thread>

#include "ckptfs/catalog.hpp"
#include "io/source_changed.hpp"

namespace ckptfs {
namespace {

// A map shorter than this is not worth its mmap call and its split of the region's mapping:
// those bytes are read instead.
constexpr uint64_t kMinMapBytes = 64 << 10;
// Every map splits the region's mapping in up to three, and a process has
// /proc/sys/vm/max_map_count (65530 by default) mappings in all: past this many maps in one
// region the remaining bytes are read.
constexpr size_t kMaxMaps = 8192;
// madvise(MADV_POPULATE_READ), which older C library headers lack.
#ifdef MADV_POPULATE_READ
constexpr int kPopulateRead = MADV_POPULATE_READ;
#else
constexpr int kPopulateRead = 22;
#endif
// Threads that populate maps or read the bytes no map supplies, at most.
constexpr size_t kWorkThreads = 4;
// What one fault of a file map makes resident where it cannot use a huge entry: the kernel
// maps the cached pages around the faulting one, fault_around_bytes (64 KiB by default, set
// only through debugfs). A smaller setting leaves pages between these points to be mapped
// when first touched.
constexpr uint64_t kFaultAround = 64 << 10;
// Reads shorter than this in all are done on the calling thread: a thread costs more.
constexpr uint64_t kThreadedReadBytes = 4 << 20;
// Where unmapped tensors start: enough for any element type and for vector loads.
constexpr uint64_t kReadAlignment = 64;

uint64_t RoundDown(uint64_t x, uint64_t to) { return x - x % to; }
uint64_t RoundUp(uint64_t x, uint64_t to) { return RoundDown(x + to - 1, to); }

// The size of the pages a file's large folios can be mapped with (PMD), for alignment only.
uint64_t HugePageSize(uint64_t page) {
  uint64_t size = 2 << 20;
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", "r")) {
    unsigned long long value = 0;
    if (std::fscanf(f, "%llu", &value) == 1 && value >= page && value % page == 0) size = value;
    std::fclose(f);
  }
  return size;
}

// SIZE bytes of anonymous private memory (pages appear zero-filled when touched) whose
// address is a multiple of ALIGNMENT; nullptr with errno on failure.
char* Reserve(uint64_t size, uint64_t alignment) {
  const uint64_t padded = size + alignment;
  void* raw = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uint64_t at = reinterpret_cast<uint64_t>(raw);
  const uint64_t aligned = RoundUp(at, alignment);
  if (aligned > at) ::munmap(raw, aligned - at);
  if (at + padded > aligned + size) ::munmap(reinterpret_cast<void*>(aligned + size), at + padded - aligned - size);
  return reinterpret_cast<char*>(aligned);
}

// Runs work(0) .. work(count - 1) on up to `threads` threads, the calling one included, each
// taking the next index when it is done with one; on fewer when no thread can be had.
template <typename Work>
void ParallelFor(size_t count, size_t threads, const Work& work) {
  threads = std::min<size_t>({threads, std::max(1u, std::thread::hardware_concurrency()), count});
  std::atomic<size_t> next{0};
  auto run = [&work, &next, count] {
    for (size_t i = next++; i < count; i = next++) work(i);
  };
  std::vector<std::thread> pool;
  try {
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(run);
  } catch (const std::system_error&) {
    // No more threads to be had: those started and the calling one share the work.
  }
  run();
  for (std::thread& t : pool) t.join();
}

// A range of maps to make resident now: `huge` when its address agrees with its file offset
// modulo the huge page size, so that its whole huge pages map with one entry each.
struct PopulateRange {
  char* at = nullptr;
  uint64_t length = 0;
  bool huge = false;
};

// Maps the page-table entries of RANGES (maps of cached files) now, on a few threads: a load
// wants every byte, and these faults, split over threads, cost less than the same faults taken
// by a first touch (tests/bench/README.md, bench_python_load.py). MADV_POPULATE_READ (Linux
// 5.14+) faults pages in without breaking copy-on-write and returns an error where a touch
// would raise SIGBUS (a file truncated since it was checked). It is called on each huge page
// that can be mapped whole, and elsewhere on one page every kFaultAround bytes, since each
// fault maps that many cached pages around the faulting one. One call over a whole range would
// walk every 4 KiB page a second time in the kernel's get_user_pages loop, which costs 2-3x
// as much as the faults themselves. An older kernel refuses; the pages are then mapped when
// first touched, as without this.
void Populate(const std::vector<PopulateRange>& ranges, uint64_t page, uint64_t huge) {
  constexpr uint64_t kTask = 16 << 20;  // bytes per unit of work handed to a thread
  std::vector<PopulateRange> tasks;
  for (const PopulateRange& r : ranges)
    for (uint64_t done = 0; done < r.length; done += kTask)
      tasks.push_back({r.at + done, std::min(kTask, r.length - done), r.huge});
  ParallelFor(tasks.size(), kWorkThreads, [&](size_t i) {
    const PopulateRange& task = tasks[i];
    const auto begin = reinterpret_cast<uint64_t>(task.at), end = begin + task.length;
    for (uint64_t at = begin; at < end;) {
      // A whole huge page in one call: one entry when the file's cache holds it in one huge
      // folio (the call then steps over it at once), every page otherwise.
      const bool whole = task.huge && at % huge == 0 && end - at >= huge;
      if (::madvise(reinterpret_cast<void*>(at), whole ? huge : page, kPopulateRead) != 0) return;
      at = whole ? at + huge : RoundDown(at, kFaultAround) + kFaultAround;
    }
  });
}

// A map of part of a tensor: bytes [map_begin, map_end) from the start of the tensor's first
// page are bytes [file_offset, +map_end - map_begin) of `file`. Whole pages, so it may run
// past the piece of the tensor it is for only into the tensor's first and last pages, which
// are the tensor's own (bytes of the file outside the tensor, never part of another tensor).
struct PieceMap {
  uint32_t file = 0;
  uint64_t file_offset = 0;
  uint64_t map_begin = 0, map_end = 0;
  uint64_t tensor_begin = 0, tensor_end = 0;  // the tensor's bytes it supplies
};

// The maps worth making for tensor `t` placed at offset *lead within a page (its first
// extent's): one per extent whose file offset lies at the same offset within a page as its
// place in the tensor, covering its whole pages, when those are at least kMinMapBytes. Empty
// when the tensor is not stored as byte ranges of local files.
std::vector<PieceMap> PlanMaps(const ServedTensor& t, const SourceFiles& files, uint64_t page, uint64_t* lead) {
  std::vector<PieceMap> out;
  *lead = 0;
  const TensorEntry* stored = nullptr;
  if (RouteOf(t) != ReadRoute::kExtents || !t.Stored(&stored).ok()) return out;
  const std::vector<Extent> extents = ExtentsOf(*stored);
  if (extents.empty()) return out;
  *lead = extents[0].offset % page;
  if (*lead % Info(t.dtype).itemsize != 0) return out;  // a view must start on an element
  const uint64_t nbytes = t.nbytes();
  uint64_t at = 0;
  for (const Extent& e : extents) {
    const uint64_t begin = *lead + at, end = begin + e.length;  // from the tensor's first page
    at += e.length;
    if (begin % page != e.offset % page || files.file(e.file).local_path().empty()) continue;
    const uint64_t map_begin = begin == *lead ? 0 : RoundUp(begin, page);
    const uint64_t map_end = end == *lead + nbytes ? RoundUp(end, page) : RoundDown(end, page);
    if (map_end <= map_begin || map_end - map_begin < kMinMapBytes) continue;
    out.push_back({e.file, e.offset - (begin - map_begin), map_begin, map_end, std::max(map_begin, begin) - *lead,
                   std::min(map_end, end) - *lead});
  }
  return out;
}

class FileDescriptors {
 public:
  explicit FileDescriptors(const SourceFiles& files) : files_(files) {}
  ~FileDescriptors() {
    for (auto& [index, fd] : fds_) ::close(fd);
  }
  FileDescriptors(const FileDescriptors&) = delete;
  FileDescriptors& operator=(const FileDescriptors&) = delete;

  Status Get(uint32_t index, int* fd) {
    if (auto it = fds_.find(index); it != fds_.end()) return *fd = it->second, Status::OK();
    CKPTFS_RETURN_IF_ERROR(OpenUnchangedForMap(files_, index, fd));
    fds_[index] = *fd;
    return Status::OK();
  }

 private:
  const SourceFiles& files_;
  std::map<uint32_t, int> fds_;
};

// Adds [begin, end) of tensor `position` to the reads, unless empty.
void AddRead(size_t position, uint64_t begin, uint64_t end, std::vector<TensorRead>* reads) {
  if (end > begin) reads->push_back({position, begin, end - begin});
}

// Identity checks of a descriptor opened for mapping, in the order OpenUnchangedForMap makes them.
Status CheckIdentity(int fd, const FileIdentity& id, const std::string& name) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::FromErrno(name, "cannot stat to map", errno);
  if (st.st_dev != id.dev || st.st_ino != id.ino || !S_ISREG(st.st_mode)) return ReplacedSinceIndexed(name);
  const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  const int64_t ctime = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  if (static_cast<uint64_t>(st.st_size) != id.size || mtime != id.mtime_ns || ctime != id.ctime_ns)
    return ChangedSinceIndexed(name);
  return Status::OK();
}

}  // namespace

std::optional<Extent> MappableExtent(const ServedTensor& t, const SourceFiles& files) {
  const TensorEntry* stored = nullptr;
  if (RouteOf(t) != ReadRoute::kExtents || !t.Stored(&stored).ok()) return std::nullopt;
  const std::vector<Extent> extents = ExtentsOf(*stored);
  if (extents.size() != 1 || files.file(extents[0].file).local_path().empty()) return std::nullopt;
  return extents[0];
}

CpuPlacement PlaceOnCpu(const ServedTensor& t, const SourceFiles& files) {
  if (std::optional<Extent> extent = MappableExtent(t, files)) {
    // A view must start on an element of the type it is served as (complex128 as float64 pairs).
    const uint64_t itemsize = Info(ServedAs(t.dtype).dtype).itemsize;
    return t.nbytes() > 0 && extent->offset % itemsize == 0 ? CpuPlacement::kFileMap : CpuPlacement::kCopy;
  }
  return MappedPieceCount(t, files) > 0 ? CpuPlacement::kRegion : CpuPlacement::kCopy;
}

const char* CpuPlacementName(CpuPlacement placement) {
  switch (placement) {
    case CpuPlacement::kFileMap:
      return "file_map";
    case CpuPlacement::kRegion:
      return "region";
    case CpuPlacement::kCopy:
      break;
  }
  return "copy";
}

Status OpenUnchangedForMap(const SourceFiles& files, uint32_t index, int* fd) {
  *fd = -1;
  if (index >= files.count()) return Status::InvalidArgument("map_tensors", "source file index out of range");
  const std::string& path = files.file(index).local_path();
  const std::string& name = files.path(index);
  if (path.empty()) return Status::InvalidArgument(name, "not a local file: it cannot be mapped");
  const int opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (opened < 0) return Status::FromErrno(name, "cannot open to map", errno);
  if (Status s = CheckIdentity(opened, files.identity(index), name); !s.ok()) {
    ::close(opened);
    return s;
  }
  *fd = opened;
  return Status::OK();
}

size_t MappedPieceCount(const ServedTensor& tensor, const SourceFiles& files) {
  uint64_t lead = 0;
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return PlanMaps(tensor, files, page, &lead).size();
}

Status MapTensors(const View& view, const std::vector<size_t>& indices, TensorRegion* region) {
  const ServedTensors& tensors = view.served();
  const SourceFiles& files = *view.source().files;
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  *region = TensorRegion{};

  // Layout: a tensor with maps gets pages of its own and starts at its first extent's offset
  // within a page; the others are packed. A large one starts at its first extent's offset
  // within a huge page: the page cache holds large files in folios of up to 2 MiB, which the
  // kernel maps with one page-table entry each (one fault per 2 MiB instead of one per 64 KiB)
  // only where the address and the file offset agree modulo 2 MiB.
  const uint64_t huge = HugePageSize(page);
  std::vector<std::vector<PieceMap>> plans(indices.size());
  std::vector<uint64_t> page_starts(indices.size());
  uint64_t end = 0;
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] >= tensors.size()) return Status::InvalidArgument("map_tensors", "tensor index out of range");
    const ServedTensor t = tensors[indices[i]];
    uint64_t lead = 0;
    plans[i] = PlanMaps(t, files, page, &lead);
    uint64_t start = RoundUp(end, kReadAlignment);
    if (!plans[i].empty()) {
      const uint64_t unit = t.nbytes() >= huge ? huge : page;
      const uint64_t free_from = RoundUp(end, page);
      // Agreeing with the largest map (several maps of one tensor agree modulo a page, not
      // necessarily modulo a huge page).
      const PieceMap& largest = *std::max_element(plans[i].begin(), plans[i].end(), [](const auto& a, const auto& b) {
        return a.map_end - a.map_begin < b.map_end - b.map_begin;
      });
      const uint64_t residue = (largest.file_offset % unit + unit - largest.map_begin % unit + lead) % unit;
      start = RoundDown(free_from, unit) + residue;
      if (start < free_from) start += unit;
    }
    region->offsets.push_back(start);
    page_starts[i] = start - (plans[i].empty() ? 0 : lead);
    if (__builtin_add_overflow(start, t.nbytes(), &end) || end > (uint64_t{1} << 62))
      return Status::InvalidArgument("map_tensors", "tensors too large to map");
    if (!plans[i].empty()) end = RoundUp(end, page);
  }
  region->size = RoundUp(end, page);
  if (region->size == 0) return Status::OK();
  char* const bytes = Reserve(region->size, huge);
  if (!bytes) return Status::FromErrno("map_tensors", "cannot reserve memory", errno);
  region->base = bytes;

  FileDescriptors fds(files);
  std::vector<PopulateRange> populate;
  auto fail = [&](Status s) {
    UnmapRegion(bytes, region->size);
    *region = TensorRegion{};
    return s;
  };
  for (size_t i = 0; i < indices.size(); ++i) {
    const uint64_t nbytes = tensors[indices[i]].nbytes();
    uint64_t unread_from = 0;  // tensor bytes before this are mapped or listed to read
    for (const PieceMap& m : plans[i]) {
      if (region->maps >= kMaxMaps) break;
      int fd = -1;
      if (Status s = fds.Get(m.file, &fd); !s.ok()) return fail(s);
      char* const at = bytes + page_starts[i] + m.map_begin;
      const uint64_t length = m.map_end - m.map_begin;
      if (::mmap(at, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, static_cast<off_t>(m.file_offset)) ==
          MAP_FAILED) {
        // A file system that cannot map (or a limit reached): these bytes are read instead,
        // into anonymous memory put back where a failed MAP_FIXED may have removed it.
        const int err = errno;
        constexpr int kAnonymous = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE;
        if (::mmap(at, length, PROT_READ | PROT_WRITE, kAnonymous, -1, 0) == MAP_FAILED)
          return fail(Status::FromErrno(files.path(m.file), "cannot map", err));
        continue;
      }
      ++region->maps;
      populate.push_back({at, length, (reinterpret_cast<uint64_t>(at) - m.file_offset) % huge == 0});
      region->mapped_bytes += m.tensor_end - m.tensor_begin;
      AddRead(i, unread_from, m.tensor_begin, &region->reads);
      unread_from = m.tensor_end;
    }
    AddRead(i, unread_from, nbytes, &region->reads);
  }
  Populate(populate, page, huge);
  return Status::OK();
}

Status ReadUnmapped(const View& view, const std::vector<size_t>& indices, TensorRegion* region) {
  std::vector<const TensorRead*> order;
  uint64_t total = 0;
  for (const TensorRead& r : region->reads) {
    order.push_back(&r);
    total += r.length;
  }
  // Largest first, so that the threads finish together.
  std::sort(order.begin(), order.end(), [](const TensorRead* a, const TensorRead* b) { return a->length > b->length; });
  std::vector<Status> failures(order.size(), Status::OK());
  char* const base = static_cast<char*>(region->base);
  ParallelFor(order.size(), total >= kThreadedReadBytes ? kWorkThreads : 1, [&](size_t i) {
    const TensorRead& r = *order[i];
    failures[i] = view.ReadTensorData(indices[r.tensor], r.offset, static_cast<size_t>(r.length),
                                      base + region->offsets[r.tensor] + r.offset);
  });
  for (const Status& s : failures)
    if (!s.ok()) return s;
  return Status::OK();
}

Status LoadMapped(const View& view, const std::vector<size_t>& indices, TensorRegion* region,
                  DeviceLoadStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  Status s = MapTensors(view, indices, region);
  if (s.ok()) s = ReadUnmapped(view, indices, region);
  if (!s.ok()) {
    UnmapRegion(region->base, region->size);
    *region = TensorRegion{};
    return s;
  }
  if (!stats) return Status::OK();
  const auto& tensors = view.served();
  *stats = DeviceLoadStats{};
  stats->tensors = indices.size();
  for (size_t index : indices) stats->bytes += tensors[index].nbytes();
  for (const TensorRead& r : region->reads) {
    stats->bytes_read += r.length;
    if (RouteOf(tensors[indices[r.tensor]]) != ReadRoute::kExtents) stats->view_bytes += r.length;
  }
  stats->mapped_bytes = region->mapped_bytes;
  stats->maps = region->maps;
  stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return Status::OK();
}

Status UnmapRegion(void* base, uint64_t size) {
  if (base && ::munmap(base, size) != 0) return Status::FromErrno("map_tensors", "cannot unmap", errno);
  return Status::OK();
}

}  // namespace ckptfs
