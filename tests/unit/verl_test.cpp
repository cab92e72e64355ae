// The veRL reader's folder rules on an in-memory Env: which folder a run, step or actor
// folder stands for, and the refusals that come before any rank file is parsed (the rank
// files here are not torch files, so a reader that got past these rules fails on the first
// one it opens, which the messages show). Real veRL saves: tests/frameworks/test_verl.py.
#define BOOST_TEST_MODULE verl_test
#include <boost/test/unit_test.hpp>

#include "ckptfs/catalog.hpp"
#include "test_util.hpp"

using ckptfs::Status;
using namespace ckptfs_test;

BOOST_TEST_DONT_PRINT_LOG_VALUE(ckptfs::Status::Code)

namespace {

// Opens `path` of `source`: the error (the test expects one).
Status Open(const MemorySource& source, const std::string& path) {
  std::shared_ptr<const ckptfs::Catalog> catalog;
  return source.OpenCatalog(path, &catalog);
}

bool Says(const Status& s, const std::string& text) {
  const bool found = s.message().find(text) != std::string::npos;
  if (!found) BOOST_TEST_MESSAGE("message: " << s.message());
  return found;
}

// Model rank files, and the extra_state file veRL writes beside each.
void Ranks(MemorySource* source, const std::string& dir, int world, std::initializer_list<int> ranks,
           bool extra_state = true) {
  for (int r : ranks) {
    const std::string suffix = "_world_size_" + std::to_string(world) + "_rank_" + std::to_string(r) + ".pt";
    source->Write(dir + "/model" + suffix, "not a torch file");
    if (extra_state) source->Write(dir + "/extra_state" + suffix, "not a torch file");
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(missing_rank_file_is_named) {
  MemorySource source;
  Ranks(&source, "/actor", 3, {0, 2});
  Status s = Open(source, "/actor");
  BOOST_TEST(s.code() == Status::Code::kNotFound);
  BOOST_TEST(Says(s, "/actor/model_world_size_3_rank_1.pt"));
  BOOST_TEST(Says(s, "3 ranks"));
}

BOOST_AUTO_TEST_CASE(rank_files_of_two_world_sizes_are_two_saves) {
  MemorySource source;
  Ranks(&source, "/actor", 2, {0, 1});
  Ranks(&source, "/actor", 3, {0});
  Status s = Open(source, "/actor");
  BOOST_TEST(s.code() == Status::Code::kNotSupported);
  BOOST_TEST(Says(s, "world sizes 2 and 3"));
}

BOOST_AUTO_TEST_CASE(optim_files_are_not_read_without_the_option) {
  MemorySource source;
  Ranks(&source, "/actor", 2, {0, 1});
  source.Write("/actor/optim_world_size_3_rank_0.pt", "x");
  // The model's first rank file is what fails, not the optim file of another world size.
  BOOST_TEST(Says(Open(source, "/actor"), "model_world_size_2_rank_0.pt"));
}

BOOST_AUTO_TEST_CASE(fsdp_config_must_agree_with_the_rank_files) {
  MemorySource source;
  Ranks(&source, "/actor", 2, {0, 1});
  source.Write("/actor/fsdp_config.json", R"({"FSDP_version": 2, "world_size": 4})");
  Status s = Open(source, "/actor");
  BOOST_TEST(s.code() == Status::Code::kCorruption);
  BOOST_TEST(Says(s, "/actor/fsdp_config.json"));
  BOOST_TEST(Says(s, "world_size 4"));
  source.Write("/actor/fsdp_config.json", "[not json");
  BOOST_TEST(Says(Open(source, "/actor"), "not a JSON object"));
}

BOOST_AUTO_TEST_CASE(run_folder_serves_the_step_the_tracker_names) {
  MemorySource source;
  Ranks(&source, "/run/global_step_1/actor", 2, {0});  // incomplete: the error shows which step was taken
  Ranks(&source, "/run/global_step_2/actor", 2, {1});
  source.Write("/run/global_step_2/data.pt", "x");
  source.Write("/run/latest_checkpointed_iteration.txt", "1\n");
  BOOST_TEST(Says(Open(source, "/run"), "/run/global_step_1/actor/model_world_size_2_rank_1.pt"));
  source.Write("/run/latest_checkpointed_iteration.txt", "2");
  BOOST_TEST(Says(Open(source, "/run"), "/run/global_step_2/actor/model_world_size_2_rank_0.pt"));
  source.Write("/run/latest_checkpointed_iteration.txt", "7");
  Status s = Open(source, "/run");
  BOOST_TEST(s.code() == Status::Code::kNotFound);
  BOOST_TEST(Says(s, "/run/latest_checkpointed_iteration.txt"));
  BOOST_TEST(Says(s, "step 7"));
  source.Write("/run/latest_checkpointed_iteration.txt", "latest");
  BOOST_TEST(Says(Open(source, "/run"), "not a step number"));
}

BOOST_AUTO_TEST_CASE(run_folder_without_tracker_serves_the_highest_step) {
  MemorySource source;
  Ranks(&source, "/run/global_step_9/actor", 2, {1});
  Ranks(&source, "/run/global_step_10/actor", 2, {0});
  BOOST_TEST(Says(Open(source, "/run"), "/run/global_step_10/actor/model_world_size_2_rank_1.pt"));
}

BOOST_AUTO_TEST_CASE(step_folder_serves_actor_then_critic) {
  MemorySource source;
  Ranks(&source, "/step/critic", 2, {0});
  BOOST_TEST(Says(Open(source, "/step"), "/step/critic/model_world_size_2_rank_1.pt"));
  Ranks(&source, "/step/actor", 3, {0});
  BOOST_TEST(Says(Open(source, "/step"), "/step/actor/model_world_size_3_rank_1.pt"));
}

BOOST_AUTO_TEST_CASE(model_rank_files_alone_are_a_plain_rank_set) {
  MemorySource source;
  Ranks(&source, "/m", 3, {0, 2}, /*extra_state=*/false);
  BOOST_TEST(!Says(Open(source, "/m"), "the save has 3 ranks"));
  // Any of veRL's own files beside them makes the folder veRL's.
  for (const char* marker : {"/m/fsdp_config.json", "/m/huggingface/config.json", "/m/optim_world_size_3_rank_0.pt"}) {
    MemorySource with;
    Ranks(&with, "/m", 3, {0, 2}, /*extra_state=*/false);
    with.Write(marker, "{}");
    BOOST_TEST(Says(Open(with, "/m"), "the save has 3 ranks"), marker);
  }
}

BOOST_AUTO_TEST_CASE(names_that_only_resemble_rank_files_are_not_veRL) {
  MemorySource source;
  // "rank_x", a missing ".pt", a world size that is not a number: no veRL rank file.
  source.Write("/f/model_world_size_2_rank_x.pt", "x");
  source.Write("/f/model_world_size_2_rank_0.bin", "x");
  source.Write("/f/model_world_size_two_rank_0.pt", "x");
  Status s = Open(source, "/f");
  BOOST_TEST(!Says(s, "model_world_size_2_rank_1.pt"));
}
