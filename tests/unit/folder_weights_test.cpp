// Which files of a folder are its weights (src/format/safetensors/folder_weights.hpp), by name alone: the
// file lists of the folders transformers' Trainer, save_pretrained, accelerate's save_state
// and PEFT write, and the orders and exclusions doc/FORMATS.md ("Checkpoint folders") states.
#define BOOST_TEST_MODULE folder_weights_test
#include <boost/test/unit_test.hpp>

#include <string>
#include <vector>

#include "format/safetensors/folder_weights.hpp"

using ckptfs::ChooseFolderWeights;
using ckptfs::FolderWeights;
using Names = std::vector<std::string>;

BOOST_AUTO_TEST_CASE(trainer_checkpoint_with_bin_weights_takes_only_the_model_file) {
  const FolderWeights w = ChooseFolderWeights({"config.json", "generation_config.json", "optimizer.pt",
                                               "pytorch_model.bin", "rng_state.pth", "scheduler.pt",
                                               "trainer_state.json", "training_args.bin"});
  BOOST_TEST(w.index.empty());
  BOOST_TEST(w.files == Names{"pytorch_model.bin"});
  BOOST_TEST(!w.by_suffix);
}

BOOST_AUTO_TEST_CASE(transformers_order_single_file_before_its_index_safetensors_before_torch) {
  BOOST_TEST(ChooseFolderWeights({"model.safetensors", "model.safetensors.index.json", "model-00001-of-00002.safetensors"})
                 .files == Names{"model.safetensors"});
  BOOST_TEST(ChooseFolderWeights({"pytorch_model.bin", "model.safetensors.index.json"}).index ==
             "model.safetensors.index.json");
  BOOST_TEST(ChooseFolderWeights({"pytorch_model.bin.index.json", "pytorch_model.bin"}).files ==
             Names{"pytorch_model.bin"});
  BOOST_TEST(ChooseFolderWeights({"pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin"}).index ==
             "pytorch_model.bin.index.json");
}

BOOST_AUTO_TEST_CASE(peft_adapter_safetensors_before_bin_after_the_model_names) {
  BOOST_TEST(ChooseFolderWeights({"adapter_config.json", "adapter_model.bin", "adapter_model.safetensors"}).files ==
             Names{"adapter_model.safetensors"});
  BOOST_TEST(ChooseFolderWeights({"adapter_model.bin", "optimizer.pt"}).files == Names{"adapter_model.bin"});
  BOOST_TEST(ChooseFolderWeights({"adapter_model.safetensors", "model.safetensors"}).files == Names{"model.safetensors"});
}

BOOST_AUTO_TEST_CASE(accelerate_save_state_takes_the_first_model_only) {
  const FolderWeights w = ChooseFolderWeights({"custom_checkpoint_0.pkl", "model.safetensors", "model_1.safetensors",
                                               "optimizer.bin", "optimizer_1.bin", "random_states_0.pkl",
                                               "scheduler.bin"});
  BOOST_TEST(w.files == Names{"model.safetensors"});
  BOOST_TEST(ChooseFolderWeights({"optimizer.bin", "pytorch_model.bin", "pytorch_model_1.bin", "sampler.bin"}).files ==
             Names{"pytorch_model.bin"});
}

BOOST_AUTO_TEST_CASE(other_indexes_then_safetensors_files_then_torch_files) {
  BOOST_TEST(ChooseFolderWeights({"diffusion_pytorch_model.bin.index.json",
                                  "diffusion_pytorch_model.safetensors.index.json", "x.safetensors"})
                 .index == "diffusion_pytorch_model.safetensors.index.json");
  const FolderWeights st = ChooseFolderWeights({"a.safetensors", "b.pt", "c.safetensors"});
  BOOST_TEST(st.files == (Names{"a.safetensors", "c.safetensors"}));
  BOOST_TEST(st.by_suffix);
  const FolderWeights pt =
      ChooseFolderWeights({"epoch.pt", "optimizer.pt", "optimizer_2.bin", "pytorch_model_fsdp.bin", "rng_state_3.pth",
                           "scaler.pt", "scheduler.bin", "dl_state_dict.bin", "training_args.bin", "notes.txt"});
  BOOST_TEST(pt.files == (Names{"epoch.pt", "pytorch_model_fsdp.bin"}));
  BOOST_TEST(pt.by_suffix);
}

BOOST_AUTO_TEST_CASE(training_state_alone_is_no_weights) {
  const FolderWeights w = ChooseFolderWeights(
      {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json", "scaler.pt"});
  BOOST_TEST(w.index.empty());
  BOOST_TEST(w.files.empty());
  BOOST_TEST(w.rule.empty());
}

BOOST_AUTO_TEST_CASE(names_of_training_state_are_exact) {
  using ckptfs::IsTrainingStateName;
  using ckptfs::KnownFrameworkFile;
  for (const char* n : {"optimizer.pt", "optimizer.bin", "optimizer_12.bin", "rng_state.pth", "rng_state_0.pth",
                        "random_states_3.pkl", "custom_checkpoint_0.pkl", "sampler_1.bin", "dl_state_dict_2.bin"})
    BOOST_TEST(IsTrainingStateName(n), n);
  for (const char* n : {"optimizer_.bin", "optimizer_x.bin", "rng_state_1a.pth", "random_states.pkl", "my_optimizer.pt",
                        "optimizer.pth", "model_1.safetensors", "pytorch_model_2.bin", "pytorch_model.bin"})
    BOOST_TEST(!IsTrainingStateName(n), n);
  BOOST_TEST(!KnownFrameworkFile("model_1.safetensors").empty());
  BOOST_TEST(KnownFrameworkFile("model_one.safetensors").empty());
  BOOST_TEST(KnownFrameworkFile("config.json").empty());
}
