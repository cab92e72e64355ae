/* libckptfs: a small C ABI over the ckptfs core and device loader, for Python (ctypes) and
 * other languages. Every function is thread-compatible: one handle per thread, or external
 * locking. Errors: functions return NULL or -1 and ckptfs_last_error() gives the one-line
 * message of the calling thread's last failure. */
#ifndef CKPTFS_C_API_H_
#define CKPTFS_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CKPTFS_C_API_VERSION 8

typedef struct ckptfs_handle ckptfs_handle;

/* The ABI version this library implements (CKPTFS_C_API_VERSION). */
int ckptfs_api_version(void);

/* The ckptfs release this library was built as ("0.1.0": the CMake project's VERSION, which
 * the ckptfs binary, the .deb and the Python wheel also carry). Static. Since API version 3. */
const char* ckptfs_version(void);

/* Options are JSON objects whose keys are the names of ckptfs's option table (the mount's
 * -o names: ckptfs_options() lists them): a value option takes a string or a number
 * ({"shard_size": "2GiB"}, {"buffers": 8}), a switch true or false (false leaves it off, or
 * turns off one that is on by default), null stands for "not given". An unknown key or a bad
 * value is an error. */

/* Opens the view of SOURCE. OPTIONS_JSON (may be NULL) holds the source and view options,
 * as the mount and the CLI take them: {"dtype": "bf16", "root": "model", "moments": true,
 * "shard_size": "2GiB", "checksums": true, "max_pickle": "2GiB", "max_pickle_memory": "8GiB",
 * "max_header": "200MB", "max_tensors": 20000000}. NULL on error. */
ckptfs_handle* ckptfs_open(const char* source, const char* options_json);
void ckptfs_close(ckptfs_handle* handle);

size_t ckptfs_tensor_count(const ckptfs_handle* handle);

/* A JSON array, one object per tensor in catalog order: {"index", "key", "dtype" (the
 * safetensors name as served), "shape" (as served: complex128/complex32 get their real
 * view's trailing 2), "nbytes"}. Since API version 3, a tensor whose served bytes are one
 * byte range of a local source file, as stored (no conversion, no gather), also has
 * "extent": {"file" (an index into ckptfs_source_files), "offset"}: a caller may map that
 * range instead of reading it. Since API version 4, a tensor whose served bytes are several
 * such ranges, as stored (a ZeRO-3 parameter split over the ranks' files), of which
 * ckptfs_map_tensors would map some, has instead "maps": how many maps it would make.
 * Owned by the handle, valid until ckptfs_close. */
const char* ckptfs_tensor_info(ckptfs_handle* handle);

/* A JSON array, one object per source file of the view, in the order "extent" refers to:
 * {"name" (as messages name it), "local_path" ("" when the file has none), "size", "dev",
 * "ino", "mtime_ns", "ctime_ns"}: the file as it was when the handle was opened, so that a
 * caller mapping it can check it reaches the same file. Owned by the handle, valid until
 * ckptfs_close. Since API version 3. */
const char* ckptfs_source_files(ckptfs_handle* handle);

/* The checkpoint's non-tensor values as a JSON object, as metadata.json serves them (for a
 * safetensors file: its __metadata__). Owned by the handle, valid until ckptfs_close. Since
 * API version 3. */
const char* ckptfs_metadata(ckptfs_handle* handle);

/* Reads COUNT byte ranges of tensor INDEX's data as served (converted, gathered; no
 * safetensors header): range i is [OFFSETS[i], OFFSETS[i] + LENGTHS[i]), written to OUT one
 * after the other. Only the source bytes those ranges need are read (for a converted tensor,
 * the stored elements they convert from), so a slice costs its own size. Every range must
 * lie within the tensor's nbytes. Returns 0, or -1 (OUT then holds partial data). Unlike the
 * other calls, it may run on one handle from several threads at once. Since API version 3. */
int ckptfs_read_tensor(ckptfs_handle* handle, uint64_t index, size_t count, const uint64_t* offsets,
                       const uint64_t* lengths, void* out);

/* Loads COUNT tensors: tensor INDICES[i] into PTRS[i], which holds NBYTES[i] bytes (the
 * tensor's served size). BACKEND is "host" (PTRS are host memory), "cuda", "cufile" or
 * "auto" (PTRS are device memory of DEVICE). OPTIONS_JSON (may be NULL) holds the device
 * load options, as `ckptfs load` takes them: {"buffer_size": bytes or a size such as
 * "16MiB", "buffers": n, "io_threads": n, "direct_io": bool (default true), "verify": bool}.
 * Returns 0, or -1 (the destinations then hold partial data). The calling thread's current
 * CUDA device is the same afterwards, and no CUDA error ckptfs reported stays the runtime's
 * "last error". */
int ckptfs_load_into(ckptfs_handle* handle, size_t count, const uint64_t* indices, void* const* ptrs,
                     const uint64_t* nbytes, const char* backend, int device, const char* options_json);

/* ckptfs_load_into ordered after STREAM (a cudaStream_t of DEVICE, e.g. PyTorch's current
 * stream; NULL: no ordering): the load writes nothing before the work queued on STREAM when
 * it is called has completed, so destinations may come from a stream-ordered allocator.
 * Every write has completed when it returns. Since API version 2. */
int ckptfs_load_into_stream(ckptfs_handle* handle, size_t count, const uint64_t* indices, void* const* ptrs,
                            const uint64_t* nbytes, const char* backend, int device, void* stream,
                            const char* options_json);

/* JSON of the calling thread's last successful load, with the keys `ckptfs load --json`
 * prints: {"backend", "device", "tensors", "bytes", "bytes_read", "direct_bytes",
 * "view_bytes", "buffers_filled", "o_direct", "seconds", "gb_per_s", "verified"}; after
 * ckptfs_load_mapped (backend "map") also "mapped_bytes" and "maps". These keys since API
 * version 6; version 5 gives fewer, and "read_bytes" for a mapped load's "bytes_read". */
const char* ckptfs_last_load_stats(void);

/* Places COUNT tensors (INDICES into ckptfs_tensor_info) in one new region of private memory
 * and maps into it every whole page of them that is a page of a local source file at the same
 * offset within a page: private and copy-on-write (the files are never written, pages are
 * read when first touched, writes go to anonymous copies). A tensor whose byte ranges lie at
 * one offset within a page in their files (ZeRO-3 partitions of whole pages) is then the
 * files' own pages, except where two ranges meet inside a page. Ranges shorter than 64 KiB,
 * pages a file system refuses to map and pages past 8192 maps in one region are left to read.
 * Since API version 5 every mapped page is made resident before it returns, on a few
 * threads (MADV_POPULATE_READ once per huge page or fault-around window, Linux 5.14+; an
 * older kernel maps them when first touched); version 4 did so only for pages that cannot be
 * mapped with huge page-table entries. Sets *REGION and
 * *REGION_SIZE (NULL and 0 when every tensor is empty) and returns JSON: {"offsets": [tensor i
 * starts at REGION + offsets[i], aligned for its dtype], "reads": [[i, offset, length], ...]
 * (bytes of tensor i as served that no map supplies: the caller reads them with
 * ckptfs_read_tensor into their place; until then they are zero), "mapped_bytes", "maps"},
 * valid until the calling thread's next call of this function. Each file is opened by its
 * local path and must still be the file the handle indexed. The region outlives the handle;
 * release it with ckptfs_unmap(REGION, REGION_SIZE). NULL on error (nothing is left mapped).
 * Since API version 4. */
const char* ckptfs_map_tensors(ckptfs_handle* handle, size_t count, const uint64_t* indices, void** region,
                               uint64_t* region_size);

/* ckptfs_map_tensors, then the bytes no map supplies read into their places (on a few
 * threads when there are megabytes of them), so that every tensor is whole when it returns:
 * the CPU load of ckptfs.load in one call. Tensor INDICES[i] starts at *REGION + OFFSETS[i]
 * (OFFSETS holds COUNT values). Tensors without pages to map (a few elements, converted,
 * gathered) are placed in the region too and read. ckptfs_last_load_stats() then has backend
 * "map", "bytes_read" (the bytes no map supplied), "mapped_bytes" and "maps". Returns 0, or
 * -1 (nothing is left mapped). Release the region with ckptfs_unmap. Since API version 5. */
int ckptfs_load_mapped(ckptfs_handle* handle, size_t count, const uint64_t* indices, void** region,
                       uint64_t* region_size, uint64_t* offsets);

/* A JSON array parallel to ckptfs_tensor_info (entry i is of tensor i): {"itemsize" (bytes
 * per element as served), "torch_dtype" (torch's name of the served element type:
 * "bfloat16", "float8_e4m3fn"), "torch_shape" (the shape torch gives it: the served shape,
 * but for F4, whose served last dimension counts values, two to each byte torch counts;
 * since API version 8), "numpy_dtype" (numpy's name of the served element type, null where
 * numpy has none: bfloat16, float8, F4; since API version 8), "cpu": how a CPU load that
 * maps files places the tensor:
 * "file_map" (its served bytes are one range of a local file as stored, not empty and aligned
 * for its type: a view of a private map of that file), "region" (ckptfs_load_mapped maps some
 * of its pages) or "copy" (read into new memory)}. Owned by the handle, valid until
 * ckptfs_close. Since API version 6. */
const char* ckptfs_tensor_loading(ckptfs_handle* handle);

/* The tensors PATTERNS_JSON selects, as a JSON array of indices in catalog order: null (or
 * NULL) selects every tensor, a string or a list of strings the tensors whose key equals one
 * of them or matches it as a shell glob (fnmatch: "model.*"), an empty list none. A pattern
 * that matches no tensor is an error (NULL) naming it. Valid until the calling thread's next
 * call of this function. Since API version 6. */
const char* ckptfs_select(ckptfs_handle* handle, const char* patterns_json);

/* Opens source file FILE (an index into ckptfs_source_files) read-only by its local path,
 * checked to be the file the handle indexed (device, inode, regular file, size, mtime,
 * ctime): a file put in its place or rewritten since is an error naming it. Returns the
 * descriptor (close-on-exec; the caller closes it), or -1. Since API version 6. */
int ckptfs_open_source_file(ckptfs_handle* handle, uint32_t file);

/* Releases a region of ckptfs_map_tensors or ckptfs_load_mapped. 0, or -1. Since API
 * version 4. */
int ckptfs_unmap(void* region, uint64_t region_size);

/* The option table as a JSON array, one object per option: {"name", "kind" ("switch" or
 * "value"), "on_by_default", "groups", "flag" (the CLI spelling), "value_name", "help",
 * "front_ends" (those of mount, read_command, load_command, open, load_into that take it)}.
 * Static; valid while the library is loaded. */
const char* ckptfs_options(void);

/* The calling thread's last error message ("" if none). */
const char* ckptfs_last_error(void);

/* Compares every tensor of A's view with the tensor of the same key in B's, as `ckptfs diff`
 * does, and returns the result as the JSON object `ckptfs diff --json` prints (doc/CLI.md).
 * OPTIONS_JSON (may be NULL): {"atol": 0, "rtol": 0, "threads": 0}. Valid until the calling
 * thread's next call of this function; NULL on error, the message naming the side it came
 * from. Since API version 7. */
const char* ckptfs_diff(ckptfs_handle* a, ckptfs_handle* b, const char* options_json);

#ifdef __cplusplus
}
#endif

#endif /* CKPTFS_C_API_H_ */
