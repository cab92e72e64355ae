// The model configuration of a Megatron-LM torch_dist save: the `args` Namespace that
// Megatron-LM's training loop stores in the save's common.pt, as the catalog metadata's
// "model_config" (Megatron's argument names; doc/MAPS.md, "model_config").
#ifndef CKPTFS_FORMAT_MEGATRON_MEGATRON_CONFIG_HPP_
#define CKPTFS_FORMAT_MEGATRON_MEGATRON_CONFIG_HPP_

#include <string>

#include "ckptfs/catalog.hpp"
#include "ckptfs/source.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// When folder `dir` (a DCP save) holds common.pt whose "args" is an argparse.Namespace,
// sets catalog->metadata's "model_config" (the model's fields of it) and
// "model_config_source" ("common.pt args"). A common.pt without args leaves the metadata
// as it is; one that cannot be read is noted in "model_config_error" (a map then finds no
// config and says so) rather than failing the checkpoint, whose tensors do not depend on it.
void AddMegatronModelConfig(const std::string& dir, const ReadLimits& limits, Catalog* catalog);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_MEGATRON_MEGATRON_CONFIG_HPP_
