// The model configuration of a Megatron-LM torch_dist save: the `args` Namespace that
// Megatron-LM's training loop stores in the save's common.pt, as the catalog's
// ModelDescription (Megatron's argument names; doc/MAPS.md, "model_config").
#ifndef CKPTFS_FORMAT_MEGATRON_MEGATRON_CONFIG_HPP_
#define CKPTFS_FORMAT_MEGATRON_MEGATRON_CONFIG_HPP_

#include <string>

#include "ckptfs/catalog.hpp"
#include "ckptfs/source.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// When folder `dir` (a DCP save) holds common.pt whose "args" is an argparse.Namespace,
// and the catalog has no configuration yet (a framework's own config file comes first), sets
// catalog->model's facts (the model's fields of the args) and source ("common.pt args"). A
// common.pt without args leaves the catalog as it is; one that cannot be read is noted in
// model->error (a map then finds no config and says so) rather than failing the checkpoint,
// whose tensors do not depend on it.
void AddMegatronModelConfig(const std::string& dir, const ReadLimits& limits, Catalog* catalog);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_MEGATRON_MEGATRON_CONFIG_HPP_
