// A reader of the YAML that configuration dumpers write (PyYAML's block style: what
// Megatron-Bridge's run_config.yaml, NeMo 2's context/model.yaml and NeMo-RL's config.yaml
// are), into JSON. It takes block mappings and sequences, plain, single- and double-quoted
// scalars (also folded over several lines), `[]`/`{}` flow collections of scalars on one line,
// comments and one document. Anything else (anchors, aliases, tags, block scalars `|`/`>`,
// complex keys, several documents, tabs in indentation, duplicate keys) is refused with one
// line naming the file, the line and what was met: the reader never guesses at a structure.
// Plain scalars resolve as PyYAML resolves them (YAML 1.1): null and ~, booleans (true/false,
// yes/no, on/off in their three spellings), decimal and 0x integers, floats with a dot or an
// exponent and .inf/.nan; every other plain scalar, and every quoted one, is a string.
#ifndef CKPTFS_CODEC_YAML_SUBSET_HPP_
#define CKPTFS_CODEC_YAML_SUBSET_HPP_

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/status.hpp"

namespace ckptfs {

struct YamlLimits {
  uint64_t bytes = 16u << 20;  // the text
  uint32_t depth = 64;         // nested collections
  uint64_t nodes = 1'000'000;  // scalars and collections
};

// Parses `text` (the content of file `name`, named in errors) into `*out`; an empty document
// is null.
Status ParseYamlSubset(std::string_view text, const std::string& name, nlohmann::json* out,
                       const YamlLimits& limits = YamlLimits{});

}  // namespace ckptfs

#endif  // CKPTFS_CODEC_YAML_SUBSET_HPP_
