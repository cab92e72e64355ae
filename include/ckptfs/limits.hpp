// Resource limits for reading a source's metadata.
#ifndef CKPTFS_LIMITS_HPP_
#define CKPTFS_LIMITS_HPP_

#include <cstdint>

namespace ckptfs {

// How much a reader may spend on a source's metadata. A checkpoint is untrusted input:
// these bound the memory and time reading it takes, however the file lies. Each has a mount
// option (-o NAME=VALUE) and a command-line flag (--max-... VALUE) to raise it.
struct ReadLimits {
  // max_pickle: one pickle record (a torch.save data.pkl). Real ones are a few MB.
  uint64_t pickle_bytes = uint64_t{1} << 30;
  // max_pickle_memory: what parsing one pickle may allocate (opcodes of 1-9 bytes make
  // values of 16-80 bytes). A torch.save of 1,000,000 tensors takes about 400 MB, a DCP
  // .metadata of 1,000,000 chunks about 590 MB.
  uint64_t pickle_memory = uint64_t{4} << 30;
  // max_header: a safetensors JSON header (safetensors' own MAX_HEADER_SIZE is 100 MB) or
  // a JSON index file.
  uint64_t header_bytes = 100'000'000;
  // max_tensors: tensors in one catalog (and entries in one zip directory).
  uint64_t tensors = 10'000'000;
};

}  // namespace ckptfs

#endif  // CKPTFS_LIMITS_HPP_
