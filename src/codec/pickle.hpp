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
#ifndef CKPTFS_CODEC_PICKLE_HPP_
#define CKPTFS_CODEC_PICKLE_HPP_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/limits.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

class PyValue;
struct PyGlobalBody;
struct PyObjectBody;
// Values point into the arena of the Pickle that owns them.
using PyRef = PyValue*;

// A dict entry (or an item set on an object by SETITEMS).
struct PyPair {
  PyRef first = nullptr;
  PyRef second = nullptr;
};

// Out-of-line parts of values (arena memory of the Pickle).
struct PyGlobalBody {
  std::string_view module, name;
};
// What most objects lack: keyword arguments (NEWOBJ_EX) and items appended or set on the
// object itself (an OrderedDict).
struct PyObjectExtra {
  PyRef kwargs = nullptr;
  PyRef* items = nullptr;
  PyPair* entries = nullptr;
  uint32_t item_count = 0, entry_count = 0;
};
struct PyObjectBody {
  PyRef callable = nullptr;
  PyRef args = nullptr;
  PyRef state = nullptr;
  PyObjectExtra* extra = nullptr;
};

// One value of a parsed pickle, read through accessors. A checkpoint's pickle makes ~13
// values per tensor and a DCP .metadata ~7 per chunk, all alive until the catalog is
// built, so a value is 16 bytes: its kind, a count and one word. Strings (copied: the
// parsed bytes need not outlive the parse), container items and object fields live out of
// line in the arena.
// An accessor that does not apply to the value's kind returns an empty result.
class PyValue {
 public:
  enum class Kind : uint8_t {
    kNone, kBool, kInt, kBigInt, kFloat, kStr, kBytes,
    kTuple, kList, kDict, kSet,
    kGlobal,      // module + name
    kObject,      // a call or instantiation that was not performed
    kPersistent,  // a persistent id (torch: storage references)
    kTaken,       // a call a PickleCallHook took over during the parse: taken() is its index
  };
  Kind kind() const { return kind_; }

  bool b() const { return (kind_ == Kind::kBool || kind_ == Kind::kInt) && word_.i != 0; }
  // kInt; kBool as 0 or 1.
  int64_t i() const { return kind_ == Kind::kInt || kind_ == Kind::kBool ? word_.i : 0; }
  double f() const { return kind_ == Kind::kFloat ? word_.f : 0.0; }
  // kStr, kBytes, kBigInt (LONG1/LONG4: "0x..." two's complement hex; protocol-0 LONG:
  // decimal); kGlobal: the module. A view into the owning Pickle's arena, valid as long as it
  // lives.
  std::string_view s() const {
    switch (kind_) {
      case Kind::kStr: case Kind::kBytes: case Kind::kBigInt: return {word_.text, count_};
      case Kind::kGlobal: return word_.global->module;
      default: return {};
    }
  }
  std::string_view name() const { return kind_ == Kind::kGlobal ? word_.global->name : std::string_view(); }
  // kTaken: the index the hook gave the call it took.
  uint64_t taken() const { return kind_ == Kind::kTaken ? static_cast<uint64_t>(word_.i) : 0; }

  // kTuple, kList, kSet; kObject: items appended to it.
  std::span<const PyRef> items() const {
    switch (kind_) {
      case Kind::kTuple: case Kind::kList: case Kind::kSet: return {word_.items, count_};
      case Kind::kObject:
        if (const PyObjectExtra* x = word_.object->extra) return {x->items, x->item_count};
        return {};
      default: return {};
    }
  }
  // kDict; kObject: items set on it.
  std::span<const PyPair> entries() const {
    if (kind_ == Kind::kDict) return {word_.entries, count_};
    if (kind_ == Kind::kObject && word_.object->extra) return {word_.object->extra->entries, word_.object->extra->entry_count};
    return {};
  }

  // kObject: callable(*args) [with kwargs], then BUILD(state). kPersistent: the pid is `args`.
  PyRef callable() const { return kind_ == Kind::kObject ? word_.object->callable : nullptr; }
  PyRef args() const {
    if (kind_ == Kind::kPersistent) return word_.pid;
    return kind_ == Kind::kObject ? word_.object->args : nullptr;
  }
  PyRef kwargs() const { return kind_ == Kind::kObject && word_.object->extra ? word_.object->extra->kwargs : nullptr; }
  PyRef state() const { return kind_ == Kind::kObject ? word_.object->state : nullptr; }

  bool IsGlobal(std::string_view module, std::string_view global_name) const {
    return kind_ == Kind::kGlobal && s() == module && name() == global_name;
  }
  // For a kObject whose callable is a kGlobal: "module.name"; otherwise "".
  std::string CallableName() const;

  // Values made outside any pickle, for readers that reinterpret part of one (a dict
  // subclass's set items walked as a dict, a retyped rebuild call). They point to what they
  // are made of, which must outlive them.
  static PyValue DictOf(std::span<const PyPair> entries) {
    PyValue v(Kind::kDict, entries.size());
    v.word_.entries = const_cast<PyPair*>(entries.data());
    return v;
  }
  static PyValue ListOf(std::span<const PyRef> items) {
    PyValue v(Kind::kList, items.size());
    v.word_.items = const_cast<PyRef*>(items.data());
    return v;
  }
  static PyValue CallOf(PyObjectBody* body) {
    PyValue v(Kind::kObject, 0);
    v.word_.object = body;
    return v;
  }
  PyValue() = default;

 private:
  friend struct PickleBuilder;  // the parser, the only writer (pickle.cpp)
  PyValue(Kind kind, size_t count) : kind_(kind), count_(static_cast<uint32_t>(count)) {}

  Kind kind_ = Kind::kNone;
  uint8_t flags_ = 0;   // the parser's (interned; kept apart by a streamed parse)
  uint32_t count_ = 0;  // string length, items or entries
  union Word {
    int64_t i;
    double f;
    const char* text;       // kStr, kBytes, kBigInt
    PyRef* items;           // kTuple, kList, kSet
    PyPair* entries;        // kDict
    PyGlobalBody* global;
    PyObjectBody* object;
    PyRef pid;              // kPersistent
  } word_{0};
};
static_assert(sizeof(PyValue) == 16, "PyValue sets a pickle's memory: keep it at 16 bytes");

// A parsed pickle. Values may be shared (memo) or even cyclic, so they live in one
// arena and are freed together; walkers must bound their own recursion. Moving a Pickle
// keeps every PyRef and string view valid.
class Pickle {
 public:
  PyRef root = nullptr;

  Pickle() = default;
  Pickle(const Pickle&) = delete;
  Pickle& operator=(const Pickle&) = delete;
  Pickle(Pickle&& other) noexcept;
  Pickle& operator=(Pickle&& other) noexcept;

  void Clear();
  // How many values the pickle made (those a hook's take-over freed included): walkers
  // bound their work by it.
  size_t value_count() const { return values_; }
  // Bytes the arenas hold (values, their items and fields, strings).
  size_t arena_bytes() const { return values_arena_.bytes() + kept_arena_.bytes(); }

 private:
  friend struct PickleBuilder;
  // 8-aligned bump-allocated memory. Blocks double from 256 bytes to 1 MiB: a DCP chunk's
  // data.pkl makes ~20 values, a million-chunk .metadata 9 million.
  class Arena {
   public:
    // Where the next allocation goes; RollBack frees everything allocated after it.
    struct Position {
      size_t blocks = 0, cursor_block = 0, left = 0, next_block = kFirstBlock, bytes = 0;
      std::byte* cursor = nullptr;
    };
    void* Allocate(size_t bytes);
    Position position() const { return {blocks_.size(), cursor_block_, left_in_block_, next_block_, bytes_, cursor_}; }
    // Whether `p` was allocated after `from` (and is still allocated).
    bool AllocatedSince(const void* p, const Position& from) const;
    // `p` as (block, offset / 8), and back: 32-bit memo entries of a streamed parse. False
    // when `p` is not in the arena.
    // `recent_only`: look in the block small allocations now come from only.
    bool Locate(const void* p, size_t* block, size_t* offset8, bool recent_only = false) const;
    void* At(size_t block, size_t offset8) const { return blocks_[block].data.get() + offset8 * 8; }
    void RollBack(const Position& to);
    // Frees `p` when it is an allocation that got a block of its own (a large array); false
    // otherwise.
    bool FreeLarge(const void* p);
    size_t bytes() const { return bytes_; }

   private:
    static constexpr size_t kFirstBlock = 256, kMaxBlock = size_t{1} << 20;
    struct Block {
      std::unique_ptr<std::byte[]> data;
      size_t size = 0;
      bool own = false;  // one large allocation's alone
    };
    std::vector<Block> blocks_;
    // Indices of blocks_ in the order of their addresses, for Locate; made again when it
    // does not list every block (blocks were added, freed or rolled back since).
    mutable std::vector<size_t> by_address_;
    size_t cursor_block_ = 0;  // the block small allocations come from (large ones get their own)
    std::byte* cursor_ = nullptr;
    size_t left_in_block_ = 0, next_block_ = kFirstBlock, bytes_ = 0;
  };
  void* Allocate(size_t bytes) { return values_arena_.Allocate(bytes); }
  // Memory that values made later may share (strings, globals, interned tuples): kept apart
  // when a hook streams the parse, so that rolling values_arena_ back never frees it.
  void* AllocateKept(size_t bytes) { return split_ ? kept_arena_.Allocate(bytes) : values_arena_.Allocate(bytes); }
  Arena values_arena_, kept_arena_;
  bool split_ = false;
  size_t values_ = 0;
};

// Streams a parse: sees every call (REDUCE, NEWOBJ...) as soon as the parse makes it, and may
// take it over, replacing it by a kTaken value. A reader that turns each tensor rebuild call
// into a catalog entry this way never holds the parsed tree of a million tensors: once a
// call is taken, the values made for its arguments alone are freed.
class PickleCallHook {
 public:
  virtual ~PickleCallHook() = default;
  // Sets *take and, when set, *index (what kTaken::taken() reports). An error ends the parse.
  virtual Status OnCall(const PyValue* call, bool* take, uint64_t* index) = 0;
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
// The same, freeing `bytes` when the parse ends (a 100 MB .metadata is not kept beside the
// values).
Status ParseOwnedPickle(std::string bytes, std::string_view where, Pickle* result,
                        uint64_t memory_limit = ReadLimits{}.pickle_memory, PickleEnd* end = nullptr);
// Where a streamed parse reads the pickle's bytes from, a window at a time (a million-tensor
// data.pkl is ~100 MB, not held whole beside what the parse makes).
struct PickleSource {
  uint64_t size = 0;
  std::function<Status(uint64_t offset, size_t length, char* out)> read;
};
// Parses the pickle in `source`, streamed through `hook`. A parse that a hook streams may
// fail where a plain one would not (a memo entry of a taken call's arguments read again, an
// object taken over then changed): a caller that gets an error parses again without the
// hook, and reports that parse's outcome.
Status ParsePickleStreamed(const PickleSource& source, std::string_view where, PickleCallHook* hook, Pickle* result,
                           uint64_t memory_limit = ReadLimits{}.pickle_memory);


}  // namespace ckptfs

#endif  // CKPTFS_CODEC_PICKLE_HPP_
