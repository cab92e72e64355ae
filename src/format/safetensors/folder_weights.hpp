// Which files of a checkpoint folder are its weights, by the names the frameworks that write
// such folders give them (transformers' from_pretrained, PEFT, accelerate's save_state), and
// what every other file is. Names only: nothing here reads a file.
//
// A training folder (a Trainer's checkpoint-N/, an accelerate save_state folder) holds torch
// files that are not weights (optimizer.pt, rng_state.pth, optimizer.bin, ...); taking every
// .bin/.pt as weights would serve the optimizer state inside model.safetensors. The rules, in
// the order they are tried (the first that matches chooses the weights):
//   1. model.safetensors, model.safetensors.index.json, pytorch_model.bin,
//      pytorch_model.bin.index.json: transformers' order (accelerate's load_state reads the
//      first model from model.safetensors or pytorch_model.bin too);
//   2. adapter_model.safetensors, adapter_model.bin: a PEFT adapter;
//   3. another weight index (*.safetensors.index.json, then *.bin.index.json, by name);
//   4. every .safetensors file (a folder of safetensors files);
//   5. every .bin/.pt/.pth file that is not a training-state file of a known framework.
// Every file not chosen is passed through unchanged, except weight indexes (never served: the
// mount's own model file or index stands in their place).
#ifndef CKPTFS_FORMAT_SAFETENSORS_FOLDER_WEIGHTS_HPP_
#define CKPTFS_FORMAT_SAFETENSORS_FOLDER_WEIGHTS_HPP_

#include <string>
#include <string_view>
#include <vector>

namespace ckptfs {

// What the rules chose. Exactly one of `index` and `files` is set when a rule matched.
struct FolderWeights {
  std::string index;               // the weight index whose shards are the weights
  std::vector<std::string> files;  // else the weight files, in the order they are read
  std::string rule;                // which rule chose them, in words ("" when none matched)
  std::string file_why;            // what each weight file (or the index) is, in words
  bool by_suffix = false;          // rules 4 and 5: no framework's file name matched
};

// Applies the rules to the names of a folder's regular files.
FolderWeights ChooseFolderWeights(const std::vector<std::string>& names);

bool IsWeightIndexName(std::string_view name);
// A file name that can hold weights at all (.safetensors, .bin, .pt, .pth).
bool IsWeightFileSuffix(std::string_view name);

// The framework file a name is, in words ("the Trainer's optimizer state"), when it is a
// training-state or other known non-weight file of the Trainer or accelerate; empty otherwise.
std::string KnownFrameworkFile(std::string_view name);
// True for the files KnownFrameworkFile names that are never weights (all but accelerate's
// second and later models, which are weights that no single-model loader reads).
bool IsTrainingStateName(std::string_view name);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_SAFETENSORS_FOLDER_WEIGHTS_HPP_
