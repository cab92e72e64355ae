// The parts of remote sources that need no server (tests/remote runs real ones): S3 listing
// and error documents, the URL checks and encodings, HTTP dates, EnvForSource's choice, the
// block cache's claims, waits and eviction, and the disk cache's keys.
#define BOOST_TEST_MODULE remote_test
#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>

#include "ckptfs/remote.hpp"
#include "remote/block_cache.hpp"
#include "remote/disk_cache.hpp"
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

BOOST_AUTO_TEST_CASE(disk_cache_is_keyed_by_etag) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("ckptfs-remote-test-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::string data(300, 'x');
  {
    std::unique_ptr<DiskCache> cache;
    BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"v1\"", 300, 100, &cache).ok());
    BOOST_TEST(!cache->Has(0, 0));
    cache->Write(100, 200, data.data(), 1, 2);
    BOOST_TEST(cache->Has(1, 2));
    BOOST_TEST(!cache->Has(0, 2));
  }
  {
    std::unique_ptr<DiskCache> again;
    BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"v1\"", 300, 100, &again).ok());
    BOOST_TEST(again->Has(1, 2));
    std::string back(200, '\0');
    BOOST_TEST(again->Read(100, 200, back.data()).ok());
    BOOST_TEST(back == data.substr(0, 200));
    std::unique_ptr<DiskCache> changed;
    BOOST_REQUIRE(DiskCache::Open(dir.string(), "http://h/o", "\"v2\"", 300, 100, &changed).ok());
    BOOST_TEST(!changed->Has(1, 1));
  }
  std::filesystem::remove_all(dir);
}
