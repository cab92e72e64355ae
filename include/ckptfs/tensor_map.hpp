// Loading tensors into CPU memory as private memory maps of their source files: the CPU
// load of the C API (ckptfs_load_mapped) and the Python package. A tensor is either a view
// of a map of its one file, or placed in a region composed of several maps where its bytes
// are several byte ranges (a ZeRO-3 parameter split over the rank files), or read.
#ifndef CKPTFS_TENSOR_MAP_HPP_
#define CKPTFS_TENSOR_MAP_HPP_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "ckptfs/device.hpp"
#include "ckptfs/status.hpp"
#include "ckptfs/view.hpp"

namespace ckptfs {

// Where tensor `t`'s served bytes lie when they are one byte range of a local file, as
// stored: what a caller may map instead of reading.
std::optional<Extent> MappableExtent(const ServedTensor& t, const SourceFiles& files);

// How a CPU load that maps places a tensor: the one decision between a map and a copy.
enum class CpuPlacement {
  kFileMap,  // a view of a private map of its file: one local extent, not empty, aligned for its served dtype
  kRegion,   // in a region of MapTensors, of which some pages are maps of its files
  kCopy,     // read into new memory
};
CpuPlacement PlaceOnCpu(const ServedTensor& t, const SourceFiles& files);
// "file_map", "region", "copy".
const char* CpuPlacementName(CpuPlacement placement);

// Bytes of one tensor the caller still has to read into the region ([offset, offset +
// length) of the tensor's served bytes), because no map could supply them.
struct TensorRead {
  size_t tensor = 0;  // position in the indices passed to MapTensors
  uint64_t offset = 0;
  uint64_t length = 0;
};

// One anonymous private region holding the tensors: tensor i's bytes start at
// base + offsets[i]. The caller owns it and releases it with UnmapRegion.
struct TensorRegion {
  void* base = nullptr;
  uint64_t size = 0;
  std::vector<uint64_t> offsets;
  std::vector<TensorRead> reads;
  uint64_t mapped_bytes = 0;  // tensor bytes backed by maps of source files
  size_t maps = 0;            // mmap calls made (each splits the region's mapping)
};

// Lays out tensors `indices` of `view` in one new region and maps into it, private and
// copy-on-write (the files are never written), every whole page of them that is a page of a
// local source file at the same offset within a page; `region->reads` lists the bytes left
// (their pages are zero-filled anonymous memory). A tensor whose pieces share one offset
// within a page (ZeRO-3 partitions of one flat buffer per rank) is then maps of the ranks'
// files, except the page where two pieces meet. The mapped pages are made resident before it
// returns. Each source file is opened by its local path and must still be the file the view
// indexed, else an error naming it.
Status MapTensors(const View& view, const std::vector<size_t>& indices, TensorRegion* region);

// Reads `region->reads` (of MapTensors(view, indices, region)) into their places in the
// region, on a few threads when there are megabytes of them: then every tensor is whole.
Status ReadUnmapped(const View& view, const std::vector<size_t>& indices, TensorRegion* region);

// MapTensors, then ReadUnmapped: every tensor is whole in the region when it returns. On error
// nothing is left mapped. `stats` (may be null; LoadStatsJson with kMapLoadBackend writes
// them): tensors, bytes, the bytes read because no
// map supplied them (bytes_read; view_bytes of them for tensors converted or gathered),
// mapped_bytes, maps and seconds.
Status LoadMapped(const View& view, const std::vector<size_t>& indices, TensorRegion* region,
                  DeviceLoadStats* stats = nullptr);

Status UnmapRegion(void* base, uint64_t size);

// How many maps MapTensors would make of `tensor` (0: it would read the whole tensor).
size_t MappedPieceCount(const ServedTensor& tensor, const SourceFiles& files);

// Opens source file `index` read-only by its local path, checked to be the file the view
// indexed (same device and inode, a regular file, same size, mtime and ctime): a file put in
// its place or rewritten since is a kSourceChanged error naming it, never other bytes. The
// caller closes *fd.
Status OpenUnchangedForMap(const SourceFiles& files, uint32_t index, int* fd);

}  // namespace ckptfs

#endif  // CKPTFS_TENSOR_MAP_HPP_
