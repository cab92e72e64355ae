// The parts of remote sources that need no server (tests/remote runs real ones): S3 listing
// and error documents, the URL checks and encodings, HTTP dates, EnvForSource's choice, the
// block cache's claims, waits and eviction, and the disk cache's keys.
#define BOOST_TEST_MODULE remote_test
#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "ckptfs/remote.hpp"
#include "remote/block_cache.hpp"
#include "remote/disk_cache.hpp"
#include "remote/disk_cache_budget.hpp"
#include "remote/remote_file.hpp"
#include "remote/s3_listing.hpp"
#include "remote/url.hpp"

using namespace ckptfs;

BOOST_AUTO_TEST_CASE(s3_listing_page) {
  const std::string xml =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult><Name>b</Name><Prefix>run/</Prefix>"
      "<Contents><Key>run/latest</Key><LastModified>1994-11-06T08:49:37.000Z</LastModified>"
      "<ETag>&quot;abc&quot;</ETag><Size>5</Size></Contents>"
      "<Contents><Key>run/a&amp;b.pt</Key><ETag>&#34;d&#x22;</ETag><Size>9</Size></Contents>"
      "<CommonPrefixes><Prefix>run/global_step2/</Prefix></CommonPrefixes>"
      "<IsTruncated>true</IsTruncated><NextContinuationToken>tok&lt;1</NextContinuationToken></ListBucketResult>";
  S3ListingPage page;
  BOOST_REQUIRE(ParseListObjectsV2(xml, &page));
  BOOST_REQUIRE(page.objects.size() == 2u);
  BOOST_TEST(page.objects[0].key == "run/latest");
  BOOST_TEST(page.objects[0].size == 5u);
  BOOST_TEST(page.objects[0].etag == "\"abc\"");
  BOOST_TEST(page.objects[0].last_modified == 784111777);
  BOOST_TEST(page.objects[1].key == "run/a&b.pt");
  BOOST_TEST(page.objects[1].size == 9u);
  BOOST_TEST(page.objects[1].etag == "\"d\"");
  BOOST_TEST(page.prefixes == std::vector<std::string>{"run/global_step2/"}, boost::test_tools::per_element());
  BOOST_TEST(page.truncated);
  BOOST_TEST(page.next_token == "tok<1");
  BOOST_TEST(!ParseListObjectsV2("<Error><Code>AccessDenied</Code></Error>", &page));
  BOOST_TEST(S3ErrorCode("<Error><Code>SignatureDoesNotMatch</Code><Message>x</Message></Error>") ==
             "SignatureDoesNotMatch");
  BOOST_TEST(S3ErrorCode("not xml").empty());
}

BOOST_AUTO_TEST_CASE(source_urls) {
  BOOST_TEST(IsRemoteSource("http://h/x.pt"));
  BOOST_TEST(IsRemoteSource("s3://b/k"));
  BOOST_TEST(!IsRemoteSource("/data/http://x"));
  BOOST_TEST(CheckSourceUrl("https://host:8443/dir/model.safetensors.index.json").ok());
  const Status creds = CheckSourceUrl("https://me:hunter2@host/x.pt");
  BOOST_TEST(!creds.ok());
  BOOST_TEST(creds.message().find("hunter2") == std::string::npos, creds.message());
  const Status query = CheckSourceUrl("https://host/x.pt?X-Amz-Signature=abc123");
  BOOST_TEST(!query.ok());
  BOOST_TEST(query.message().find("abc123") == std::string::npos, query.message());
  BOOST_TEST(!CheckSourceUrl("http:///x.pt").ok());
  std::string bucket, key;
  BOOST_TEST(SplitS3Url("s3://bkt/a/b/", &bucket, &key));
  BOOST_TEST(bucket == "bkt");
  BOOST_TEST(key == "a/b");
  BOOST_TEST(SplitS3Url("s3://bkt", &bucket, &key));
  BOOST_TEST(key.empty());
  BOOST_TEST(!SplitS3Url("s3:///k", &bucket, &key));
  BOOST_TEST(PercentEncode("a b/c+d~", true) == "a%20b/c%2Bd~");
  BOOST_TEST(PercentEncode("a/b", false) == "a%2Fb");
  std::shared_ptr<Env> env;
  BOOST_TEST(EnvForSource("/tmp/x.pt", RemoteOptions{}, &env).ok());
  BOOST_TEST(env == Env::Local());
  BOOST_TEST(!EnvForSource("http://u:p@h/x", RemoteOptions{}, &env).ok());
  // A remote Env reads ahead itself and counts what it fetches.
  BOOST_REQUIRE(EnvForSource("http://h/x.pt", RemoteOptions{}, &env).ok());
  BOOST_TEST(!env->traits().local_files);
  BOOST_TEST(!env->traits().push_ahead);
  ckptfs::FetchCounters counters;
  BOOST_TEST(env->fetch_counters(&counters));
  BOOST_TEST(env->CanonicalName("http://h/x.pt") == "http://h/x.pt");
}

BOOST_AUTO_TEST_CASE(http_dates) {
  BOOST_TEST(ParseHttpDate("Sun, 06 Nov 1994 08:49:37 GMT") == 784111777);
  BOOST_TEST(ParseHttpDate("yesterday") == 0);
}

BOOST_AUTO_TEST_CASE(block_cache_claims_waits_and_evicts) {
  BlockCache cache(2 * 100, 100);
  BlockCache::Block block;
  BOOST_TEST((cache.Find(1, 0, true, &block) == BlockCache::Lookup::kClaimed));
  BOOST_TEST((cache.Find(1, 0, true, &block) == BlockCache::Lookup::kPending));
  // A waiter sees the block once its claimant fills it.
  std::thread waiter([&] {
    BlockCache::Block got;
    BOOST_TEST((cache.Wait(1, 0, &got) == BlockCache::Lookup::kReady));
    BOOST_TEST(got.length == 100u);
    BOOST_TEST(got.data()[0] == 'a');
  });
  auto buf = std::make_shared<FetchBuffer>(100);
  std::memset(buf->data(), 'a', 100);
  cache.Fill(1, 0, BlockCache::Block{buf, 0, 100});
  waiter.join();
  // A failed claim leaves no trace: the next reader claims it again.
  BOOST_TEST((cache.Find(1, 1, true, &block) == BlockCache::Lookup::kClaimed));
  cache.Fail(1, 1);
  BOOST_TEST((cache.Find(1, 1, false, &block) == BlockCache::Lookup::kAbsent));
  // Over capacity, the least recently used block goes.
  for (uint64_t b = 2; b <= 3; ++b) {
    BOOST_TEST((cache.Find(1, b, true, &block) == BlockCache::Lookup::kClaimed));
    cache.Fill(1, b, BlockCache::Block{buf, 0, 100});
  }
  BOOST_TEST((cache.Find(1, 0, false, &block) == BlockCache::Lookup::kAbsent));
  BOOST_TEST((cache.Find(1, 3, false, &block) == BlockCache::Lookup::kReady));
  BOOST_TEST((cache.Find(2, 3, false, &block) == BlockCache::Lookup::kAbsent));
}

BOOST_AUTO_TEST_CASE(block_cache_drops_consumed_blocks_first) {
  BlockCache cache(4 * 100, 200);
  BlockCache::Block block;
  auto buf = std::make_shared<FetchBuffer>(100);
  auto fill = [&](uint64_t b) {
    BOOST_TEST((cache.Find(1, b, true, &block) == BlockCache::Lookup::kClaimed));
    cache.Fill(1, b, BlockCache::Block{buf, 0, 100});
  };
  for (uint64_t b = 0; b <= 3; ++b) fill(b);
  // Only consumed_keep bytes of consumed blocks stay: the most recently used of them.
  cache.Consumed(1, 0);
  cache.Consumed(1, 1);
  BOOST_TEST((cache.Find(1, 0, false, &block) == BlockCache::Lookup::kReady));  // still consumed
  cache.Consumed(1, 2);
  BOOST_TEST((cache.Find(1, 1, false, &block) == BlockCache::Lookup::kAbsent));
  BOOST_TEST((cache.Find(1, 0, false, &block) == BlockCache::Lookup::kReady));
  // Over capacity, consumed blocks go before the least recently used ordinary one.
  fill(4);
  fill(5);  // 0, 2, 3, 4, 5: one over
  BOOST_TEST((cache.Find(1, 2, false, &block) == BlockCache::Lookup::kAbsent));
  BOOST_TEST((cache.Find(1, 3, false, &block) == BlockCache::Lookup::kReady));
  fill(6);  // 0 (consumed) goes before 3
  BOOST_TEST((cache.Find(1, 0, false, &block) == BlockCache::Lookup::kAbsent));
  BOOST_TEST((cache.Find(1, 3, false, &block) == BlockCache::Lookup::kReady));
  fill(7);  // then least recently used first: 4
  BOOST_TEST((cache.Find(1, 4, false, &block) == BlockCache::Lookup::kAbsent));
  BOOST_TEST((cache.Find(1, 3, false, &block) == BlockCache::Lookup::kReady));
  // Pending and absent blocks are left alone.
  BOOST_TEST((cache.Find(1, 9, true, &block) == BlockCache::Lookup::kClaimed));
  cache.Consumed(1, 9);
  cache.Consumed(1, 10);
  BOOST_TEST((cache.Find(1, 9, false, &block) == BlockCache::Lookup::kPending));
  cache.Fail(1, 9);
}

BOOST_AUTO_TEST_CASE(buffer_pool_recycles_within_its_bound) {
  auto pool = std::make_shared<BufferPool>(1000, 1);
  const char* first = nullptr;
  {
    auto a = pool->Get(1000);
    first = a->data();
    BOOST_TEST(a->size() == 1000u);
  }
  {
    auto again = pool->Get(600);  // half the pool's size or more: pooled
    BOOST_TEST(static_cast<const void*>(again->data()) == static_cast<const void*>(first));
    BOOST_TEST(again->size() == 600u);
    auto second = pool->Get(1000);  // a second buffer exists while the first is out
    BOOST_TEST(static_cast<const void*>(second->data()) != static_cast<const void*>(first));
  }
  // Small and oversized requests get buffers of their own size.
  BOOST_TEST(pool->Get(10)->capacity() == 10u);
  BOOST_TEST(pool->Get(5000)->capacity() == 5000u);
}

namespace {

std::filesystem::path FreshFolder(const char* name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("ckptfs-remote-test-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

// Block `b` of a test object: bytes that differ per object, block and position, never 0.
std::string BlockBytes(char object, uint64_t b, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(1 + (object * 31 + b * 7 + i) % 251);
  return s;
}

}  // namespace

BOOST_AUTO_TEST_CASE(disk_cache_is_keyed_by_etag) {
  const std::filesystem::path dir = FreshFolder("etag");
  const std::string data(300, 'x');
  std::string back(200, '\0');
  {
    std::unique_ptr<DiskCache> cache;
    BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"v1\"", 300, 100, nullptr, &cache).ok());
    BOOST_TEST(!cache->TryRead(0, 0, 0, 100, back.data()));
    cache->Write(100, 200, data.data(), 1, 2);
    BOOST_TEST(cache->TryRead(1, 2, 100, 200, back.data()));
    BOOST_TEST(!cache->TryRead(0, 2, 0, 300, back.data()));
  }
  {
    std::unique_ptr<DiskCache> again;
    BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"v1\"", 300, 100, nullptr, &again).ok());
    back.assign(200, '\0');
    BOOST_TEST(again->TryRead(1, 2, 100, 200, back.data()));
    BOOST_TEST(back == data.substr(0, 200));
    std::unique_ptr<DiskCache> changed;
    BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"v2\"", 300, 100, nullptr, &changed).ok());
    BOOST_TEST(!changed->TryRead(1, 1, 100, 100, back.data()));
  }
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(disk_cache_budget_evicts_least_recently_used_blocks) {
  const std::filesystem::path dir = FreshFolder("lru");
  constexpr uint64_t kBlock = 4096;  // the file system's unit, so each eviction frees a block
  std::unique_ptr<DiskCache> a, b;
  BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/a", "\"1\"", 8 * kBlock, kBlock, nullptr, &a).ok());
  BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/b", "\"1\"", 8 * kBlock, kBlock, nullptr, &b).ok());
  for (uint64_t i = 0; i < 8; ++i) a->Write(i * kBlock, kBlock, BlockBytes('a', i, kBlock).data(), i, i);
  for (uint64_t i = 0; i < 8; ++i) b->Write(i * kBlock, kBlock, BlockBytes('b', i, kBlock).data(), i, i);
  std::string back(4 * kBlock, '\0');
  BOOST_REQUIRE(a->TryRead(0, 3, 0, 4 * kBlock, back.data()));  // a's first half: used last
  const uint64_t before = DiskCacheBudget::Measure(dir.string());
  BOOST_TEST(before >= 16 * kBlock);
  // Over a bound of 14 blocks' worth: down to three quarters of it, oldest first.
  DiskCacheBudget budget(dir.string(), before - 2 * kBlock);
  const uint64_t after = budget.EvictNow();
  BOOST_TEST(after <= (before - 2 * kBlock) * 3 / 4);
  BOOST_TEST(after == DiskCacheBudget::Measure(dir.string()));
  auto present = [&](DiskCache& c, char object, uint64_t i) {
    std::string one(kBlock, '\0');
    if (!c.TryRead(i, i, i * kBlock, kBlock, one.data())) return false;
    BOOST_TEST((one == BlockBytes(object, i, kBlock)));
    return true;
  };
  for (uint64_t i = 4; i < 8; ++i) BOOST_TEST(!present(*a, 'a', i));  // written first, never read
  for (uint64_t i = 0; i < 4; ++i) BOOST_TEST(present(*a, 'a', i));   // read last
  BOOST_TEST(present(*b, 'b', 7));                                     // written last
  BOOST_TEST(!present(*b, 'b', 0));
  // Unbounded: nothing goes.
  DiskCacheBudget unbounded(dir.string(), 0);
  BOOST_TEST(unbounded.EvictNow() == DiskCacheBudget::Measure(dir.string()));
  BOOST_TEST(present(*b, 'b', 7));
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(disk_cache_budget_removes_emptied_objects_nobody_has_open) {
  const std::filesystem::path dir = FreshFolder("remove");
  constexpr uint64_t kBlock = 4096;
  auto files = [&] {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.path().extension() == ".data";
    return n;
  };
  {
    std::unique_ptr<DiskCache> gone;
    BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/gone", "\"1\"", 4 * kBlock, kBlock, nullptr, &gone).ok());
    for (uint64_t i = 0; i < 4; ++i) gone->Write(i * kBlock, kBlock, BlockBytes('g', i, kBlock).data(), i, i);
  }
  std::unique_ptr<DiskCache> open;
  BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/open", "\"1\"", 4 * kBlock, kBlock, nullptr, &open).ok());
  for (uint64_t i = 0; i < 4; ++i) open->Write(i * kBlock, kBlock, BlockBytes('o', i, kBlock).data(), i, i);
  BOOST_TEST(files() == 2u);
  DiskCacheBudget tiny(dir.string(), 1);  // evicts every block
  tiny.EvictNow();
  BOOST_TEST(files() == 1u);  // the open object keeps its (empty) files
  std::string one(kBlock, '\0');
  BOOST_TEST(!open->TryRead(0, 0, 0, kBlock, one.data()));
  open->Write(0, kBlock, BlockBytes('o', 0, kBlock).data(), 0, 0);  // and can be filled again
  BOOST_TEST(open->TryRead(0, 0, 0, kBlock, one.data()));
  BOOST_TEST((one == BlockBytes('o', 0, kBlock)));
  std::filesystem::remove_all(dir);
}

// Two opens of one object (as two mounts sharing the folder have) write and read while a
// third evicts with a bound smaller than one block: a read either misses or returns the
// block's bytes, never a hole or part of one.
BOOST_AUTO_TEST_CASE(disk_cache_never_serves_an_evicted_block) {
  const std::filesystem::path dir = FreshFolder("race");
  constexpr uint64_t kBlock = 64 << 10, kBlocks = 16;
  std::unique_ptr<DiskCache> one, two;
  BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"1\"", kBlocks * kBlock, kBlock, nullptr, &one).ok());
  BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"1\"", kBlocks * kBlock, kBlock, nullptr, &two).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> hits{0}, wrong{0};
  auto user = [&](DiskCache* cache, uint64_t seed) {
    std::string back(2 * kBlock, '\0');
    for (uint64_t round = 0; !stop.load(); ++round) {
      const uint64_t b = (round * 5 + seed) % (kBlocks - 1);
      const std::string run = BlockBytes('o', b, kBlock) + BlockBytes('o', b + 1, kBlock);
      auto read = [&] {
        if (!cache->TryRead(b, b + 1, b * kBlock, 2 * kBlock, back.data())) return false;
        ++hits;
        if (back != run) ++wrong;
        return true;
      };
      // A miss writes the run and reads it straight back, so that hits happen however fast
      // the evictor empties the folder.
      if (!read()) {
        cache->Write(b * kBlock, run.size(), run.data(), b, b + 1);
        read();
      }
    }
  };
  std::thread t1(user, one.get(), 0), t2(user, two.get(), 3);
  DiskCacheBudget evictor(dir.string(), 1);
  // At least a second, and until there have been enough hits to show reads raced the
  // evictor (a slow machine, ThreadSanitizer's for one, needs longer), within a cap.
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const auto spent = std::chrono::steady_clock::now() - start;
    if ((spent > std::chrono::seconds(1) && hits.load() >= 32) || spent > std::chrono::seconds(30)) break;
    evictor.EvictNow();
  }
  stop.store(true);
  t1.join();
  t2.join();
  BOOST_TEST(hits.load() >= 32);
  BOOST_TEST_MESSAGE("hits " << hits.load());
  BOOST_TEST(wrong.load() == 0);
  std::filesystem::remove_all(dir);
}
