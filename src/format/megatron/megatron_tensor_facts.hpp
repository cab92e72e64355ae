// What a Megatron-core GPT checkpoint's own tensors prove about its model config: whether
// its layers have q/k norms, QKV or linear biases, a separate output layer, router expert
// biases, a SwiGLU MLP. A config written by an older Megatron-LM lacks some of these
// switches (its args predate them); the key maps need them, and the stored tensors answer
// them without doubt. A config that says otherwise than its tensors is noted, so that a map
// refuses it instead of serving a model the weights do not make.
#ifndef CKPTFS_FORMAT_MEGATRON_MEGATRON_TENSOR_FACTS_HPP_
#define CKPTFS_FORMAT_MEGATRON_MEGATRON_TENSOR_FACTS_HPP_

#include "ckptfs/catalog.hpp"

namespace ckptfs {

// For catalog->model (a description with a configuration; nothing happens without one):
// each provable boolean the config does not set becomes a fact of origin kTensors, with its
// evidence as its why; each one the config sets to the opposite of what the tensors prove
// is named in model->conflicts ({field: why}). A fact is only decided when the
// tensors it rests on are there (a q/k norm's absence proves nothing without the attention
// weights it would sit beside). doc/MAPS.md lists the facts.
void AddMegatronTensorFacts(Catalog* catalog);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_MEGATRON_MEGATRON_TENSOR_FACTS_HPP_
