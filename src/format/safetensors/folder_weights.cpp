#include "format/safetensors/folder_weights.hpp"

#include <algorithm>
#include <set>

namespace ckptfs {
namespace {

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// `name` is STEM + EXT, or STEM_<digits> + EXT when `numbered` allows it (accelerate names the
// second and later optimizers, schedulers, ... of a save_state by their position).
bool IsNumbered(std::string_view name, std::string_view stem, std::string_view ext, bool bare_allowed = true) {
  if (name.size() < stem.size() + ext.size() || name.substr(0, stem.size()) != stem || !EndsWith(name, ext))
    return false;
  std::string_view middle = name.substr(stem.size(), name.size() - stem.size() - ext.size());
  if (middle.empty()) return bare_allowed;
  if (middle.size() < 2 || middle[0] != '_') return false;
  return std::all_of(middle.begin() + 1, middle.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// transformers' from_pretrained tries these in this order in a local folder (the safetensors
// file, its index, the torch file, its index); the first that exists is the model.
constexpr std::string_view kTransformersWeights[] = {"model.safetensors", "model.safetensors.index.json",
                                                     "pytorch_model.bin", "pytorch_model.bin.index.json"};
// PEFT's save_pretrained writes an adapter under these names (its loader prefers the first).
constexpr std::string_view kPeftWeights[] = {"adapter_model.safetensors", "adapter_model.bin"};

}  // namespace

bool IsWeightIndexName(std::string_view name) {
  return EndsWith(name, ".safetensors.index.json") || EndsWith(name, ".bin.index.json");
}

bool IsWeightFileSuffix(std::string_view name) {
  return EndsWith(name, ".safetensors") || EndsWith(name, ".bin") || EndsWith(name, ".pt") || EndsWith(name, ".pth");
}

std::string KnownFrameworkFile(std::string_view name) {
  // transformers' Trainer (trainer.py: OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME,
  // TRAINING_ARGS_NAME, TRAINER_STATE_NAME, rng_state[_<rank>].pth).
  if (name == "optimizer.pt") return "the Trainer's optimizer state";
  if (name == "scheduler.pt") return "the Trainer's learning-rate scheduler state";
  if (name == "scaler.pt") return "a gradient scaler's state (Trainer, accelerate)";
  if (IsNumbered(name, "rng_state", ".pth")) return "the Trainer's random number generator states";
  if (name == "training_args.bin") return "the Trainer's TrainingArguments (a pickled Python object)";
  if (name == "trainer_state.json") return "the Trainer's state (step, log history)";
  // accelerate's save_state (checkpointing.py): optimizer[_i].bin, scheduler[_i].bin,
  // sampler[_i].bin, dl_state_dict[_i].bin, random_states_<process>.pkl,
  // custom_checkpoint_<i>.pkl, and the models after the first as model_<i>.safetensors or
  // pytorch_model_<i>.bin.
  if (IsNumbered(name, "optimizer", ".bin")) return "accelerate's optimizer state";
  if (IsNumbered(name, "scheduler", ".bin")) return "accelerate's learning-rate scheduler state";
  if (IsNumbered(name, "sampler", ".bin")) return "accelerate's data sampler state";
  if (IsNumbered(name, "dl_state_dict", ".bin")) return "accelerate's data loader state";
  if (IsNumbered(name, "random_states", ".pkl", false))
    return "accelerate's random number generator states of one process";
  if (IsNumbered(name, "custom_checkpoint", ".pkl", false))
    return "an object registered with accelerate's register_for_checkpointing";
  if (IsNumbered(name, "model", ".safetensors", false) || IsNumbered(name, "pytorch_model", ".bin", false))
    return "the weights of accelerate's second or later model (save_state of several models); "
           "give the file itself as SOURCE to read it";
  return "";
}

bool IsTrainingStateName(std::string_view name) {
  return !KnownFrameworkFile(name).empty() && !IsNumbered(name, "model", ".safetensors", false) &&
         !IsNumbered(name, "pytorch_model", ".bin", false);
}

FolderWeights ChooseFolderWeights(const std::vector<std::string>& names) {
  const std::set<std::string_view> present(names.begin(), names.end());
  FolderWeights out;
  auto take = [&](std::string_view name, std::string rule, std::string why) {
    if (IsWeightIndexName(name)) out.index = std::string(name);
    else out.files = {std::string(name)};
    out.rule = std::move(rule);
    out.file_why = std::move(why);
  };
  for (std::string_view w : kTransformersWeights)
    if (present.count(w)) {
      take(w,
           std::string(w) + ", the first of model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
                            "pytorch_model.bin.index.json present (transformers' from_pretrained order)",
           "the first of transformers' weight names present: what from_pretrained loads");
      return out;
    }
  for (std::string_view w : kPeftWeights)
    if (present.count(w)) {
      take(w, std::string(w) + ", a PEFT adapter (no transformers weight name present)", "PEFT's adapter weights");
      return out;
    }
  // Other indexes (a diffusers component's, a variant's): safetensors before torch, by name.
  for (std::string_view ext : {".safetensors.index.json", ".bin.index.json"})
    for (const std::string& n : names)
      if (EndsWith(n, ext)) {
        take(n, n + ", a weight index (no transformers or PEFT weight name present)",
             "the weight index read (no transformers or PEFT weight name present)");
        return out;
      }
  for (const std::string& n : names)
    if (EndsWith(n, ".safetensors")) out.files.push_back(n);
  if (!out.files.empty()) {
    out.rule = "every .safetensors file (no transformers or PEFT weight name present)";
    out.file_why = "a .safetensors file of a folder without a framework's weight names";
    out.by_suffix = true;
    return out;
  }
  for (const std::string& n : names)
    if (IsWeightFileSuffix(n) && !IsTrainingStateName(n)) out.files.push_back(n);
  if (!out.files.empty()) {
    out.rule =
        "every .bin/.pt/.pth file that is not a Trainer's or accelerate's training state (no transformers or PEFT "
        "weight name present)";
    out.file_why = "a torch file that is not training state, in a folder without a framework's weight names";
    out.by_suffix = true;
  }
  return out;
}

}  // namespace ckptfs
