#include "format/pickle.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <new>
#include <span>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "format/byte_reader.hpp"
#include "format/limit_hint.hpp"

namespace ckptfs {

// The only writer of values: the parser below. Values and their out-of-line parts are
// arena memory of the Pickle (nothing to destroy: every part is trivially destructible).
struct PickleBuilder {
  using K = PyValue::Kind;
  static constexpr uint8_t kInterned = 1;  // shared by the interning tables: copy before changing

  static PyRef NewValue(Pickle* p, K kind) {
    PyRef v = new (p->Allocate(sizeof(PyValue))) PyValue();
    v->kind_ = kind;
    if (kind == K::kObject) v->word_.object = new (p->Allocate(sizeof(PyObjectBody))) PyObjectBody();
    ++p->values_;
    return v;
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
  static PyRef NewText(Pickle* p, K kind, std::string_view text) {
    if (text.size() > UINT32_MAX) return nullptr;
    PyRef v = NewValue(p, kind);
    v->word_.text = KeepText(p, text).data();
    v->count_ = static_cast<uint32_t>(text.size());
    return v;
  }
  // A copy of `text` in the arena.
  static std::string_view KeepText(Pickle* p, std::string_view text) {
    if (text.empty()) return {};
    char* copy = static_cast<char*>(p->Allocate(text.size()));
    std::memcpy(copy, text.data(), text.size());
    return {copy, text.size()};
  }
  static PyRef NewGlobal(Pickle* p, std::string_view module, std::string_view name) {
    PyRef v = NewValue(p, K::kGlobal);
    v->word_.global = new (p->Allocate(sizeof(PyGlobalBody))) PyGlobalBody{KeepText(p, module), KeepText(p, name)};
    return v;
  }
  static PyRef NewTuple(Pickle* p, std::span<const PyRef> items) {
    if (items.size() > UINT32_MAX) return nullptr;
    PyRef v = NewValue(p, K::kTuple);
    v->word_.items = static_cast<PyRef*>(p->Allocate(items.size() * sizeof(PyRef)));
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

class Machine {
 public:
  Machine(std::string_view bytes, std::string_view where, Pickle* out, uint64_t memory_limit)
      : r_(bytes), where_(where), out_(out), dense_limit_(bytes.size()), memory_limit_(memory_limit) {}

  Status Run();
  // Bytes read so far: after Run, the pickle's length up to and including STOP.
  size_t consumed() const { return r_.position(); }
  bool ran_out() const { return ran_out_; }

 private:
  using K = PyValue::Kind;
  using B = PickleBuilder;

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

  // What the parse holds so far: the arena (values, container slots, object fields), stack,
  // marks, memo and interning tables. Opcodes are 1-9 bytes but a value with its slots is
  // 16-80, and DUP/GET repeat references, so without this bound a small hostile pickle
  // could ask for unbounded memory.
  uint64_t MemoryInUse() const {
    return out_->arena_bytes() + (stack_.capacity() + marks_.capacity() + memo_.capacity() + scratch_.capacity()) * sizeof(PyRef) +
           sparse_memo_.size() * 64 + (tuples_.size() + sizes_.size()) * kInternedEntryBytes;
  }
  Status OverLimit() const {
    return Status::Refused(where_, "pickle: reading it would take more than " + std::to_string(memory_limit_) +
                                       " bytes of memory (at byte " + std::to_string(op_pos_) + ")" +
                                       LimitHint("max_pickle_memory"));
  }
  PyRef Make(K kind) { return B::NewValue(out_, kind); }
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
      *slot = Make(kind);
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
    PyRef t = B::NewTuple(out_, items);
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
    if (*len > r_.remaining()) return RanOut("length runs past the end of the pickle");
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
  Status Call(PyRef callable, PyRef args, PyRef kwargs);
  Status SetItems(std::span<const PyRef> kv);
  Status Append(std::span<const PyRef> values);
  // Picklers number memo slots 0, 1, 2, ...: a dense vector holds them. Each PUT costs at
  // least two bytes, so a legitimate index is below the pickle's size; others go to a map.
  Status Memoize(uint64_t index) {
    PyRef top = nullptr;
    CKPTFS_RETURN_IF_ERROR(Top(&top));
    PyRef* slot;
    if (index < dense_limit_ && index <= memo_.size() * 2 + 4096) {
      if (index >= memo_.size()) memo_.resize(std::max<uint64_t>(index + 1, memo_.size() * 2), nullptr);
      slot = &memo_[index];
    } else {
      slot = &sparse_memo_[index];
    }
    if (*slot == nullptr) ++memo_count_;  // MEMOIZE numbers by the memo's size, as CPython does
    *slot = top;
    return Status::OK();
  }
  Status Get(uint64_t index) {
    PyRef v = nullptr;
    if (index < memo_.size()) v = memo_[index];
    else if (auto it = sparse_memo_.find(index); it != sparse_memo_.end()) v = it->second;
    if (!v) return Fail("memo key " + std::to_string(index) + " was never stored");
    return Push(v);
  }
  Status Step(uint8_t op, bool* stop);

  ByteReader r_;
  std::string_view where_;
  Pickle* out_;
  size_t op_pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::vector<PyRef> scratch_;  // what the last PopMark took off the stack
  PyRef none_ = nullptr, false_ = nullptr, true_ = nullptr, empty_tuple_ = nullptr;
  std::array<PyRef, 256> small_ints_{};
  uint64_t dense_limit_ = 0;
  std::vector<PyRef> memo_;
  std::unordered_map<uint64_t, PyRef> sparse_memo_;
  uint64_t memo_count_ = 0;  // distinct memo keys stored: MEMOIZE's next index
  uint64_t memory_limit_;
  std::unordered_set<PyRef, ItemsHash, ItemsEqual> tuples_;
  std::unordered_map<PyRef, PyRef> sizes_;  // interned args tuple -> its torch.Size
  bool ran_out_ = false;  // the last failure was the bytes ending before the pickle did
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
  if (RunsCode(module, name))
    return Status::Refused(where_, "pickle references " + std::string(module) + "." + std::string(name) +
                                       ", which would run code when loaded; refusing it");
  return Push(B::NewGlobal(out_, module, name));
}

Status Machine::Call(PyRef callable, PyRef args, PyRef kwargs) {
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
  PyRef obj = Make(K::kObject);
  PyObjectBody* body = B::Object(obj);
  body->callable = callable;
  body->args = args;
  if (kwargs) B::Extra(out_, obj)->kwargs = kwargs;
  return Push(obj);
}

Status Machine::SetItems(std::span<const PyRef> kv) {
  if (kv.size() % 2 != 0) return Fail("odd number of items for SETITEMS");
  PyRef target = nullptr;
  CKPTFS_RETURN_IF_ERROR(Top(&target));
  Mutable(&target);
  if (target->kind() != K::kDict && target->kind() != K::kObject) return Fail("SETITEM on something that is not a dict");
  if (!B::SetItems(out_, target, kv)) return Fail("dict of over 2^32 items");
  return Status::OK();
}

Status Machine::Append(std::span<const PyRef> values) {
  PyRef target = nullptr;
  CKPTFS_RETURN_IF_ERROR(Top(&target));
  Mutable(&target);
  if (target->kind() != K::kList && target->kind() != K::kSet && target->kind() != K::kObject)
    return Fail("APPEND to something that is not a list");
  if (!B::Append(out_, target, values)) return Fail("list of over 2^32 items");
  return Status::OK();
}

Status Machine::Run() {
  bool stop = false;
  while (!stop) {
    op_pos_ = r_.position();
    uint8_t op;
    if (!r_.U8(&op)) return RanOut("pickle ends without STOP");
    CKPTFS_RETURN_IF_ERROR(Step(op, &stop));
    // One step adds at most a copy of the stack, which was under the limit before it.
    if (MemoryInUse() > memory_limit_) return OverLimit();
  }
  if (stack_.size() != 1 || !marks_.empty()) return Fail("STOP with a malformed stack");
  out_->root = stack_.back();
  return Status::OK();
}

Status Machine::Step(uint8_t op, bool* stop) {
  PyRef a = nullptr, b = nullptr, c = nullptr;
  std::string_view text;
  switch (op) {
    case PROTO: {
      uint8_t proto;
      if (!r_.U8(&proto)) return Truncated();
      if (proto > kHighestProtocol) return Fail("unsupported pickle protocol " + std::to_string(proto));
      return Status::OK();
    }
    case FRAME: {  // framing is only a read-ahead hint: the opcodes continue inline
      uint64_t len = 0;
      if (!r_.U64(&len)) return Truncated();
      // ...but a frame longer than what is left is a lie CPython refuses ("pickle data was
      // truncated"); refuse it too.
      if (len > r_.remaining()) return RanOut("frame of " + std::to_string(len) + " bytes runs past the end of the pickle");
      return Status::OK();
    }
    case STOP: *stop = true; return Status::OK();
    case MARK: marks_.push_back(stack_.size()); return Status::OK();
    case POP:
      if (stack_.size() > Floor()) return Pop(&a);
      // POP right after MARK drops the mark (what CPython does).
      if (!marks_.empty()) { marks_.pop_back(); return Status::OK(); }
      return Fail("stack underflow");
    case POP_MARK: return PopMark();
    case DUP: CKPTFS_RETURN_IF_ERROR(Top(&a)); return Push(a);

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

    case BINUNICODE: return PushCounted(4, K::kStr);
    case SHORT_BINUNICODE: return PushCounted(1, K::kStr);
    case BINUNICODE8: return PushCounted(8, K::kStr);
    case SHORT_BINSTRING: return PushCounted(1, K::kStr);
    case BINSTRING: return PushCounted(4, K::kStr);
    case BINBYTES: return PushCounted(4, K::kBytes);
    case SHORT_BINBYTES: return PushCounted(1, K::kBytes);
    case BINBYTES8: case BYTEARRAY8: return PushCounted(8, K::kBytes);
    case UNICODE: if (!r_.Line(&text)) return Truncated(); return PushStr(text, K::kStr);
    case STRING: {
      if (!r_.Line(&text)) return Truncated();
      if (text.size() >= 2 && (text.front() == '\'' || text.front() == '"') && text.back() == text.front())
        text = text.substr(1, text.size() - 2);
      return PushStr(text, K::kStr);
    }

    case EMPTY_TUPLE: return PushTuple({});
    case TUPLE1: case TUPLE2: case TUPLE3: {
      size_t n = op - TUPLE1 + 1;
      if (stack_.size() < Floor() + n) return Fail("stack underflow");
      scratch_.assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
      stack_.resize(stack_.size() - n);
      return PushTuple(scratch_);
    }
    case TUPLE: CKPTFS_RETURN_IF_ERROR(PopMark()); return PushTuple(scratch_);
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
        CKPTFS_RETURN_IF_ERROR(Call(a, b, nullptr));
        if (sizes_.size() < kMaxInterned) {
          B::SetInterned(stack_.back());
          sizes_.emplace(b, stack_.back());
        }
        return Status::OK();
      }
      return Call(a, b, nullptr);
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
      return Call(a, b, nullptr);
    }
    case OBJ: {
      CKPTFS_RETURN_IF_ERROR(PopMark());
      if (scratch_.empty()) return Fail("OBJ without a class");
      a = scratch_.front();
      CKPTFS_RETURN_IF_ERROR(PushTuple(std::span<const PyRef>(scratch_).subspan(1)));
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      return Call(a, b, nullptr);
    }
    case BUILD: {
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Top(&a));
      Mutable(&a);
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

    case EXT1: case EXT2: case EXT4:
      return Status::NotSupported(where_, "pickle uses the copyreg extension registry (EXT opcodes)");
    case NEXT_BUFFER: case READONLY_BUFFER:
      return Status::NotSupported(where_, "pickle uses out-of-band buffers (protocol 5)");
    default: {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02x", op);
      return Fail(std::string("unknown opcode ") + hex);
    }
  }
}

}  // namespace

std::string PyValue::CallableName() const {
  const PyValue* c = callable();
  if (!c || c->kind() != Kind::kGlobal) return "";
  return std::string(c->s()) + "." + std::string(c->name());
}

void* Pickle::Allocate(size_t bytes) {
  bytes = (bytes + 7) & ~size_t{7};
  if (bytes > kMaxBlock / 4) {
    // A large array gets a block of its own; the current block keeps serving small ones.
    blocks_.push_back(std::unique_ptr<std::byte[]>(new std::byte[bytes]));
    arena_bytes_ += bytes;
    return blocks_.back().get();
  }
  if (bytes > left_in_block_) {
    const size_t size = std::max(next_block_, bytes);
    blocks_.push_back(std::unique_ptr<std::byte[]>(new std::byte[size]));
    cursor_ = blocks_.back().get();
    left_in_block_ = size;
    arena_bytes_ += size;
    next_block_ = std::min(kMaxBlock, next_block_ * 2);
  }
  void* at = cursor_;
  cursor_ += bytes;
  left_in_block_ -= bytes;
  return at;
}

Pickle::Pickle(Pickle&& other) noexcept { *this = std::move(other); }

Pickle& Pickle::operator=(Pickle&& other) noexcept {
  if (this != &other) {
    root = other.root;
    blocks_ = std::move(other.blocks_);
    cursor_ = other.cursor_;
    left_in_block_ = other.left_in_block_;
    next_block_ = other.next_block_;
    arena_bytes_ = other.arena_bytes_;
    values_ = other.values_;
    other.Clear();
  }
  return *this;
}

void Pickle::Clear() {
  root = nullptr;
  blocks_.clear();
  cursor_ = nullptr;
  left_in_block_ = arena_bytes_ = values_ = 0;
  next_block_ = kFirstBlock;
}

Status ParseOwnedPickle(std::string bytes, std::string_view where, Pickle* result, uint64_t memory_limit,
                        PickleEnd* end) {
  return ParsePickle(bytes, where, result, memory_limit, end);
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
