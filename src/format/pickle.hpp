// A pickle reader that never executes anything.
//
// It runs the pickle virtual machine (protocols 0-5) symbolically: GLOBAL yields a
// name, REDUCE/NEWOBJ/BUILD yield an Object node that records what *would* have been
// called, with its arguments and state. Nothing is imported, called or evaluated.
// Interpreting those nodes (e.g. torch's _rebuild_tensor_v2) is the caller's job.
//
// Globals that exist to run code (os.system, subprocess.*, builtins.eval, ...) make
// the parse fail with kRefused, because no checkpoint needs them and torch.load
// without weights_only would execute them.
#ifndef CKPTFS_FORMAT_PICKLE_HPP_
#define CKPTFS_FORMAT_PICKLE_HPP_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/limits.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

struct PyValue;
// Values point into the arena of the Pickle that owns them.
using PyRef = PyValue*;

struct PyValue {
  enum class Kind {
    kNone, kBool, kInt, kBigInt, kFloat, kStr, kBytes,
    kTuple, kList, kDict, kSet,
    kGlobal,      // module + name
    kObject,      // a call or instantiation that was not performed
    kPersistent,  // a persistent id (torch: storage references)
  };
  Kind kind = Kind::kNone;

  bool b = false;
  // A checkpoint's pickle makes ~13 values per tensor, so the size of a value sets the
  // reader's peak memory: ints and floats share their slot (the kind tells which).
  union {
    int64_t i = 0;
    double f;
  };
  // kStr, kBytes, kBigInt (LONG1/LONG4: "0x..." two's complement hex; protocol-0 LONG:
  // decimal), kGlobal module. Views into
  // the owning Pickle, valid as long as it lives.
  std::string_view s;
  std::string_view name;  // kGlobal name

  std::vector<PyRef> items;                      // kTuple, kList, kSet; kObject appended items
  std::vector<std::pair<PyRef, PyRef>> entries;  // kDict; kObject set items

  // kObject: callable(*args) [with kwargs], then BUILD(state). kPersistent: pid in `args`.
  PyRef callable;
  PyRef args;
  PyRef kwargs;
  PyRef state;

  bool IsGlobal(std::string_view module, std::string_view global_name) const {
    return kind == Kind::kGlobal && s == module && name == global_name;
  }
  // For a kObject whose callable is a kGlobal: "module.name"; otherwise "".
  std::string CallableName() const;
};

// A parsed pickle. Values may be shared (memo) or even cyclic, so they live in one
// arena and are freed together; walkers must bound their own recursion. Moving a Pickle
// keeps every PyRef and string view valid.
class Pickle {
 public:
  PyRef root = nullptr;

  // A new value owned by this pickle.
  PyRef New();
  // Keeps `text` alive as long as the pickle; returns a view of the kept copy.
  std::string_view Keep(std::string text);
  // Keeps a copy of the pickle's bytes, which string values point into.
  std::string_view KeepBytes(std::string_view bytes);
  void Clear();
  // How many values the pickle made: walkers bound their work by it.
  size_t value_count() const { return values_; }

 private:
  // Chunks double from 32 to 4096 values: a ZeRO rank file's pickle makes a few hundred
  // values, a 100k-tensor state dict over a million.
  static constexpr size_t kFirstChunk = 32, kMaxChunk = 4096;
  std::vector<std::unique_ptr<PyValue[]>> chunks_;
  size_t last_chunk_size_ = 0, used_in_last_ = 0, values_ = 0;
  std::unique_ptr<char[]> bytes_;
  std::deque<std::string> kept_;
};

// Parses one pickle from `bytes`. `where` names the file in error messages. Parsing fails
// with kRefused once the values it builds would take more than `memory_limit` bytes.
// Bytes after the STOP opcode are ignored.
//
// With `end`, parsing also reports where the pickle ended: a legacy torch stream is several
// pickles in a row, read from a window of the file that may stop inside one.
struct PickleEnd {
  size_t consumed = 0;      // on success, the pickle's length up to and including STOP
  bool needs_more = false;  // on failure, whether `bytes` ended before the pickle did
};
Status ParsePickle(std::string_view bytes, std::string_view where, Pickle* result,
                   uint64_t memory_limit = ReadLimits{}.pickle_memory, PickleEnd* end = nullptr);


}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_PICKLE_HPP_
