// The Env seam: MemoryEnv (files, folders, replacement and removal), the local Env (the
// same identity rules on a real file system), SourceFiles over either, and the readers'
// discovery reads (sniffing, folder listings, index and `latest` files) on a MemoryEnv.
#define BOOST_TEST_MODULE env_test
#include <boost/test/unit_test.hpp>

#include <unistd.h>

#include <cstdio>
#include <thread>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/source_files.hpp"
#include "io/memory_env.hpp"
#include "test_util.hpp"

using ckptfs::Env;
using ckptfs::FolderEntry;
using ckptfs::MemoryEnv;
using ckptfs::PathType;
using ckptfs::SourceFiles;
using ckptfs::Status;
using namespace ckptfs_test;

namespace {

void CheckCode(const Status& s, Status::Code code, std::string_view expected_message) {
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(code), s.message());
  BOOST_TEST(s.message() == expected_message);
}

std::string ReadAll(const SourceFiles& files, uint32_t index) {
  std::string out(files.size(index), '\0');
  Status s = files.ReadExact(index, 0, out.size(), out.data());
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return out;
}

// A file written to a fresh temp folder and opened through Env::Local().
struct LocalFile {
  TempDir dir;
  std::string path;
  SourceFiles files;
  uint32_t index = 0;
  LocalFile(std::string_view name, std::string_view bytes) : path(dir.File(name)) {
    WriteFile(path, bytes);
    Status s = files.Add(path, &index);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  }
};

std::vector<std::string> Names(const std::vector<FolderEntry>& entries) {
  std::vector<std::string> names;
  for (const FolderEntry& e : entries) names.push_back(e.name);
  return names;
}

}  // namespace

// ---- MemoryEnv -------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(memory_files_read_back_and_dedupe_by_path) {
  auto env = std::make_shared<MemoryEnv>();
  BOOST_REQUIRE(env->WriteFile("/m/a.bin", "hello").ok());
  SourceFiles files(env);
  uint32_t a = 9, again = 9;
  BOOST_REQUIRE(files.Add("/m/a.bin", &a).ok());
  BOOST_REQUIRE(files.Add("/m/a.bin", &again).ok());
  BOOST_TEST(a == again);
  BOOST_TEST(files.count() == 1u);
  BOOST_TEST(files.size(a) == 5u);
  BOOST_TEST(files.file(a).local_path().empty());
  BOOST_TEST(ReadAll(files, a) == "hello");
  BOOST_TEST(files.CheckUnchanged(a).ok());
  BOOST_TEST(files.Describe(files.whole(a)) == "/m/a.bin");
  BOOST_TEST(files.Describe(ckptfs::FileWindow{a, 1, 3}) == "/m/a.bin [bytes 1..4)");
}

BOOST_AUTO_TEST_CASE(reads_past_the_end_are_corruption_with_one_message) {
  MemorySource source;
  SourceFiles files(source.env());
  uint32_t f = 0;
  BOOST_REQUIRE(files.Add(source.Write("/m/x", "0123456789"), &f).ok());
  char buf[16];
  CheckCode(files.ReadExact(f, 8, 3, buf), Status::Code::kCorruption,
            "/m/x: read of 3 bytes at offset 8 is past the end of the file (10 bytes)");
  CheckCode(files.CheckBounds(f, UINT64_MAX, 2), Status::Code::kCorruption,
            "/m/x: read of 2 bytes at offset 18446744073709551615 is past the end of the file (10 bytes)");
  BOOST_TEST(files.ReadExact(f, 10, 0, buf).ok());
}

BOOST_AUTO_TEST_CASE(replaced_memory_file_is_source_changed_and_keeps_its_bytes) {
  MemorySource source;
  SourceFiles before(source.env());
  uint32_t f = 0;
  BOOST_REQUIRE(before.Add(source.Write("/m/w.bin", "old bytes"), &f).ok());
  source.Write("/m/w.bin", "new bytes!");
  CheckCode(before.CheckUnchanged(f), Status::Code::kSourceChanged,
            "/m/w.bin: file was replaced since it was indexed");
  BOOST_TEST(ReadAll(before, f) == "old bytes");  // never the new ones
  SourceFiles after(source.env());
  BOOST_REQUIRE(after.Add("/m/w.bin", &f).ok());
  BOOST_TEST(after.CheckUnchanged(f).ok());
  BOOST_TEST(ReadAll(after, f) == "new bytes!");
}

BOOST_AUTO_TEST_CASE(removed_memory_file_is_source_changed) {
  MemorySource source;
  SourceFiles files(source.env());
  uint32_t f = 0;
  BOOST_REQUIRE(files.Add(source.Write("/m/r.bin", "abc"), &f).ok());
  BOOST_REQUIRE(source.env()->RemoveFile("/m/r.bin").ok());
  CheckCode(files.CheckUnchanged(f), Status::Code::kSourceChanged, "/m/r.bin: file was replaced since it was indexed");
  // Written again: another file under the same name.
  source.Write("/m/r.bin", "abc");
  BOOST_TEST((files.CheckUnchanged(f).code() == Status::Code::kSourceChanged));
  BOOST_TEST((source.env()->RemoveFile("/m/none").code() == Status::Code::kNotFound));
}

BOOST_AUTO_TEST_CASE(memory_folders_are_implicit_listed_sorted_and_typed) {
  MemorySource source;
  source.Write("/m/ckpt/b.bin", "b");
  source.Write("/m/ckpt/a.bin", "a");
  source.Write("/m/ckpt/global_step2/zero_pp_rank_10.pt", "z");
  source.Write("/m/ckpt/global_step2/zero_pp_rank_9.pt", "z");
  source.Write("/m/ckpt/.hidden", "h");
  source.Write("/m/ckpt2", "not in ckpt");
  BOOST_REQUIRE(source.env()->AddFolder("/m/ckpt/empty").ok());
  MemoryEnv& env = *source.env();

  std::vector<FolderEntry> entries;
  BOOST_REQUIRE(env.ListFolder("/m/ckpt", &entries).ok());
  BOOST_TEST(Names(entries) == std::vector<std::string>({".hidden", "a.bin", "b.bin", "empty", "global_step2"}),
             boost::test_tools::per_element());
  BOOST_TEST((entries[3].type == PathType::kFolder && entries[4].type == PathType::kFolder));
  BOOST_TEST((entries[1].type == PathType::kFile));
  BOOST_REQUIRE(env.ListFolder("/m/ckpt/global_step2", &entries).ok());
  BOOST_TEST(Names(entries) == std::vector<std::string>({"zero_pp_rank_10.pt", "zero_pp_rank_9.pt"}),
             boost::test_tools::per_element());
  BOOST_REQUIRE(env.ListFolder("/", &entries).ok());
  BOOST_TEST(Names(entries) == std::vector<std::string>({"m"}), boost::test_tools::per_element());
  BOOST_REQUIRE(env.ListFolder("/m/ckpt/empty", &entries).ok());
  BOOST_TEST(entries.empty());

  PathType type;
  for (const auto& [path, expected] : std::vector<std::pair<std::string, PathType>>{
           {"/m", PathType::kFolder}, {"/m/ckpt", PathType::kFolder}, {"/m/ckpt/a.bin", PathType::kFile},
           {"/m/ckpt/nothing", PathType::kMissing}, {"/m/ck", PathType::kMissing}}) {
    BOOST_REQUIRE(env.Stat(path, &type).ok());
    BOOST_TEST((type == expected), path);
  }
  BOOST_TEST((env.ListFolder("/m/nothing", &entries).code() == Status::Code::kNotFound));
  BOOST_TEST((env.ListFolder("/m/ckpt/a.bin", &entries).code() == Status::Code::kIOError));

  std::unique_ptr<ckptfs::SourceFile> file;
  CheckCode(env.Open("/m/ckpt", &file), Status::Code::kInvalidArgument, "/m/ckpt: not a regular file");
  BOOST_TEST((env.Open("/m/ckpt/nothing", &file).code() == Status::Code::kNotFound));
  BOOST_TEST((env.WriteFile("/m/ckpt", "x").code() == Status::Code::kInvalidArgument));
  BOOST_TEST((env.WriteFile("/m/ckpt/a.bin/under", "x").code() == Status::Code::kInvalidArgument));
  BOOST_TEST((env.AddFolder("/m/ckpt/a.bin").code() == Status::Code::kInvalidArgument));
}

BOOST_AUTO_TEST_CASE(read_small_file_refuses_files_over_its_limit) {
  MemorySource source;
  source.Write("/m/index.json", "0123456789");
  std::string text;
  BOOST_REQUIRE(source.env()->ReadSmallFile("/m/index.json", 10, &text).ok());
  BOOST_TEST(text == "0123456789");
  const Status s = source.env()->ReadSmallFile("/m/index.json", 9, &text, "index", "max_header");
  CheckCode(s, Status::Code::kRefused, "/m/index.json: index is 10 bytes, over the limit of 9");
  BOOST_TEST(s.limit_option() == "max_header");
}

BOOST_AUTO_TEST_CASE(memory_env_takes_concurrent_writers_and_readers) {
  MemorySource source;
  source.Write("/m/f", std::string(64, 'a'));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        if (t % 2 == 0) {
          (void)source.env()->WriteFile("/m/f", std::string(64, static_cast<char>('a' + i % 26)));
          (void)source.env()->WriteFile("/m/g" + std::to_string(t) + "/" + std::to_string(i), "x");
        } else {
          SourceFiles files(source.env());
          uint32_t f = 0;
          if (!files.Add("/m/f", &f).ok()) std::abort();
          std::string bytes(64, '\0');
          if (!files.ReadExact(f, 0, 64, bytes.data()).ok()) std::abort();
          // One write's bytes, never a mix of two.
          if (bytes != std::string(64, bytes[0])) std::abort();
          std::vector<FolderEntry> entries;
          (void)source.env()->ListFolder("/m", &entries);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  std::vector<FolderEntry> entries;
  BOOST_REQUIRE(source.env()->ListFolder("/m/g0", &entries).ok());
  BOOST_TEST(entries.size() == 200u);
}

// ---- the local Env ---------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(local_files_carry_their_path_and_identity) {
  LocalFile local("a.bin", "local bytes");
  const SourceFiles& files = local.files;
  BOOST_TEST(files.file(local.index).local_path() == local.path);
  BOOST_TEST(files.identity(local.index).ino != 0u);
  BOOST_TEST(ReadAll(files, local.index) == "local bytes");
  BOOST_TEST(files.CheckUnchanged(local.index).ok());
  uint32_t f = 0;
  CheckCode(local.files.Add(local.dir.path(), &f), Status::Code::kInvalidArgument,
            local.dir.path() + ": not a regular file");
  BOOST_TEST((local.files.Add(local.dir.File("none"), &f).code() == Status::Code::kNotFound));
}

BOOST_AUTO_TEST_CASE(local_file_replaced_by_rename_is_source_changed) {
  LocalFile local("w.bin", "old bytes");
  const SourceFiles& files = local.files;
  const uint32_t f = local.index;
  const std::string& path = local.path;
  WriteFile(local.dir.File("w.tmp"), "new bytes");
  BOOST_REQUIRE(std::rename(local.dir.File("w.tmp").c_str(), path.c_str()) == 0);
  // (The rename unlinks the old file, which changes its ctime: either message may come.)
  BOOST_TEST((files.CheckUnchanged(f).code() == Status::Code::kSourceChanged));
  BOOST_TEST(ReadAll(files, f) == "old bytes");  // the descriptor still reaches the old file

  // The device loader's descriptor must not reach the new file either.
  int fd = -1;
  bool direct = true;
  CheckCode(ckptfs::OpenLocalDescriptor(files.file(f), false, &fd, &direct), Status::Code::kSourceChanged,
            path + ": file was replaced since it was indexed");
  BOOST_TEST(fd == -1);
  BOOST_REQUIRE(::unlink(path.c_str()) == 0);
  CheckCode(ckptfs::OpenLocalDescriptor(files.file(f), false, &fd, &direct), Status::Code::kSourceChanged,
            path + ": file was removed since it was indexed");
}

BOOST_AUTO_TEST_CASE(local_file_rewritten_in_place_is_source_changed) {
  LocalFile local("w.bin", "0123456789");
  WriteFile(local.path, "01234");  // truncates the same inode
  CheckCode(local.files.CheckUnchanged(local.index), Status::Code::kSourceChanged,
            local.path + ": file changed since it was indexed (size, mtime or ctime differ)");
  char buf[10];
  CheckCode(local.files.ReadExact(local.index, 0, 10, buf), Status::Code::kSourceChanged,
            local.path + ": file is shorter than when it was indexed");
}

BOOST_AUTO_TEST_CASE(local_descriptor_of_an_unchanged_file) {
  LocalFile local("d.bin", "direct");
  int fd = -1;
  bool direct = true;
  BOOST_REQUIRE(ckptfs::OpenLocalDescriptor(local.files.file(local.index), false, &fd, &direct).ok());
  BOOST_TEST(fd >= 0);
  BOOST_TEST(!direct);
  char buf[6];
  BOOST_TEST(::pread(fd, buf, 6, 0) == 6);
  ::close(fd);

  MemorySource source;
  SourceFiles memory(source.env());
  uint32_t f = 0;
  BOOST_REQUIRE(memory.Add(source.Write("/m/x", "x"), &f).ok());
  CheckCode(ckptfs::OpenLocalDescriptor(memory.file(f), true, &fd, &direct), Status::Code::kInvalidArgument,
            "/m/x: not a local file");
}

BOOST_AUTO_TEST_CASE(local_stat_and_listing) {
  TempDir dir;
  WriteFile(dir.File("b"), "");
  WriteFile(dir.File("a"), "");
  std::filesystem::create_directory(dir.File("sub"));
  std::filesystem::create_symlink(dir.File("a"), dir.File("link"));
  Env& env = *Env::Local();
  std::vector<FolderEntry> entries;
  BOOST_REQUIRE(env.ListFolder(dir.path(), &entries).ok());
  BOOST_TEST(Names(entries) == std::vector<std::string>({"a", "b", "link", "sub"}), boost::test_tools::per_element());
  BOOST_TEST((entries[2].type == PathType::kFile));  // a link counts as what it points to
  BOOST_TEST((entries[3].type == PathType::kFolder));
  PathType type;
  BOOST_REQUIRE(env.Stat(dir.File("none"), &type).ok());
  BOOST_TEST((type == PathType::kMissing));
  BOOST_REQUIRE(env.Stat(dir.path(), &type).ok());
  BOOST_TEST((type == PathType::kFolder));
}

// ---- discovery reads on a MemoryEnv ----------------------------------------------------------

BOOST_AUTO_TEST_CASE(sharded_folder_with_an_index_reads_from_memory) {
  MemorySource source;
  source.Write("/m/model/model-1.safetensors",
               SafetensorsBytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "xy"));
  source.Write("/m/model/model-2.safetensors",
               SafetensorsBytes(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "z"));
  const std::string index =
      R"({"metadata":{"total_size":3},"weight_map":{"a":"model-1.safetensors","b":"model-2.safetensors"}})";
  source.Write("/m/model/model.safetensors.index.json", index);
  source.Write("/m/model/config.json", "{}");
  source.Write("/m/model/.cache", "hidden");
  BOOST_REQUIRE(source.env()->AddFolder("/m/model/sub").ok());
  std::shared_ptr<const ckptfs::Catalog> catalog;
  Status s = source.OpenCatalog("/m/model", &catalog);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(catalog->format == "safetensors-folder");
  BOOST_REQUIRE_EQUAL(catalog->tensors.size(), 2u);
  BOOST_REQUIRE_EQUAL(catalog->sibling_files.size(), 1u);
  BOOST_TEST(catalog->files->path(catalog->sibling_files[0]) == "/m/model/config.json");

  ckptfs::SourceOptions small = source.Options();
  small.limits.header_bytes = 20;
  s = ckptfs::OpenCatalog("/m/model", small, &catalog);
  BOOST_TEST(StartsWith(s.message(), "/m/model/model.safetensors.index.json: index is " + std::to_string(index.size()) +
                                         " bytes, over the limit of 20"),
             s.message());
  BOOST_TEST(s.limit_option() == "max_header");
}

BOOST_AUTO_TEST_CASE(deepspeed_latest_is_read_from_memory) {
  MemorySource source;
  source.Write("/m/ds/latest", "global_step9\n");
  source.Write("/m/ds/global_step1/mp_rank_00_model_states.pt", "");
  std::shared_ptr<const ckptfs::Catalog> catalog;
  CheckCode(source.OpenCatalog("/m/ds", &catalog), Status::Code::kNotFound,
            "/m/ds/global_step9: the tag named by 'latest' does not exist");
  source.Write("/m/ds/latest", "..");
  CheckCode(source.OpenCatalog("/m/ds", &catalog), Status::Code::kCorruption,
            "/m/ds/latest: does not name a checkpoint tag");
}

BOOST_AUTO_TEST_CASE(missing_and_unrecognized_sources_in_memory) {
  MemorySource source;
  std::shared_ptr<const ckptfs::Catalog> catalog;
  CheckCode(source.OpenCatalog("/m/none.pt", &catalog), Status::Code::kNotFound,
            "/m/none.pt: cannot access: No such file or directory");
  source.Write("/m/odd.bin", "just text");
  CheckCode(source.OpenCatalog("/m/odd.bin", &catalog), Status::Code::kInvalidArgument,
            "/m/odd.bin: not a recognized checkpoint (expected a torch zip or safetensors file)");
}

// What each Env says of itself, so that nothing above it tests which kind it is.
BOOST_AUTO_TEST_CASE(envs_describe_themselves) {
  const std::shared_ptr<Env> local = Env::Local();
  BOOST_TEST(local->traits().local_files);
  BOOST_TEST(local->traits().push_ahead);
  ckptfs::FetchCounters counters;
  BOOST_TEST(!local->fetch_counters(&counters));
  char cwd[4096];
  BOOST_REQUIRE(::getcwd(cwd, sizeof cwd) != nullptr);
  BOOST_TEST(local->CanonicalName(".") == std::string(cwd));
  BOOST_TEST(local->CanonicalName("/no/such/path") == "/no/such/path");
  MemoryEnv memory;
  BOOST_TEST(!memory.traits().local_files);
  BOOST_TEST(!memory.traits().push_ahead);
  BOOST_TEST(memory.CanonicalName("m/x.pt") == "m/x.pt");
  BOOST_TEST(!memory.fetch_counters(&counters));
}
