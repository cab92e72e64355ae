#include "codec/pickle.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <new>
#include <span>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "codec/byte_reader.hpp"

namespace ckptfs {

// The only writer of values: the parser below. Values and their out-of-line parts are
// arena memory of the Pickle (nothing to destroy: every part is trivially destructible).
struct PickleBuilder {
  using K = PyValue::Kind;
  static constexpr uint8_t kInterned = 1;  // shared by the interning tables: copy before changing
  static constexpr uint8_t kKept = 2;      // in the kept arena of a split pickle (Handle looks there)

  // `keep`: in memory a streamed parse never rolls back (see Pickle::AllocateKept).
  static void* Allocate(Pickle* p, size_t bytes, bool keep) { return keep ? p->AllocateKept(bytes) : p->Allocate(bytes); }
  static PyRef NewValue(Pickle* p, K kind, bool keep = false) {
    PyRef v = new (Allocate(p, sizeof(PyValue), keep)) PyValue();
    v->kind_ = kind;
    if (keep && p->split_) v->flags_ = kKept;
    if (kind == K::kObject) v->word_.object = new (Allocate(p, sizeof(PyObjectBody), keep)) PyObjectBody();
    ++p->values_;
    return v;
  }
  // A copy of scalar `v` in kept memory.
  static PyRef KeepScalar(Pickle* p, const PyValue* v) {
    PyRef copy = NewValue(p, v->kind_, true);
    copy->word_ = v->word_;
    return copy;
  }
  static PyRef NewTaken(Pickle* p, uint64_t index) {
    PyRef v = NewValue(p, K::kTaken);
    v->word_.i = static_cast<int64_t>(index);
    return v;
  }
  // Streamed parses: the kept memory is apart from the values' (which can be rolled back).
  static void Split(Pickle* p) { p->split_ = true; }
  static bool IsSplit(const Pickle* p) { return p->split_; }
  using ArenaPosition = Pickle::Arena::Position;
  static ArenaPosition Position(const Pickle* p) { return p->values_arena_.position(); }
  static bool AllocatedSince(const Pickle* p, const void* v, const ArenaPosition& from) {
    return p->values_arena_.AllocatedSince(v, from);
  }
  static void RollBack(Pickle* p, const ArenaPosition& to) { p->values_arena_.RollBack(to); }
  // A value of a split pickle as 32 bits: which arena, block, and 8-byte offset in it.
  static constexpr uint32_t kNoHandle = 0xFFFFFFFF, kDroppedHandle = 0xFFFFFFFE;
  static constexpr size_t kHandleBlocks = 16382, kHandleOffsetBits = 17;  // blocks are at most 1 MiB
  static bool Handle(const Pickle* p, const PyValue* v, uint32_t* handle) {
    size_t block = 0, offset8 = 0;
    // The arena the value was made in (its flag says which), the block values are being made
    // in first: a memoized value is nearly always new. Then everywhere, should a value ever
    // lack its flag.
    const uint32_t made_in = (v->flags_ & kKept) ? 1 : 0;
    const Pickle::Arena* arenas[2] = {&p->values_arena_, &p->kept_arena_};
    uint32_t arena = made_in;
    if (arenas[made_in]->Locate(v, &block, &offset8, true) || arenas[made_in]->Locate(v, &block, &offset8)) {
    } else if (arenas[1 - made_in]->Locate(v, &block, &offset8)) {
      arena = 1 - made_in;
    } else {
      return false;
    }
    if (block >= kHandleBlocks || offset8 >= (size_t{1} << kHandleOffsetBits)) return false;
    *handle = arena << 31 | static_cast<uint32_t>(block) << kHandleOffsetBits | static_cast<uint32_t>(offset8);
    return true;
  }
  static PyRef FromHandle(const Pickle* p, uint32_t handle) {
    const Pickle::Arena& arena = handle >> 31 ? p->kept_arena_ : p->values_arena_;
    return static_cast<PyRef>(arena.At((handle & 0x7FFFFFFF) >> kHandleOffsetBits, handle & ((1u << kHandleOffsetBits) - 1)));
  }
  static void SetInt(PyRef v, int64_t i) { v->word_.i = i; }
  static void SetFloat(PyRef v, double f) { v->word_.f = f; }
  static void SetPid(PyRef v, PyRef pid) { v->word_.pid = pid; }
  // A scalar's payload, for comparing values by content (None's is 0).
  static uint64_t Bits(const PyValue* v) {
    uint64_t bits;
    std::memcpy(&bits, &v->word_, sizeof bits);
    return bits;
  }
  static bool Interned(const PyValue* v) { return (v->flags_ & kInterned) != 0; }
  static void SetInterned(PyRef v) { v->flags_ |= kInterned; }

  // A string value holding a copy of `text`; nullptr when `text` is 4 GiB or more (a
  // value's count is 32 bits).
  // Strings are kept: a memo entry of one made for a taken call's arguments (torch's storage
  // key) is read again by the next tensor of the storage.
  static PyRef NewText(Pickle* p, K kind, std::string_view text) {
    if (text.size() > UINT32_MAX) return nullptr;
    PyRef v = NewValue(p, kind, true);
    v->word_.text = KeepText(p, text).data();
    v->count_ = static_cast<uint32_t>(text.size());
    return v;
  }
  // A copy of `text` in the arena.
  static std::string_view KeepText(Pickle* p, std::string_view text) {
    if (text.empty()) return {};
    char* copy = static_cast<char*>(p->AllocateKept(text.size()));
    std::memcpy(copy, text.data(), text.size());
    return {copy, text.size()};
  }
  static PyRef NewGlobal(Pickle* p, std::string_view module, std::string_view name) {
    PyRef v = NewValue(p, K::kGlobal, true);
    v->word_.global = new (p->AllocateKept(sizeof(PyGlobalBody))) PyGlobalBody{KeepText(p, module), KeepText(p, name)};
    return v;
  }
  static PyRef NewTuple(Pickle* p, std::span<const PyRef> items, bool keep = false) {
    if (items.size() > UINT32_MAX) return nullptr;
    PyRef v = NewValue(p, K::kTuple, keep);
    v->word_.items = static_cast<PyRef*>(Allocate(p, items.size() * sizeof(PyRef), keep));
    std::copy(items.begin(), items.end(), v->word_.items);
    v->count_ = static_cast<uint32_t>(items.size());
    return v;
  }
  static PyObjectBody* Object(PyRef v) { return v->word_.object; }
  static PyObjectExtra* Extra(Pickle* p, PyRef v) {
    PyObjectBody* o = v->word_.object;
    if (!o->extra) o->extra = new (p->Allocate(sizeof(PyObjectExtra))) PyObjectExtra();
    return o->extra;
  }

  // Makes room for `add` more slots after the `*count` of `*slots`. Slot arrays of lists,
  // dicts and objects hold bit_ceil(count) slots, so the capacity needs no field of its own;
  // outgrown arrays stay in the arena (at most as much again). False past 2^32 slots.
  template <typename T>
  static bool Grow(Pickle* p, T** slots, uint32_t count, size_t add) {
    const size_t want = size_t{count} + add;
    if (want > UINT32_MAX) return false;
    const size_t capacity = count == 0 ? 0 : std::bit_ceil(size_t{count});
    if (want <= capacity) return true;
    T* fresh = static_cast<T*>(p->Allocate(std::bit_ceil(want) * sizeof(T)));
    if (count) std::copy(*slots, *slots + count, fresh);
    // Nothing else points at an outgrown array: a streamed parse frees a large one (the
    // million entries of a state dict outgrew 16 MB of them).
    if (count && p->split_) p->values_arena_.FreeLarge(*slots);
    *slots = fresh;
    return true;
  }
  // APPEND(S)/ADDITEMS to a list, set or object. False when `target` is none of them or
  // would pass 2^32 items.
  static bool Append(Pickle* p, PyRef target, std::span<const PyRef> values) {
    PyRef** slots;
    uint32_t* count;
    if (target->kind_ == K::kList || target->kind_ == K::kSet) {
      slots = &target->word_.items;
      count = &target->count_;
    } else if (target->kind_ == K::kObject) {
      PyObjectExtra* x = Extra(p, target);
      slots = &x->items;
      count = &x->item_count;
    } else {
      return false;
    }
    if (values.empty()) return true;
    if (!Grow(p, slots, *count, values.size())) return false;
    std::copy(values.begin(), values.end(), *slots + *count);
    *count += static_cast<uint32_t>(values.size());
    return true;
  }
  // SETITEM(S) of key, value, key, value... on a dict or object.
  static bool SetItems(Pickle* p, PyRef target, std::span<const PyRef> kv) {
    PyPair** slots;
    uint32_t* count;
    if (target->kind_ == K::kDict) {
      slots = &target->word_.entries;
      count = &target->count_;
    } else if (target->kind_ == K::kObject) {
      PyObjectExtra* x = Extra(p, target);
      slots = &x->entries;
      count = &x->entry_count;
    } else {
      return false;
    }
    const size_t pairs = kv.size() / 2;
    if (pairs == 0) return true;
    if (!Grow(p, slots, *count, pairs)) return false;
    PyPair* at = *slots + *count;
    for (size_t k = 0; k < pairs; ++k) at[k] = PyPair{kv[2 * k], kv[2 * k + 1]};
    *count += static_cast<uint32_t>(pairs);
    return true;
  }
  // An unshared copy of object `v`, its item and entry arrays copied too (appending to a
  // copy must not write into the original's spare slots).
  static PyRef CopyObject(Pickle* p, const PyValue* v) {
    PyRef copy = NewValue(p, K::kObject);
    const PyObjectBody* from = v->word_.object;
    PyObjectBody* to = copy->word_.object;
    to->callable = from->callable;
    to->args = from->args;
    to->state = from->state;
    if (const PyObjectExtra* x = from->extra) {
      PyObjectExtra* y = Extra(p, copy);
      y->kwargs = x->kwargs;
      Grow(p, &y->items, 0, x->item_count);
      std::copy(x->items, x->items + x->item_count, y->items);
      y->item_count = x->item_count;
      Grow(p, &y->entries, 0, x->entry_count);
      std::copy(x->entries, x->entries + x->entry_count, y->entries);
      y->entry_count = x->entry_count;
    }
    return copy;
  }
};

namespace {

// Opcode bytes, named as in CPython's Lib/pickletools.py.
enum Op : uint8_t {
  MARK = '(', STOP = '.', POP = '0', POP_MARK = '1', DUP = '2', FLOAT = 'F', INT = 'I',
  BININT = 'J', BININT1 = 'K', LONG = 'L', BININT2 = 'M', NONE = 'N', PERSID = 'P',
  BINPERSID = 'Q', REDUCE = 'R', STRING = 'S', BINSTRING = 'T', SHORT_BINSTRING = 'U',
  UNICODE = 'V', BINUNICODE = 'X', APPEND = 'a', BUILD = 'b', GLOBAL = 'c', DICT = 'd',
  EMPTY_DICT = '}', APPENDS = 'e', GET = 'g', BINGET = 'h', INST = 'i', LONG_BINGET = 'j',
  LIST = 'l', EMPTY_LIST = ']', OBJ = 'o', PUT = 'p', BINPUT = 'q', LONG_BINPUT = 'r',
  SETITEM = 's', TUPLE = 't', EMPTY_TUPLE = ')', SETITEMS = 'u', BINFLOAT = 'G',
  // protocol 2
  PROTO = 0x80, NEWOBJ = 0x81, EXT1 = 0x82, EXT2 = 0x83, EXT4 = 0x84, TUPLE1 = 0x85,
  TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88, NEWFALSE = 0x89, LONG1 = 0x8a, LONG4 = 0x8b,
  // protocol 3
  BINBYTES = 'B', SHORT_BINBYTES = 'C',
  // protocol 4
  SHORT_BINUNICODE = 0x8c, BINUNICODE8 = 0x8d, BINBYTES8 = 0x8e, EMPTY_SET = 0x8f,
  ADDITEMS = 0x90, FROZENSET = 0x91, NEWOBJ_EX = 0x92, STACK_GLOBAL = 0x93, MEMOIZE = 0x94,
  FRAME = 0x95,
  // protocol 5
  BYTEARRAY8 = 0x96, NEXT_BUFFER = 0x97, READONLY_BUFFER = 0x98,
};

constexpr int kHighestProtocol = 5;

// Globals whose only purpose in a pickle is to run code on load. torch's weights_only
// unpickler blocks the same modules; we name the attempt instead of ignoring it.
bool RunsCode(std::string_view module, std::string_view name) {
  static constexpr std::array<std::string_view, 17> kModules = {
      "os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "importlib", "runpy",
      "pty", "ctypes", "code", "codeop", "webbrowser", "commands", "pickle", "marshal"};
  // getattr is checked at call time instead: Python 3.11.2 pickles Enum members as
  // getattr(EnumClass, "name") (DeepSpeed's ZeroStageEnum), which is harmless.
  static constexpr std::array<std::string_view, 15> kBuiltins = {
      "eval", "exec", "execfile", "compile", "__import__", "open", "setattr",
      "delattr", "globals", "locals", "vars", "input", "breakpoint", "apply", "file"};
  std::string_view top = module.substr(0, module.find('.'));
  for (auto m : kModules)
    if (top == m) return true;
  if (module == "builtins" || module == "__builtin__") {
    for (auto b : kBuiltins)
      if (name == b) return true;
  }
  if (module == "operator" && (name == "attrgetter" || name == "methodcaller")) return true;
  return false;
}

// The Python 2 names of globals as Python 3's unpickler maps them for protocols 0-2
// (fix_imports, on by default; Python 3 writes them too at protocol 2): the builtins and
// copyreg modules, and the builtins Python 3 renamed. Other modules keep their names.
void FixImport(std::string_view* module, std::string_view* name) {
  if (*module == "__builtin__") {
    static constexpr std::array<std::array<std::string_view, 3>, 7> kRenamed = {{
        {"xrange", "builtins", "range"}, {"reduce", "functools", "reduce"}, {"intern", "sys", "intern"},
        {"unichr", "builtins", "chr"}, {"unicode", "builtins", "str"}, {"long", "builtins", "int"},
        {"basestring", "builtins", "str"}}};
    for (const auto& r : kRenamed)
      if (*name == r[0]) {
        *module = r[1];
        *name = r[2];
        return;
      }
    *module = "builtins";
  } else if (*module == "copy_reg") {
    *module = "copyreg";
  }
}

// Appends code point `cp` as UTF-8 (a lone surrogate, which a Python str may hold, as its
// three-byte form).
void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// A Python 2 byte string (SHORT_BINSTRING, BINSTRING, STRING) as torch.load reads legacy
// files, with encoding="latin1": each byte is the code point of its value. ASCII, nearly
// every such string, is unchanged.
bool IsAscii(std::string_view bytes) {
  for (char c : bytes)
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  return true;
}
std::string Latin1ToUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) AppendUtf8(static_cast<uint8_t>(c), &out);
  return out;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The body of a protocol-0 STRING literal (quotes removed) unescaped as Python's
// codecs.escape_decode does: \\, \', \", \a \b \f \n \r \t \v, \x + two hex digits, one
// to three octal digits (modulo 256), a backslash before a newline dropped, and any other
// escape kept as written. Fails on a bad \x escape or a trailing backslash, as Python does.
bool EscapeDecode(std::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '\\') {
      out->push_back(in[i]);
      continue;
    }
    if (++i == in.size()) return false;
    const char c = in[i];
    switch (c) {
      case '\n': break;
      case '\\': case '\'': case '"': out->push_back(c); break;
      case 'a': out->push_back('\a'); break;
      case 'b': out->push_back('\b'); break;
      case 'f': out->push_back('\f'); break;
      case 'n': out->push_back('\n'); break;
      case 'r': out->push_back('\r'); break;
      case 't': out->push_back('\t'); break;
      case 'v': out->push_back('\v'); break;
      case 'x': {
        const int hi = i + 1 < in.size() ? HexDigit(in[i + 1]) : -1;
        const int lo = i + 2 < in.size() ? HexDigit(in[i + 2]) : -1;
        if (hi < 0 || lo < 0) return false;
        out->push_back(static_cast<char>(hi * 16 + lo));
        i += 2;
        break;
      }
      default:
        if (c >= '0' && c <= '7') {
          unsigned value = static_cast<unsigned>(c - '0');
          for (int k = 0; k < 2 && i + 1 < in.size() && in[i + 1] >= '0' && in[i + 1] <= '7'; ++k)
            value = value * 8 + static_cast<unsigned>(in[++i] - '0');
          out->push_back(static_cast<char>(value & 0xFF));
        } else {
          out->push_back('\\');
          out->push_back(c);
        }
    }
  }
  return true;
}

// The operand of protocol-0 UNICODE, decoded as Python's raw-unicode-escape: bytes are
// latin1 code points, and \uXXXX / \UXXXXXXXX after an odd number of backslashes are
// escapes (the backslash before them is dropped). Fails on a short escape or one past
// U+10FFFF, as Python does.
bool RawUnicodeEscapeDecode(std::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size();) {
    if (in[i] != '\\') {
      AppendUtf8(static_cast<uint8_t>(in[i++]), out);
      continue;
    }
    const size_t run = i;
    while (i < in.size() && in[i] == '\\') out->push_back(in[i++]);
    if (((i - run) & 1) == 0 || i >= in.size() || (in[i] != 'u' && in[i] != 'U')) continue;
    out->pop_back();
    const size_t digits = in[i] == 'u' ? 4 : 8;
    ++i;
    if (in.size() - i < digits) return false;
    uint32_t cp = 0;
    for (size_t k = 0; k < digits; ++k) {
      const int d = HexDigit(in[i + k]);
      if (d < 0 || cp > 0x10FFFF) return false;
      cp = cp * 16 + static_cast<uint32_t>(d);
    }
    if (cp > 0x10FFFF) return false;
    AppendUtf8(cp, out);
    i += digits;
  }
  return true;
}

class Machine {
 public:
  Machine(std::string_view bytes, std::string_view where, Pickle* out, uint64_t memory_limit,
          PickleCallHook* hook = nullptr)
      : r_(bytes), total_(bytes.size()), where_(where), out_(out), dense_limit_(bytes.size()),
        memory_limit_(memory_limit), hook_(hook) {
    if (hook_) B::Split(out_);
  }
  // Reads the pickle from `source`, a window at a time.
  Machine(const PickleSource& source, std::string_view where, Pickle* out, uint64_t memory_limit, PickleCallHook* hook)
      : Machine(std::string_view(), where, out, memory_limit, hook) {
    source_ = &source;
    total_ = dense_limit_ = source.size;
  }

  Status Run();
  // Bytes read so far: after Run, the pickle's length up to and including STOP.
  size_t consumed() const { return Position(); }
  bool ran_out() const { return ran_out_; }

 private:
  using K = PyValue::Kind;
  using B = PickleBuilder;

  // Where the reader is in the pickle, and what is left of it.
  uint64_t Position() const { return window_start_ + r_.position(); }
  uint64_t Remaining() const { return total_ - Position(); }
  // With a source: makes sure the window holds the next opcode and all its operands, so
  // that Step reads them (and views into them) from one window.
  Status Prepare();
  // Reads more of the source into the window until it holds `bytes` unread bytes (or the
  // pickle ends), dropping what was read.
  Status Fill(uint64_t bytes);

  Status Fail(std::string_view what) const {
    return Status::Corruption(where_, "pickle: " + std::string(what) + " at byte " + std::to_string(op_pos_));
  }
  // Every failure for want of bytes goes through here: a reader of a stream of pickles
  // (PickleEnd::needs_more) then retries with more of the file.
  Status RanOut(std::string_view what) {
    ran_out_ = true;
    return Fail(what);
  }
  Status Truncated() { return RanOut("truncated pickle"); }

  // What the parse holds so far: the arenas (values, container slots, object fields), stack,
  // marks, memo and interning tables (streamed: also the read window, regions and memo log). Opcodes are 1-9 bytes but a value with its slots is
  // 16-80, and DUP/GET repeat references, so without this bound a small hostile pickle
  // could ask for unbounded memory.
  uint64_t MemoryInUse() const {
    return out_->arena_bytes() +
           (stack_.capacity() + marks_.capacity() + memo_size_ + scratch_.capacity() + memo_log_.capacity()) *
               sizeof(PyRef) +
           mark_regions_.capacity() * sizeof(Region) + window_.capacity() +
           sparse_memo_.size() * 64 + (tuples_.size() + sizes_.size()) * kInternedEntryBytes;
  }
  Status OverLimit() const {
    return Status::Refused(where_, "pickle: reading it would take more than " + std::to_string(memory_limit_) +
                                       " bytes of memory (at byte " + std::to_string(op_pos_) + ")")
                                           .WithLimitOption("max_pickle_memory");
  }
  PyRef Make(K kind, bool keep = false) { return B::NewValue(out_, kind, keep); }
  Status Pop(PyRef* out) {
    if (stack_.size() <= Floor()) return Fail("stack underflow");
    *out = stack_.back();
    stack_.pop_back();
    return Status::OK();
  }
  Status Top(PyRef* out) {
    if (stack_.size() <= Floor()) return Fail("stack underflow");
    *out = stack_.back();
    return Status::OK();
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Pops everything above the most recent MARK into scratch_ (reused: a .metadata has
  // millions of MARKs).
  Status PopMark() {
    if (marks_.empty()) return Fail("MARK expected");
    size_t mark = marks_.back();
    marks_.pop_back();
    if (hook_) {
      popped_region_ = mark_regions_.back();
      mark_regions_.pop_back();
    }
    scratch_.assign(stack_.begin() + static_cast<std::ptrdiff_t>(mark), stack_.end());
    stack_.resize(mark);
    return Status::OK();
  }
  Status Push(PyRef v) {
    stack_.push_back(v);
    return Status::OK();
  }
  // Values that are never mutated once made (None, bools, small ints, the empty tuple)
  // are shared: a checkpoint repeats them for every tensor.
  Status PushShared(PyRef* slot, K kind, int64_t i) {
    if (!*slot) {
      *slot = Make(kind, true);
      B::SetInt(*slot, i);
    }
    return Push(*slot);
  }
  // Tuples are never mutated once made, so tuples of the same numbers are one value: a DCP
  // .metadata makes three torch.Size tuples per chunk and a torch.save pickle a shape and a
  // stride tuple per tensor, nearly all repeats. Only tuples of numbers (and of such tuples)
  // are looked up, by the numbers' values: others (persistent ids, call arguments) rarely
  // repeat, and hashing them all would cost more than it saves. The tables stop growing at
  // kMaxInterned entries.
  static bool Scalar(const PyValue* v) {
    return v->kind() == K::kInt || v->kind() == K::kNone || v->kind() == K::kBool || v->kind() == K::kFloat;
  }
  static bool Internable(std::span<const PyRef> items) {
    for (const PyValue* item : items) {
      if (Scalar(item)) continue;
      if (item->kind() == K::kTuple && (B::Interned(item) || item->items().empty())) continue;
      return false;
    }
    return true;
  }
  Status PushTuple(std::span<const PyRef> items) {
    if (items.empty()) return PushShared(&empty_tuple_, K::kTuple, 0);
    const bool internable = Internable(items);
    if (internable)
      if (auto it = tuples_.find(items); it != tuples_.end()) return Push(*it);
    // Interned tuples are shared by values made later: kept, their numbers copied to kept
    // memory with them when the parse is streamed.
    if (internable && B::IsSplit(out_)) {
      scratch_items_.assign(items.begin(), items.end());
      for (PyRef& item : scratch_items_)
        if (Scalar(item)) item = B::KeepScalar(out_, item);
      items = scratch_items_;
    }
    PyRef t = B::NewTuple(out_, items, internable);
    if (!t) return Fail("tuple of over 2^32 items");
    if (internable && tuples_.size() < kMaxInterned) {
      B::SetInterned(t);
      tuples_.insert(t);
    }
    return Push(t);
  }
  Status PushInt(int64_t v) {
    if (v >= 0 && v < static_cast<int64_t>(small_ints_.size()))
      return PushShared(&small_ints_[static_cast<size_t>(v)], K::kInt, v);
    PyRef n = Make(K::kInt);
    B::SetInt(n, v);
    return Push(n);
  }
  // The stack top `*v`, made safe to change: a shared (interned) object is replaced by a
  // copy of its own first.
  void Mutable(PyRef* v) {
    if ((*v)->kind() != K::kObject || !B::Interned(*v)) return;
    PyRef copy = B::CopyObject(out_, *v);
    stack_.back() = copy;
    *v = copy;
  }
  // Scalars hash and compare by value, tuples (interned, so equal ones are one value) by
  // address.
  static uint64_t ItemKey(const PyValue* v) {
    return Scalar(v) ? B::Bits(v) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(v->kind())
                     : reinterpret_cast<uintptr_t>(v);
  }
  static bool SameItem(const PyValue* a, const PyValue* b) {
    if (a == b) return true;
    return Scalar(a) && a->kind() == b->kind() && B::Bits(a) == B::Bits(b);
  }
  struct ItemsHash {
    using is_transparent = void;
    size_t operator()(std::span<const PyRef> items) const {
      uint64_t h = items.size();
      for (const PyValue* item : items) h = (h ^ ItemKey(item)) * 0x100000001B3ull + (h >> 31);
      return static_cast<size_t>(h ^ (h >> 29));
    }
    size_t operator()(const PyValue* t) const { return (*this)(t->items()); }
  };
  struct ItemsEqual {
    using is_transparent = void;
    static bool Same(std::span<const PyRef> a, std::span<const PyRef> b) {
      if (a.size() != b.size()) return false;
      for (size_t k = 0; k < a.size(); ++k)
        if (!SameItem(a[k], b[k])) return false;
      return true;
    }
    bool operator()(const PyValue* a, const PyValue* b) const { return Same(a->items(), b->items()); }
    bool operator()(std::span<const PyRef> a, const PyValue* b) const { return Same(a, b->items()); }
    bool operator()(const PyValue* a, std::span<const PyRef> b) const { return Same(a->items(), b); }
  };
  static constexpr size_t kMaxInterned = size_t{1} << 22;
  // A streamed parse reads its source this much at a time, and refills its window when less
  // than kMinWindowBytes are left.
  static constexpr uint64_t kWindowBytes = 1 << 20, kMinWindowBytes = 64;
  static constexpr uint64_t kInternedEntryBytes = 48;  // a hash node and its bucket slot
  // Copies `s` into the arena.
  Status PushStr(std::string_view s, K kind) {
    PyRef n = B::NewText(out_, kind, s);
    if (!n) return Fail("string of over 4 GiB");
    return Push(n);
  }
  Status ReadLen(size_t width, uint64_t* len) {
    bool ok = false;
    if (width == 1) { uint8_t v = 0; ok = r_.U8(&v); *len = v; }
    else if (width == 4) { uint32_t v = 0; ok = r_.U32(&v); *len = v; }
    else { ok = r_.U64(len); }
    if (!ok) return Truncated();
    if (*len > Remaining()) return RanOut("length runs past the end of the pickle");
    return Status::OK();
  }
  Status PushCounted(size_t width, K kind) {
    uint64_t len = 0;
    CKPTFS_RETURN_IF_ERROR(ReadLen(width, &len));
    std::string_view s;
    r_.Bytes(len, &s);
    return PushStr(s, kind);
  }
  Status PushLong(std::string_view le_bytes);
  Status PushGlobal(std::string_view module, std::string_view name);
  // SHORT_BINSTRING / BINSTRING: a Python 2 byte string, read as latin1 text.
  Status PushBinString(size_t width) {
    uint64_t len = 0;
    CKPTFS_RETURN_IF_ERROR(ReadLen(width, &len));
    std::string_view s;
    r_.Bytes(len, &s);
    return PushStr(IsAscii(s) ? s : std::string_view(Latin1ToUtf8(s)), K::kStr);
  }
  // After a call of a mapping class (OrderedDict, dict) on the stack top: Python applies its
  // argument, a list of (key, value) pairs or a dict, when it is called; its pairs become
  // the object's entries here, as if set by SETITEMS, and the argument is dropped. Python 2
  // pickles every OrderedDict so (a list of [key, value] lists). Taken at the call, they
  // are the entries Python would see, whatever the pickle does to the list afterwards. An
  // argument of another shape is left as it is.
  Status ApplyMappingArguments();
  // Streamed parses (with a hook). A region: what the parse had made when a MARK was pushed.
  // When a taken call's argument tuple was built from the MARK just before it (torch's
  // rebuild calls always are), every value made since then is reachable only from that
  // tuple and from memo entries written since: those entries are dropped, then the values.
  struct Region {
    B::ArenaPosition at;
    size_t memo_log = 0;     // memo_log_'s size then
    uint64_t mutations = 0;  // mutations_ then
  };
  // Makes the call object and pushes it; with a hook, what the hook makes of it. `keep`: in
  // kept memory (an interned torch.Size). `args_region`: the arguments were made since
  // that region's start and nothing else refers to them, so a taken call frees them.
  Status Call(PyRef callable, PyRef args, PyRef kwargs, bool keep = false, const Region* args_region = nullptr);
  Status SetItems(std::span<const PyRef> kv);
  Status Append(std::span<const PyRef> values);
  // Picklers number memo slots 0, 1, 2, ...: a dense vector holds them. Each PUT costs at
  // least two bytes, so a legitimate index is below the pickle's size; others go to a map.
  // The dense memo's slot `index` (below memo_size_): nullptr when never written.
  PyRef LoadDense(uint64_t index) const {
    const uint64_t page = index / kMemoPage, at = index % kMemoPage;
    if (!hook_) return memo_pages_[page] ? memo_pages_[page][at] : nullptr;
    if (!memo_handle_pages_[page]) return nullptr;
    const uint32_t handle = memo_handle_pages_[page][at];
    if (handle == B::kNoHandle) return nullptr;
    if (handle == B::kDroppedHandle) return Dropped();
    return B::FromHandle(out_, handle);
  }
  Status StoreDense(uint64_t index, PyRef v) {
    const uint64_t page = index / kMemoPage, at = index % kMemoPage;
    if (!hook_) {
      if (!memo_pages_[page]) memo_pages_[page].reset(new PyRef[kMemoPage]());
      memo_pages_[page][at] = v;
      return Status::OK();
    }
    uint32_t handle = B::kDroppedHandle;
    if (v != Dropped() && !B::Handle(out_, v, &handle)) return Fail("memo entry beyond what a streamed parse can name");
    if (!memo_handle_pages_[page]) {
      memo_handle_pages_[page].reset(new uint32_t[kMemoPage]);
      std::fill_n(memo_handle_pages_[page].get(), kMemoPage, B::kNoHandle);
    }
    memo_handle_pages_[page][at] = handle;
    return Status::OK();
  }
  PyRef LoadMemo(uint64_t index) const {
    if (index < memo_size_) return LoadDense(index);
    auto it = sparse_memo_.find(index);
    return it == sparse_memo_.end() ? nullptr : it->second;
  }
  Status Memoize(uint64_t index) {
    PyRef top = nullptr;
    CKPTFS_RETURN_IF_ERROR(Top(&top));
    if (index < dense_limit_ && index <= memo_size_ * 2 + 4096) {
      if (index >= memo_size_) {
        memo_size_ = std::max<uint64_t>(index + 1, memo_size_ * 2);
        const size_t pages = (memo_size_ + kMemoPage - 1) / kMemoPage;
        if (hook_) memo_handle_pages_.resize(pages);
        else memo_pages_.resize(pages);
      }
      if (LoadDense(index) == nullptr) ++memo_count_;  // MEMOIZE numbers by the memo's size, as CPython does
      CKPTFS_RETURN_IF_ERROR(StoreDense(index, top));
    } else {
      PyRef& slot = sparse_memo_[index];
      if (slot == nullptr) ++memo_count_;
      slot = top;
    }
    if (hook_) memo_log_.push_back(index);
    return Status::OK();
  }
  Status Get(uint64_t index) {
    PyRef v = LoadMemo(index);
    if (!v) return Fail("memo key " + std::to_string(index) + " was never stored");
    if (v == Dropped()) return Fail("memo key " + std::to_string(index) + " holds arguments of a call the streamed parse took");
    return Push(v);
  }
  // One opcode: Step picks the group, each group's function runs it.
  Status Step(uint8_t op, bool* stop);
  Status StepStack(uint8_t op, bool* stop);  // the stack and its marks, protocol and framing
  Status StepNumber(uint8_t op);  // None, booleans, integers, floats
  Status StepString(uint8_t op);  // strings and bytes
  Status StepContainer(uint8_t op);  // tuples, lists, dicts, sets
  Status StepCall(uint8_t op, PyRef region_tuple);  // globals, calls, object state, persistent ids
  Status StepMemo(uint8_t op);  // the memo
  Status UnknownOpcode(uint8_t op) const {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", op);
    return Fail(std::string("unknown opcode ") + hex);
  }

  // A memo entry dropped with a taken call's arguments: reading it fails the streamed parse.
  static PyRef Dropped() {
    static PyValue dropped;
    return &dropped;
  }
  // A value made before the innermost open MARK changed: it may now refer to values made
  // since, so no open region may be rolled back. Values made since that MARK (a list
  // built with APPENDS inside a call's arguments) are the region's own.
  void NoteMutation(const PyValue* target) {
    if (hook_ && (mark_regions_.empty() || !B::AllocatedSince(out_, target, mark_regions_.back().at))) ++mutations_;
  }
  Region Here() const { return Region{B::Position(out_), memo_log_.size(), mutations_}; }
  Status Take(PyRef call, const Region* args_region);

  ByteReader r_;
  // With a source: the window of it that r_ reads, starting at byte window_start_.
  const PickleSource* source_ = nullptr;
  std::string window_;
  uint64_t window_start_ = 0;
  uint64_t total_ = 0;  // the pickle's size
  std::string_view where_;
  Pickle* out_;
  size_t op_pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::vector<PyRef> scratch_;  // what the last PopMark took off the stack
  PyRef none_ = nullptr, false_ = nullptr, true_ = nullptr, empty_tuple_ = nullptr;
  std::array<PyRef, 256> small_ints_{};
  uint64_t dense_limit_ = 0;
  // The dense memo: memo_size_ slots (grown by doubling, as the limit counts them) in pages
  // allocated when first written. A vector doubling to 16 million slots held 200 MB while
  // it copied, at the parse's peak. A streamed parse keeps 32-bit handles (B::Handle):
  // torch memoizes ~10 values per tensor.
  static constexpr uint64_t kMemoPage = 1 << 14;
  uint64_t memo_size_ = 0;
  std::vector<std::unique_ptr<PyRef[]>> memo_pages_;
  std::vector<std::unique_ptr<uint32_t[]>> memo_handle_pages_;
  std::unordered_map<uint64_t, PyRef> sparse_memo_;
  uint64_t memo_count_ = 0;  // distinct memo keys stored: MEMOIZE's next index
  uint64_t memory_limit_;
  std::unordered_set<PyRef, ItemsHash, ItemsEqual> tuples_;
  std::unordered_map<PyRef, PyRef> sizes_;  // interned args tuple -> its torch.Size
  std::vector<PyRef> scratch_items_;
  PickleCallHook* hook_ = nullptr;
  std::vector<Region> mark_regions_;  // with a hook: one per entry of marks_
  Region popped_region_;              // what the last PopMark took off mark_regions_
  std::vector<uint64_t> memo_log_;    // memo indices written since no region could be open
  uint64_t mutations_ = 0;            // changes to values older than the innermost MARK (NoteMutation)
  // Set by a TUPLE from a MARK, kept by memo writes, cleared by every other opcode: the
  // tuple and the region of its MARK.
  PyRef region_tuple_ = nullptr;
  Region region_;
  bool ran_out_ = false;  // the last failure was the bytes ending before the pickle did
  uint8_t proto_ = 0;     // the PROTO opcode's, 0 without one (Python 2's names are mapped below 3)
  std::vector<PyRef> pairs_;  // scratch of ApplyMappingArguments
};

Status Machine::PushLong(std::string_view le) {
  if (le.size() <= 8) {
    uint64_t u = 0;
    for (size_t k = 0; k < le.size(); ++k) u |= uint64_t{static_cast<uint8_t>(le[k])} << (8 * k);
    if (!le.empty() && le.size() < 8 && (static_cast<uint8_t>(le.back()) & 0x80))
      u |= ~uint64_t{0} << (8 * le.size());  // sign-extend
    return PushInt(static_cast<int64_t>(u));
  }
  // Wider than int64: keep the two's complement bytes as hex, most significant first.
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex = "0x";
  for (size_t k = le.size(); k-- > 0;) {
    uint8_t byte = static_cast<uint8_t>(le[k]);
    hex += kHex[byte >> 4];
    hex += kHex[byte & 15];
  }
  return PushStr(hex, K::kBigInt);
}

Status Machine::PushGlobal(std::string_view module, std::string_view name) {
  const std::string_view written_module = module, written_name = name;
  if (proto_ < 3) FixImport(&module, &name);
  if (RunsCode(written_module, written_name) || RunsCode(module, name))
    return Status::Refused(where_, "pickle references " + std::string(written_module) + "." + std::string(written_name) +
                                       ", which would run code when loaded; refusing it");
  return Push(B::NewGlobal(out_, module, name));
}

Status Machine::ApplyMappingArguments() {
  PyRef obj = stack_.back();
  if (obj->kind() != K::kObject || obj->kwargs()) return Status::OK();
  const PyValue* callable = obj->callable();
  if (!callable->IsGlobal("collections", "OrderedDict") && !callable->IsGlobal("builtins", "dict")) return Status::OK();
  const PyValue* args = obj->args();
  if (args->kind() != K::kTuple || args->items().size() != 1) return Status::OK();
  const PyValue* items = args->items()[0];
  pairs_.clear();
  if (items->kind() == K::kDict) {
    for (const PyPair& kv : items->entries()) {
      pairs_.push_back(kv.first);
      pairs_.push_back(kv.second);
    }
  } else if (items->kind() == K::kList || items->kind() == K::kTuple) {
    for (PyRef pair : items->items()) {
      if ((pair->kind() != K::kList && pair->kind() != K::kTuple) || pair->items().size() != 2) return Status::OK();
      pairs_.push_back(pair->items()[0]);
      pairs_.push_back(pair->items()[1]);
    }
  } else {
    return Status::OK();
  }
  if (!empty_tuple_) {
    CKPTFS_RETURN_IF_ERROR(PushShared(&empty_tuple_, K::kTuple, 0));
    stack_.pop_back();
  }
  B::Object(obj)->args = empty_tuple_;
  return SetItems(pairs_);
}

Status Machine::Call(PyRef callable, PyRef args, PyRef kwargs, bool keep, const Region* args_region) {
  if (callable->kind() == K::kGlobal && callable->name() == "getattr" &&
      (callable->s() == "builtins" || callable->s() == "__builtin__")) {
    // Only the Enum-member form, getattr(<class>, "<name>"), is data.
    const bool enum_member = args->kind() == K::kTuple && args->items().size() == 2 &&
                             args->items()[0]->kind() == K::kGlobal && args->items()[1]->kind() == K::kStr;
    if (!enum_member)
      return Status::Refused(where_, "pickle calls " + std::string(callable->s()) +
                                         ".getattr on something other than a class attribute, which could run "
                                         "code when loaded; refusing it");
  }
  PyRef obj = Make(K::kObject, keep);
  PyObjectBody* body = B::Object(obj);
  body->callable = callable;
  body->args = args;
  if (kwargs) B::Extra(out_, obj)->kwargs = kwargs;
  if (hook_ && !keep) return Take(obj, args_region);
  return Push(obj);
}

Status Machine::Take(PyRef call, const Region* args_region) {
  bool take = false;
  uint64_t index = 0;
  CKPTFS_RETURN_IF_ERROR(hook_->OnCall(call, &take, &index));
  if (!take) return Push(call);
  // Nothing made since the region changed an older value (which could then refer to newer
  // ones): the values made since are the arguments' alone, and memo entries.
  if (args_region && args_region->mutations == mutations_) {
    for (size_t k = args_region->memo_log; k < memo_log_.size(); ++k) {
      const uint64_t index = memo_log_[k];
      PyRef v = LoadMemo(index);
      if (!v || v == Dropped() || !B::AllocatedSince(out_, v, args_region->at)) continue;
      if (index < memo_size_) CKPTFS_RETURN_IF_ERROR(StoreDense(index, Dropped()));
      else sparse_memo_[index] = Dropped();
    }
    memo_log_.resize(args_region->memo_log);
    B::RollBack(out_, args_region->at);
  }
  return Push(B::NewTaken(out_, index));
}

Status Machine::SetItems(std::span<const PyRef> kv) {
  if (kv.size() % 2 != 0) return Fail("odd number of items for SETITEMS");
  PyRef target = nullptr;
  CKPTFS_RETURN_IF_ERROR(Top(&target));
  Mutable(&target);
  NoteMutation(target);
  if (target->kind() != K::kDict && target->kind() != K::kObject) return Fail("SETITEM on something that is not a dict");
  if (!B::SetItems(out_, target, kv)) return Fail("dict of over 2^32 items");
  return Status::OK();
}

Status Machine::Append(std::span<const PyRef> values) {
  PyRef target = nullptr;
  CKPTFS_RETURN_IF_ERROR(Top(&target));
  Mutable(&target);
  NoteMutation(target);
  if (target->kind() != K::kList && target->kind() != K::kSet && target->kind() != K::kObject)
    return Fail("APPEND to something that is not a list");
  if (!B::Append(out_, target, values)) return Fail("list of over 2^32 items");
  return Status::OK();
}

Status Machine::Run() {
  bool stop = false;
  while (!stop) {
    if (source_) CKPTFS_RETURN_IF_ERROR(Prepare());
    op_pos_ = Position();
    uint8_t op;
    if (!r_.U8(&op)) return RanOut("pickle ends without STOP");
    if (hook_ && marks_.empty() && !region_tuple_) memo_log_.clear();  // no region can be rolled back to
    CKPTFS_RETURN_IF_ERROR(Step(op, &stop));
    // One step adds at most a copy of the stack, which was under the limit before it.
    if (MemoryInUse() > memory_limit_) return OverLimit();
  }
  if (stack_.size() != 1 || !marks_.empty()) return Fail("STOP with a malformed stack");
  out_->root = stack_.back();
  return Status::OK();
}

Status Machine::Fill(uint64_t bytes) {
  const uint64_t want = std::min<uint64_t>(bytes, Remaining());
  if (r_.remaining() >= want) return Status::OK();
  const size_t read = r_.position();
  const size_t kept = r_.remaining();
  // Whole windows, not just what is missing: one read serves many opcodes.
  const uint64_t add = std::min<uint64_t>(Remaining() - kept, std::max<uint64_t>(want - kept, kWindowBytes));
  window_.erase(0, read);
  window_.resize(kept + add);
  window_start_ += read;
  CKPTFS_RETURN_IF_ERROR(source_->read(window_start_ + kept, add, window_.data() + kept));
  r_ = ByteReader(window_);
  return Status::OK();
}

Status Machine::Prepare() {
  // The longest fixed-size opcode is 9 bytes; counted ones need their length first.
  if (r_.remaining() < kMinWindowBytes) CKPTFS_RETURN_IF_ERROR(Fill(kMinWindowBytes));
  if (r_.remaining() == 0) return Status::OK();
  const std::string_view ahead = std::string_view(window_).substr(r_.position());
  const uint8_t op = static_cast<uint8_t>(ahead[0]);
  // Newline-terminated operands: until that many newlines are in the window.
  int lines = 0;
  switch (op) {
    case GLOBAL: case INST: lines = 2; break;
    case INT: case LONG: case FLOAT: case STRING: case UNICODE: case PUT: case GET: case PERSID: lines = 1; break;
    default: break;
  }
  if (lines > 0) {
    for (;;) {
      const std::string_view now = std::string_view(window_).substr(r_.position());
      size_t at = 0;
      int found = 0;
      while (found < lines && (at = now.find('\n', at)) != std::string_view::npos) ++found, ++at;
      if (found == lines || r_.remaining() == Remaining()) return Status::OK();
      CKPTFS_RETURN_IF_ERROR(Fill(r_.remaining() + kWindowBytes));
    }
  }
  size_t width = 0;
  switch (op) {
    case SHORT_BINUNICODE: case SHORT_BINSTRING: case SHORT_BINBYTES: case LONG1: width = 1; break;
    case BINUNICODE: case BINSTRING: case BINBYTES: case LONG4: width = 4; break;
    case BINUNICODE8: case BINBYTES8: case BYTEARRAY8: width = 8; break;
    default: return Status::OK();
  }
  if (ahead.size() < 1 + width) return Status::OK();  // the pickle ends: Step says so
  uint64_t len = 0;
  for (size_t k = 0; k < width; ++k) len |= uint64_t{static_cast<uint8_t>(ahead[1 + k])} << (8 * k);
  if (len > Remaining() - 1 - width) return Status::OK();  // runs past the end: Step says so
  return Fill(1 + width + len);
}

Status Machine::StepStack(uint8_t op, bool* stop) {
  PyRef a = nullptr;
  switch (op) {
    case PROTO: {
      uint8_t proto;
      if (!r_.U8(&proto)) return Truncated();
      if (proto > kHighestProtocol) return Fail("unsupported pickle protocol " + std::to_string(proto));
      proto_ = proto;
      return Status::OK();
    }
    case FRAME: {  // framing is only a read-ahead hint: the opcodes continue inline
      uint64_t len = 0;
      if (!r_.U64(&len)) return Truncated();
      // ...but a frame longer than what is left is a lie CPython refuses ("pickle data was
      // truncated"); refuse it too.
      if (len > Remaining()) return RanOut("frame of " + std::to_string(len) + " bytes runs past the end of the pickle");
      return Status::OK();
    }
    case STOP: *stop = true; return Status::OK();
    case MARK:
      marks_.push_back(stack_.size());
      if (hook_) mark_regions_.push_back(Here());
      return Status::OK();
    case POP:
      if (stack_.size() > Floor()) return Pop(&a);
      // POP right after MARK drops the mark (what CPython does).
      if (!marks_.empty()) {
        marks_.pop_back();
        if (hook_) mark_regions_.pop_back();
        return Status::OK();
      }
      return Fail("stack underflow");
    case POP_MARK: return PopMark();
    case DUP: CKPTFS_RETURN_IF_ERROR(Top(&a)); return Push(a);
    default: return UnknownOpcode(op);
  }
}

Status Machine::StepNumber(uint8_t op) {
  PyRef a = nullptr;
  std::string_view text;
  switch (op) {
    case NONE: return PushShared(&none_, K::kNone, 0);
    case NEWTRUE: return PushShared(&true_, K::kBool, 1);
    case NEWFALSE: return PushShared(&false_, K::kBool, 0);
    case BININT: { uint32_t v = 0; if (!r_.U32(&v)) return Truncated(); return PushInt(static_cast<int32_t>(v)); }
    case BININT1: { uint8_t v = 0; if (!r_.U8(&v)) return Truncated(); return PushInt(v); }
    case BININT2: { uint16_t v = 0; if (!r_.U16(&v)) return Truncated(); return PushInt(v); }
    case LONG1: case LONG4: {
      uint64_t len = 0;
      CKPTFS_RETURN_IF_ERROR(ReadLen(op == LONG1 ? 1 : 4, &len));
      r_.Bytes(len, &text);
      return PushLong(text);
    }
    case INT: case LONG: {
      if (!r_.Line(&text)) return Truncated();
      if (op == INT && (text == "00" || text == "01"))  // protocol 0 booleans
        return text == "01" ? PushShared(&true_, K::kBool, 1) : PushShared(&false_, K::kBool, 0);
      if (!text.empty() && text.back() == 'L') text.remove_suffix(1);
      int64_t v = 0;
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec == std::errc::result_out_of_range) return PushStr(text, K::kBigInt);
      if (ec != std::errc() || ptr != text.data() + text.size()) return Fail("bad integer literal");
      return PushInt(v);
    }
    case FLOAT: {
      if (!r_.Line(&text)) return Truncated();
      std::string s(text);
      char* end = nullptr;
      const double value = std::strtod(s.c_str(), &end);
      if (s.empty() || end != s.c_str() + s.size()) return Fail("bad float literal");
      a = Make(K::kFloat);
      B::SetFloat(a, value);
      return Push(a);
    }
    case BINFLOAT: {
      uint64_t be;
      if (!r_.U64(&be)) return Truncated();
      uint64_t bits = __builtin_bswap64(be);  // BINFLOAT is big-endian
      double value;
      std::memcpy(&value, &bits, sizeof bits);
      a = Make(K::kFloat);
      B::SetFloat(a, value);
      return Push(a);
    }
    default: return UnknownOpcode(op);
  }
}

Status Machine::StepString(uint8_t op) {
  std::string_view text;
  switch (op) {
    case BINUNICODE: return PushCounted(4, K::kStr);
    case SHORT_BINUNICODE: return PushCounted(1, K::kStr);
    case BINUNICODE8: return PushCounted(8, K::kStr);
    case SHORT_BINSTRING: return PushBinString(1);
    case BINSTRING: return PushBinString(4);
    case BINBYTES: return PushCounted(4, K::kBytes);
    case SHORT_BINBYTES: return PushCounted(1, K::kBytes);
    case BINBYTES8: case BYTEARRAY8: return PushCounted(8, K::kBytes);
    case UNICODE: {
      if (!r_.Line(&text)) return Truncated();
      std::string decoded;
      if (!RawUnicodeEscapeDecode(text, &decoded)) return Fail("UNICODE operand with a malformed \\u escape");
      return PushStr(decoded, K::kStr);
    }
    case STRING: {
      if (!r_.Line(&text)) return Truncated();
      if (text.size() < 2 || (text.front() != '\'' && text.front() != '"') || text.back() != text.front())
        return Fail("STRING operand is not quoted");
      std::string decoded;
      if (!EscapeDecode(text.substr(1, text.size() - 2), &decoded)) return Fail("STRING operand with a malformed escape");
      return PushStr(IsAscii(decoded) ? decoded : Latin1ToUtf8(decoded), K::kStr);
    }
    default: return UnknownOpcode(op);
  }
}

Status Machine::StepContainer(uint8_t op) {
  PyRef a = nullptr, b = nullptr;
  switch (op) {
    case EMPTY_TUPLE: return PushTuple({});
    case TUPLE1: case TUPLE2: case TUPLE3: {
      size_t n = op - TUPLE1 + 1;
      if (stack_.size() < Floor() + n) return Fail("stack underflow");
      scratch_.assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
      stack_.resize(stack_.size() - n);
      return PushTuple(scratch_);
    }
    case TUPLE:
      CKPTFS_RETURN_IF_ERROR(PopMark());
      CKPTFS_RETURN_IF_ERROR(PushTuple(scratch_));
      if (hook_) {
        region_tuple_ = stack_.back();
        region_ = popped_region_;
      }
      return Status::OK();
    case EMPTY_LIST: return Push(Make(K::kList));
    case LIST: {
      CKPTFS_RETURN_IF_ERROR(PopMark());
      CKPTFS_RETURN_IF_ERROR(Push(Make(K::kList)));
      return Append(scratch_);
    }
    case APPEND: CKPTFS_RETURN_IF_ERROR(Pop(&a)); return Append(std::span<const PyRef>(&a, 1));
    case APPENDS: CKPTFS_RETURN_IF_ERROR(PopMark()); return Append(scratch_);
    case EMPTY_DICT: return Push(Make(K::kDict));
    case DICT: {
      CKPTFS_RETURN_IF_ERROR(PopMark());
      CKPTFS_RETURN_IF_ERROR(Push(Make(K::kDict)));
      return SetItems(scratch_);
    }
    case SETITEM: {
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      const std::array<PyRef, 2> kv{a, b};
      return SetItems(kv);
    }
    case SETITEMS: CKPTFS_RETURN_IF_ERROR(PopMark()); return SetItems(scratch_);
    case EMPTY_SET: return Push(Make(K::kSet));
    case ADDITEMS: CKPTFS_RETURN_IF_ERROR(PopMark()); return Append(scratch_);
    case FROZENSET: {
      CKPTFS_RETURN_IF_ERROR(PopMark());
      CKPTFS_RETURN_IF_ERROR(Push(Make(K::kSet)));
      return Append(scratch_);
    }
    default: return UnknownOpcode(op);
  }
}

Status Machine::StepCall(uint8_t op, PyRef region_tuple) {
  PyRef a = nullptr, b = nullptr, c = nullptr;
  std::string_view text;
  switch (op) {
    case GLOBAL: {
      std::string_view module, name;
      if (!r_.Line(&module) || !r_.Line(&name)) return Truncated();
      return PushGlobal(module, name);
    }
    case STACK_GLOBAL: {
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      if (a->kind() != K::kStr || b->kind() != K::kStr) return Fail("STACK_GLOBAL needs two strings");
      return PushGlobal(a->s(), b->s());
    }
    case REDUCE:
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      if (b->kind() != K::kTuple) return Fail("REDUCE arguments are not a tuple");
      // torch.Size of an interned tuple: a DCP .metadata makes three per chunk, nearly all
      // repeats. Shared like the tuple it wraps (marked interned); Mutable() copies it
      // first should a BUILD, SETITEMS or APPENDS ever target it.
      if (B::Interned(b) && a->IsGlobal("torch", "Size")) {
        if (auto it = sizes_.find(b); it != sizes_.end()) return Push(it->second);
        CKPTFS_RETURN_IF_ERROR(Call(a, b, nullptr, true));
        if (sizes_.size() < kMaxInterned) {
          B::SetInterned(stack_.back());
          sizes_.emplace(b, stack_.back());
        }
        return Status::OK();
      }
      // The tuple popped is the one the last TUPLE made, and the callable was below its MARK:
      // the region holds the arguments alone.
      CKPTFS_RETURN_IF_ERROR(Call(a, b, nullptr, false, hook_ && region_tuple && b == region_tuple ? &region_ : nullptr));
      return ApplyMappingArguments();
    case NEWOBJ:
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      return Call(a, b, nullptr);
    case NEWOBJ_EX:
      CKPTFS_RETURN_IF_ERROR(Pop(&c));
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      return Call(a, b, c);
    case INST: {
      std::string_view module, name;
      if (!r_.Line(&module) || !r_.Line(&name)) return Truncated();
      CKPTFS_RETURN_IF_ERROR(PopMark());
      CKPTFS_RETURN_IF_ERROR(PushGlobal(module, name));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      CKPTFS_RETURN_IF_ERROR(PushTuple(scratch_));
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Call(a, b, nullptr));
      return ApplyMappingArguments();
    }
    case OBJ: {
      CKPTFS_RETURN_IF_ERROR(PopMark());
      if (scratch_.empty()) return Fail("OBJ without a class");
      a = scratch_.front();
      CKPTFS_RETURN_IF_ERROR(PushTuple(std::span<const PyRef>(scratch_).subspan(1)));
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Call(a, b, nullptr));
      return ApplyMappingArguments();
    }
    case BUILD: {
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Top(&a));
      if (a->kind() == K::kTaken) return Fail("BUILD on a call the streamed parse took");
      Mutable(&a);
      NoteMutation(a);
      if (a->kind() != K::kObject) {
        // BUILD on a plain container (a dict subclass reduced to dict) keeps the state aside.
        PyRef wrapper = Make(K::kObject);
        B::Object(wrapper)->callable = Make(K::kNone);
        B::Object(wrapper)->args = a;
        stack_.back() = wrapper;
        a = wrapper;
      }
      B::Object(a)->state = b;
      return Status::OK();
    }
    case PERSID: case BINPERSID: {
      if (op == PERSID) {
        if (!r_.Line(&text)) return Truncated();
        CKPTFS_RETURN_IF_ERROR(PushStr(text, K::kStr));
      }
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      b = Make(K::kPersistent);
      B::SetPid(b, a);
      return Push(b);
    }
    default: return UnknownOpcode(op);
  }
}

Status Machine::StepMemo(uint8_t op) {
  std::string_view text;
  switch (op) {
    case PUT: {
      if (!r_.Line(&text)) return Truncated();
      uint64_t idx = 0;
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), idx);
      if (ec != std::errc() || ptr != text.data() + text.size()) return Fail("bad PUT index");
      return Memoize(idx);
    }
    case BINPUT: { uint8_t v = 0; if (!r_.U8(&v)) return Truncated(); return Memoize(v); }
    case LONG_BINPUT: { uint32_t v = 0; if (!r_.U32(&v)) return Truncated(); return Memoize(v); }
    case MEMOIZE: return Memoize(memo_count_);
    case GET: {
      if (!r_.Line(&text)) return Truncated();
      uint64_t idx = 0;
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), idx);
      if (ec != std::errc() || ptr != text.data() + text.size()) return Fail("bad GET index");
      return Get(idx);
    }
    case BINGET: { uint8_t v = 0; if (!r_.U8(&v)) return Truncated(); return Get(v); }
    case LONG_BINGET: { uint32_t v = 0; if (!r_.U32(&v)) return Truncated(); return Get(v); }
    default: return UnknownOpcode(op);
  }
}

Status Machine::Step(uint8_t op, bool* stop) {
  // A TUPLE's region survives memo writes only (torch: TUPLE, BINPUT, REDUCE).
  PyRef region_tuple = region_tuple_;
  region_tuple_ = nullptr;
  if (op == PUT || op == BINPUT || op == LONG_BINPUT || op == MEMOIZE) region_tuple_ = region_tuple;
  switch (op) {
    case PROTO: case FRAME: case STOP: case MARK: case POP: case POP_MARK: case DUP:
      return StepStack(op, stop);
    case NONE: case NEWTRUE: case NEWFALSE: case BININT: case BININT1: case BININT2: case LONG1: case LONG4:
    case INT: case LONG: case FLOAT: case BINFLOAT:
      return StepNumber(op);
    case BINUNICODE: case SHORT_BINUNICODE: case BINUNICODE8: case SHORT_BINSTRING: case BINSTRING:
    case BINBYTES: case SHORT_BINBYTES: case BINBYTES8: case BYTEARRAY8: case UNICODE: case STRING:
      return StepString(op);
    case EMPTY_TUPLE: case TUPLE1: case TUPLE2: case TUPLE3: case TUPLE: case EMPTY_LIST: case LIST:
    case APPEND: case APPENDS: case EMPTY_DICT: case DICT: case SETITEM: case SETITEMS: case EMPTY_SET:
    case ADDITEMS: case FROZENSET:
      return StepContainer(op);
    case GLOBAL: case STACK_GLOBAL: case REDUCE: case NEWOBJ: case NEWOBJ_EX: case INST: case OBJ:
    case BUILD: case PERSID: case BINPERSID:
      return StepCall(op, region_tuple);
    case PUT: case BINPUT: case LONG_BINPUT: case MEMOIZE: case GET: case BINGET: case LONG_BINGET:
      return StepMemo(op);
    case EXT1: case EXT2: case EXT4:
      return Status::NotSupported(where_, "pickle uses the copyreg extension registry (EXT opcodes)");
    case NEXT_BUFFER: case READONLY_BUFFER:
      return Status::NotSupported(where_, "pickle uses out-of-band buffers (protocol 5)");
    default: return UnknownOpcode(op);
  }
}

}  // namespace

std::string PyValue::CallableName() const {
  const PyValue* c = callable();
  if (!c || c->kind() != Kind::kGlobal) return "";
  return std::string(c->s()) + "." + std::string(c->name());
}

void* Pickle::Arena::Allocate(size_t bytes) {
  bytes = (bytes + 7) & ~size_t{7};
  if (bytes > kMaxBlock / 4) {
    // A large array gets a block of its own; the current block keeps serving small ones.
    blocks_.push_back(Block{std::unique_ptr<std::byte[]>(new std::byte[bytes]), bytes, true});
    bytes_ += bytes;
    return blocks_.back().data.get();
  }
  if (bytes > left_in_block_) {
    const size_t size = std::max(next_block_, bytes);
    blocks_.push_back(Block{std::unique_ptr<std::byte[]>(new std::byte[size]), size, false});
    cursor_block_ = blocks_.size() - 1;
    cursor_ = blocks_.back().data.get();
    left_in_block_ = size;
    bytes_ += size;
    next_block_ = std::min(kMaxBlock, next_block_ * 2);
  }
  void* at = cursor_;
  cursor_ += bytes;
  left_in_block_ -= bytes;
  return at;
}

bool Pickle::Arena::Locate(const void* p, size_t* block, size_t* offset8, bool recent_only) const {
  const auto* at = static_cast<const std::byte*>(p);
  auto In = [&](size_t k) {
    const Block& b = blocks_[k];
    if (!(std::less_equal<const std::byte*>()(b.data.get(), at) && std::less<const std::byte*>()(at, b.data.get() + b.size)))
      return false;
    *block = k;
    *offset8 = static_cast<size_t>(at - b.data.get()) / 8;
    return true;
  };
  // Nearly always a value just made: in the block small allocations come from.
  if (cursor_block_ < blocks_.size() && In(cursor_block_)) return true;
  if (recent_only) return false;
  // Else a value made long ago (an interned tuple a million tensors share): the block
  // whose start is the last at or before `p`, by a search of the blocks sorted by
  // address. A scan from the newest block would take time in proportion to the arena's
  // size, for every such lookup.
  if (by_address_.size() != blocks_.size()) {
    by_address_.clear();
    for (size_t k = 0; k < blocks_.size(); ++k) by_address_.push_back(k);
    std::sort(by_address_.begin(), by_address_.end(), [&](size_t a, size_t b) {
      return std::less<const std::byte*>()(blocks_[a].data.get(), blocks_[b].data.get());
    });
  }
  auto after = std::upper_bound(by_address_.begin(), by_address_.end(), at, [&](const std::byte* x, size_t k) {
    return std::less<const std::byte*>()(x, blocks_[k].data.get());
  });
  // Blocks a large array left (FreeLarge) hold nothing and sort first: they match nothing.
  return after != by_address_.begin() && In(*(after - 1));
}

bool Pickle::Arena::AllocatedSince(const void* p, const Position& from) const {
  const auto* at = static_cast<const std::byte*>(p);
  auto In = [&](const Block& b, const std::byte* begin) {
    return std::less_equal<const std::byte*>()(begin, at) && std::less<const std::byte*>()(at, b.data.get() + b.size);
  };
  // What the block that served small allocations then had left, and every block made since.
  if (from.cursor && from.cursor_block < blocks_.size() && In(blocks_[from.cursor_block], from.cursor)) return true;
  for (size_t k = from.blocks; k < blocks_.size(); ++k)
    if (In(blocks_[k], blocks_[k].data.get())) return true;
  return false;
}

bool Pickle::Arena::FreeLarge(const void* p) {
  // Large blocks are few (arrays over 256 KiB); the one sought is usually among the last.
  for (size_t k = blocks_.size(); k-- > 0;) {
    Block& b = blocks_[k];
    if (b.data.get() != p) continue;
    if (!b.own) return false;
    bytes_ -= b.size;
    b.data.reset();
    b.size = 0;
    by_address_.clear();  // its place in the order is gone
    return true;
  }
  return false;
}

void Pickle::Arena::RollBack(const Position& to) {
  if (to.blocks != blocks_.size()) by_address_.clear();
  blocks_.resize(to.blocks);
  cursor_block_ = to.cursor_block;
  cursor_ = to.cursor;
  left_in_block_ = to.left;
  next_block_ = to.next_block;
  bytes_ = to.bytes;
}

Pickle::Pickle(Pickle&& other) noexcept { *this = std::move(other); }

Pickle& Pickle::operator=(Pickle&& other) noexcept {
  if (this != &other) {
    root = other.root;
    values_arena_ = std::move(other.values_arena_);
    kept_arena_ = std::move(other.kept_arena_);
    split_ = other.split_;
    values_ = other.values_;
    other.Clear();
  }
  return *this;
}

void Pickle::Clear() {
  root = nullptr;
  values_arena_ = Arena();
  kept_arena_ = Arena();
  split_ = false;
  values_ = 0;
}

Status ParseOwnedPickle(std::string bytes, std::string_view where, Pickle* result, uint64_t memory_limit,
                        PickleEnd* end) {
  return ParsePickle(bytes, where, result, memory_limit, end);
}

Status ParsePickleStreamed(const PickleSource& source, std::string_view where, PickleCallHook* hook, Pickle* result,
                           uint64_t memory_limit) {
  result->Clear();
  Machine m(source, where, result, memory_limit, hook);
  return m.Run();
}

Status ParsePickle(std::string_view bytes, std::string_view where, Pickle* result, uint64_t memory_limit,
                   PickleEnd* end) {
  result->Clear();
  Machine m(bytes, where, result, memory_limit);
  Status status = m.Run();
  if (end) {
    end->consumed = m.consumed();
    end->needs_more = !status.ok() && m.ran_out();
  }
  return status;
}

}  // namespace ckptfs
