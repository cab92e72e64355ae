#include "remote/remote_file.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <vector>

#include "io/source_changed.hpp"
#include "remote/remote_counters.hpp"

namespace ckptfs {
namespace {

// The cache's unit. Small enough that building a catalog (a zip directory, a pickle, and
// one local header per tensor record of a torch zip: scattered small reads) fetches little;
// sequential reads fetch many blocks per request, so the unit costs no requests there.
constexpr uint64_t kBlockBytes = 64 << 10;
// One readahead request: large enough to keep a connection busy, small enough that several
// run side by side.
constexpr uint64_t kReadaheadRequestBytes = 8 << 20;
// The largest request a reader's own miss sends.
constexpr uint64_t kMaxRequestBytes = 16 << 20;
// Readahead starts once a reader has read this much contiguously (parsing a pickle or a
// header never gets there) and then fetches twice what it has read so far, up to the
// readahead option.
constexpr uint64_t kReadaheadAfterBytes = 1 << 20;

// Readahead requests in flight per source.
constexpr int kReadaheadThreads = 4;
// Consumed blocks kept (block_cache.hpp): enough for the reads the kernel has in flight
// around a sequential reader's position (a few 1 MiB requests).
constexpr uint64_t kConsumedKeepBytes = 16 << 20;

}  // namespace

RemoteContext::RemoteContext(const RemoteOptions& o)
    : options(o),
      client(o),
      // As many recycled buffers as the cache can hold blocks of, plus those in flight.
      buffers(std::make_shared<BufferPool>(kReadaheadRequestBytes,
                                           o.cache_bytes / kReadaheadRequestBytes + 2 * kReadaheadThreads)),
      cache(o.cache_bytes, kConsumedKeepBytes),
      disk_budget(o.cache_dir.empty() ? nullptr : std::make_unique<DiskCacheBudget>(o.cache_dir, o.cache_dir_bytes)),
      pool(kReadaheadThreads) {}

int64_t ParseHttpDate(const std::string& text) {
  struct tm tm {};
  const char* end = ::strptime(text.c_str(), "%a, %d %b %Y %H:%M:%S GMT", &tm);
  if (!end) return 0;
  return static_cast<int64_t>(::timegm(&tm));
}

Status HeadObject(RemoteContext& context, RemoteObject* object) {
  HttpRequest req;
  req.url = object->request_url;
  req.display = object->display;
  req.head = true;
  req.signing = object->signing;
  req.follow_redirects = object->follow_redirects;
  HttpResponse resp;
  CKPTFS_RETURN_IF_ERROR(context.client.Send(req, &resp));
  if (resp.status == 404 || resp.status == 410) return Status::FromErrno(object->display, "cannot open (HTTP 404)", ENOENT);
  if (resp.status == 401 || resp.status == 403)
    return Status::FromErrno(object->display,
                             "access denied (HTTP " + std::to_string(resp.status) +
                                 (object->signing ? "): check the AWS credentials and region" : ")"),
                             EACCES);
  if (resp.status != 200)
    return Status::FromErrno(object->display, "cannot open (HTTP " + std::to_string(resp.status) + ")", EIO);
  if (resp.content_length < 0)
    return Status::NotSupported(object->display, "the server does not say the object's size (no Content-Length)");
  object->identity = FileIdentity{};
  object->identity.size = static_cast<uint64_t>(resp.content_length);
  object->identity.mtime_ns = ParseHttpDate(resp.last_modified) * 1000000000;
  object->identity.version = resp.etag;
  return Status::OK();
}

struct RemoteFile::State {
  std::shared_ptr<RemoteContext> context;
  RemoteObject object;
  uint64_t id = 0;  // the object's key in the shared BlockCache
  std::unique_ptr<DiskCache> disk;
  std::mutex change_mu;
  std::atomic<bool> changed{false};
  Status change;  // set once, under change_mu, before `changed`

  std::mutex readahead_mu;
  uint64_t next_expected = UINT64_MAX;  // where a sequential reader reads next
  uint64_t run_bytes = 0;               // what it has read in order so far
  uint64_t prefetched_until = 0;

  uint64_t size() const { return object.identity.size; }
  uint64_t block_count() const { return (size() + kBlockBytes - 1) / kBlockBytes; }

  // Fetches blocks [first, last] (claimed by the caller) in one request, or from the disk
  // cache, and fills them; on failure releases them.
  Status FetchRun(uint64_t first, uint64_t last) {
    const uint64_t offset = first * kBlockBytes;
    const uint64_t end = std::min(size(), (last + 1) * kBlockBytes);
    // Written here, then shared read-only by the blocks that slice it.
    std::shared_ptr<FetchBuffer> buffer = context->buffers->Get(end - offset);
    Status s;
    if (changed.load()) {
      s = change;
    } else if (disk && disk->TryRead(first, last, offset, buffer->size(), buffer->data())) {
      CountDiskCacheBytes(buffer->size());
    } else {
      HttpRequest req;
      req.url = object.request_url;
      req.display = object.display;
      req.ranged = true;
      req.offset = offset;
      req.length = buffer->size();
      req.object_size = size();
      req.out = buffer->data();
      req.if_match = object.identity.version;
      req.signing = object.signing;
      req.follow_redirects = object.follow_redirects;
      HttpResponse resp;
      s = context->client.Send(req, &resp);
      if (s.code() == Status::Code::kSourceChanged) {
        std::lock_guard<std::mutex> lock(change_mu);
        if (!changed.load()) {
          change = s;
          changed.store(true);
        }
      }
      if (s.ok() && disk) disk->Write(offset, buffer->size(), buffer->data(), first, last);
    }
    if (!s.ok()) {
      for (uint64_t b = first; b <= last; ++b) context->cache.Fail(id, b);
      return s;
    }
    std::vector<BlockCache::Block> blocks;
    blocks.reserve(last - first + 1);
    for (uint64_t b = first; b <= last; ++b) {
      const uint64_t block_offset = b * kBlockBytes - offset;
      const uint64_t block_end = std::min<uint64_t>(buffer->size(), block_offset + kBlockBytes);
      blocks.push_back(BlockCache::Block{buffer, block_offset, block_end - block_offset});
    }
    context->cache.FillRun(id, first, std::move(blocks));
    return s;
  }

  // Claims the absent blocks of [first, last] and fetches them in runs of at most
  // `max_request` bytes; blocks others are fetching are left to them.
  Status FetchAbsent(uint64_t first, uint64_t last, uint64_t max_request) {
    const uint64_t max_blocks = std::max<uint64_t>(1, max_request / kBlockBytes);
    Status result;
    uint64_t run_start = 0, run_length = 0;
    auto flush = [&] {
      if (run_length == 0) return;
      Status s = FetchRun(run_start, run_start + run_length - 1);
      if (result.ok() && !s.ok()) result = s;
      run_length = 0;
    };
    for (uint64_t b = first; b <= last; ++b) {
      BlockCache::Block unused;
      if (context->cache.Find(id, b, /*claim=*/true, &unused) == BlockCache::Lookup::kClaimed) {
        if (run_length == 0) run_start = b;
        ++run_length;
        if (run_length == max_blocks) flush();
      } else {
        flush();
      }
    }
    flush();
    return result;
  }

  // Called by each read: when reads follow each other, fetch ahead of them in parallel
  // requests, doubling the distance up to the readahead option. Returns whether the read
  // continues a sequential stream (whose blocks are consumed once read to their end).
  bool MaybeReadahead(const std::shared_ptr<State>& self, uint64_t offset, uint64_t length) {
    const uint64_t end = offset + length;
    const uint64_t max_window =
        std::min(context->options.readahead_bytes, context->cache.capacity() / 2);
    uint64_t start = 0, stop = 0;
    {
      std::lock_guard<std::mutex> lock(readahead_mu);
      // The kernel's readahead and a multi-threaded daemon deliver a sequential reader's
      // requests out of order (several 1 MiB requests in flight at once): a read anywhere
      // from a little behind where the reader got to, up to just past what was prefetched,
      // continues the stream. Scattered small reads (a torch zip's local headers, megabytes
      // apart) never add up to kReadaheadAfterBytes.
      constexpr uint64_t kBehind = 16 << 20;
      constexpr uint64_t kAhead = 1 << 20;
      const bool sequential = next_expected != UINT64_MAX && offset + kBehind >= next_expected &&
                              offset <= std::max(next_expected, prefetched_until) + kAhead;
      if (!sequential) {
        run_bytes = length;
        prefetched_until = end;
        next_expected = end;
        return false;
      }
      run_bytes += length;
      next_expected = std::max(end, next_expected);
      if (run_bytes < kReadaheadAfterBytes) return false;
      if (max_window < kBlockBytes) return true;
      const uint64_t window = std::min(max_window, 2 * run_bytes);
      start = std::max(prefetched_until, next_expected);
      stop = std::min(size(), next_expected + window);
      // Top up in whole requests, not a sliver after every read.
      if (stop <= start || (stop - start < kReadaheadRequestBytes && stop != size())) return true;
      prefetched_until = stop;
    }
    // The blocks are claimed now, so a reader that gets there before the request does waits
    // for it instead of fetching the same bytes again.
    std::weak_ptr<State> weak = self;
    BlockCache* cache = &context->cache;  // outlives every job: the Env stops the pool first
    const uint64_t object_id = id;
    for (uint64_t chunk = start; chunk < stop; chunk += kReadaheadRequestBytes) {
      const uint64_t first = chunk / kBlockBytes;
      const uint64_t last = (std::min(stop, chunk + kReadaheadRequestBytes) - 1) / kBlockBytes;
      uint64_t b = first;
      while (b <= last) {
        BlockCache::Block unused;
        if (cache->Find(id, b, /*claim=*/true, &unused) != BlockCache::Lookup::kClaimed) {
          ++b;
          continue;
        }
        uint64_t run_last = b;
        while (run_last + 1 <= last &&
               cache->Find(id, run_last + 1, /*claim=*/true, &unused) == BlockCache::Lookup::kClaimed)
          ++run_last;
        context->pool.Submit([weak, cache, object_id, run_first = b, run_last](bool run) {
          auto state = run ? weak.lock() : nullptr;
          if (state) return (void)state->FetchRun(run_first, run_last);
          for (uint64_t k = run_first; k <= run_last; ++k) cache->Fail(object_id, k);
        });
        b = run_last + 1;
      }
    }
    return true;
  }
};

Status RemoteFile::Open(std::shared_ptr<RemoteContext> context, RemoteObject object, std::unique_ptr<SourceFile>* out) {
  auto state = std::make_shared<State>();
  state->id = context->next_object_id.fetch_add(1);
  if (!context->options.cache_dir.empty())
    CKPTFS_RETURN_IF_ERROR(DiskCache::Open(context->options.cache_dir, object.display, object.identity.version,
                                           object.identity.size, kBlockBytes, context->disk_budget.get(),
                                           &state->disk));
  state->context = std::move(context);
  state->object = std::move(object);
  out->reset(new RemoteFile(std::move(state)));
  return Status::OK();
}

RemoteFile::~RemoteFile() = default;

const std::string& RemoteFile::name() const { return state_->object.display; }
const FileIdentity& RemoteFile::identity() const { return state_->object.identity; }

Status RemoteFile::CheckUnchanged() const {
  if (state_->changed.load()) return state_->change;
  return Status::OK();
}

Status RemoteFile::Read(uint64_t offset, size_t length, void* out) const {
  if (length == 0) return Status::OK();
  State& st = *state_;
  if (st.changed.load()) return st.change;
  const bool streaming = st.MaybeReadahead(state_, offset, length);
  const uint64_t first = offset / kBlockBytes;
  const uint64_t last = (offset + length - 1) / kBlockBytes;
  // Fetch what nobody has or is fetching, in as few requests as possible, then collect.
  Status fetched = st.FetchAbsent(first, last, kMaxRequestBytes);
  if (!fetched.ok()) return fetched;
  char* dst = static_cast<char*>(out);
  for (uint64_t b = first; b <= last; ++b) {
    BlockCache::Block block;
    // A block another reader was fetching may fail or be evicted before we copy it: then
    // fetch it ourselves (a bounded number of times).
    bool have = false;
    for (int tries = 0; tries < 3 && !have; ++tries) {
      switch (st.context->cache.Find(st.id, b, /*claim=*/false, &block)) {
        case BlockCache::Lookup::kReady: have = true; break;
        case BlockCache::Lookup::kPending: have = st.context->cache.Wait(st.id, b, &block) == BlockCache::Lookup::kReady; break;
        default: break;
      }
      if (!have) {
        if (st.changed.load()) return st.change;
        CKPTFS_RETURN_IF_ERROR(st.FetchAbsent(b, b, kBlockBytes));
      }
    }
    if (!have) return Status::FromErrno(st.object.display, "block cache too small for concurrent readers", EIO);
    if (st.changed.load()) return st.change;
    const uint64_t block_start = b * kBlockBytes;
    const uint64_t from = std::max(offset, block_start);
    const uint64_t to = std::min<uint64_t>(offset + length, block_start + block.length);
    if (to <= from || from - block_start + (to - from) > block.length) return ShorterThanIndexed(st.object.display);
    std::memcpy(dst + (from - offset), block.data() + (from - block_start), to - from);
    if (streaming && to == block_start + block.length) st.context->cache.Consumed(st.id, b);
  }
  return Status::OK();
}

}  // namespace ckptfs
