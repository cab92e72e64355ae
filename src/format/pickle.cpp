#include "format/pickle.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "format/byte_reader.hpp"
#include "format/limit_hint.hpp"

namespace ckptfs {
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

  // What the parse holds so far: values, container slots, kept strings, stack, marks and
  // memo. Opcodes are 1-9 bytes but a value is ~150, and DUP/GET repeat references, so
  // without this bound a small hostile pickle could ask for unbounded memory.
  uint64_t MemoryInUse() const {
    return charged_ + (stack_.capacity() + marks_.capacity() + memo_.capacity()) * sizeof(PyRef) +
           sparse_memo_.size() * 64;
  }
  Status OverLimit() const {
    return Status::Refused(where_, "pickle: reading it would take more than " + std::to_string(memory_limit_) +
                                       " bytes of memory (at byte " + std::to_string(op_pos_) + ")" +
                                       LimitHint("max_pickle_memory"));
  }
  PyRef Make(PyValue::Kind kind) {
    charged_ += sizeof(PyValue);
    PyRef v = out_->New();
    v->kind = kind;
    return v;
  }
  Status Pop(PyRef* out) {
    if (stack_.size() <= Floor()) return Fail("stack underflow");
    *out = std::move(stack_.back());
    stack_.pop_back();
    return Status::OK();
  }
  Status Top(PyRef* out) {
    if (stack_.size() <= Floor()) return Fail("stack underflow");
    *out = stack_.back();
    return Status::OK();
  }
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Pops everything above the most recent MARK.
  Status PopMark(std::vector<PyRef>* out) {
    if (marks_.empty()) return Fail("MARK expected");
    size_t mark = marks_.back();
    marks_.pop_back();
    out->assign(std::make_move_iterator(stack_.begin() + mark), std::make_move_iterator(stack_.end()));
    stack_.resize(mark);
    return Status::OK();
  }
  Status Push(PyRef v) {
    stack_.push_back(std::move(v));
    return Status::OK();
  }
  // Values that are never mutated once made (None, bools, small ints, the empty tuple)
  // are shared: a checkpoint repeats them for every tensor.
  Status PushShared(PyRef* slot, PyValue::Kind kind, int64_t i) {
    if (!*slot) {
      *slot = Make(kind);
      (*slot)->i = i;
      (*slot)->b = i != 0;
    }
    return Push(*slot);
  }
  // Tuples are never mutated once made, so tuples of the same numbers are one value, as
  // are equal ints: a DCP .metadata makes three torch.Size tuples per chunk and a torch.save
  // pickle a shape and a stride tuple per tensor, nearly all repeats. Only tuples of numbers
  // (and of such tuples) are looked up: others (persistent ids, call arguments) rarely
  // repeat, and hashing them all would cost more than it saves. The tables stop growing at
  // kMaxInterned entries. An interned tuple has `b` set.
  static bool Internable(const std::vector<PyRef>& items) {
    for (const PyValue* item : items) {
      switch (item->kind) {
        case PyValue::Kind::kInt: case PyValue::Kind::kNone: case PyValue::Kind::kBool: case PyValue::Kind::kFloat:
          break;
        case PyValue::Kind::kTuple:
          if (item->b || item->items.empty()) break;
          return false;
        default: return false;
      }
    }
    return true;
  }
  Status PushTuple(std::vector<PyRef> items) {
    if (items.empty()) return PushShared(&empty_tuple_, PyValue::Kind::kTuple, 0);
    if (!Internable(items)) {
      auto t = Make(PyValue::Kind::kTuple);
      charged_ += items.size() * sizeof(PyRef);
      t->items = std::move(items);
      return Push(std::move(t));
    }
    PyValue probe;
    probe.kind = PyValue::Kind::kTuple;
    probe.items = std::move(items);
    if (auto it = tuples_.find(&probe); it != tuples_.end()) return Push(*it);
    auto t = Make(PyValue::Kind::kTuple);
    charged_ += probe.items.size() * sizeof(PyRef);
    t->items = std::move(probe.items);
    if (tuples_.size() < kMaxInterned) {
      t->b = true;
      tuples_.insert(t);
      charged_ += kInternedEntryBytes;
    }
    return Push(std::move(t));
  }
  Status PushInt(int64_t v) {
    if (v >= 0 && v < static_cast<int64_t>(small_ints_.size()))
      return PushShared(&small_ints_[static_cast<size_t>(v)], PyValue::Kind::kInt, v);
    if (auto it = ints_.find(v); it != ints_.end()) return Push(it->second);
    auto n = Make(PyValue::Kind::kInt);
    n->i = v;
    if (ints_.size() < kMaxInterned) {
      ints_.emplace(v, n);
      charged_ += kInternedEntryBytes;
    }
    return Push(std::move(n));
  }
  // The stack top `*v`, made safe to change: a shared (interned) object is replaced by a
  // copy of its own first.
  void Mutable(PyRef* v) {
    if ((*v)->kind != PyValue::Kind::kObject || !(*v)->b) return;
    PyRef copy = Make(PyValue::Kind::kObject);
    copy->callable = (*v)->callable;
    copy->args = (*v)->args;
    copy->kwargs = (*v)->kwargs;
    copy->state = (*v)->state;
    copy->items = (*v)->items;
    copy->entries = (*v)->entries;
    stack_.back() = copy;
    *v = copy;
  }
  struct ItemsHash {
    size_t operator()(const PyValue* t) const {
      size_t h = t->items.size();
      for (const PyValue* item : t->items) h = h * 0x9E3779B97F4A7C15ull + reinterpret_cast<uintptr_t>(item);
      return h ^ (h >> 29);
    }
  };
  struct ItemsEqual {
    bool operator()(const PyValue* a, const PyValue* b) const { return a->items == b->items; }
  };
  static constexpr size_t kMaxInterned = size_t{1} << 22;
  static constexpr uint64_t kInternedEntryBytes = 48;  // a hash node and its bucket slot
  // `s` must point into the pickle's kept bytes or a kept string.
  Status PushStr(std::string_view s, PyValue::Kind kind) {
    auto n = Make(kind);
    n->s = s;
    return Push(std::move(n));
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
  Status PushCounted(size_t width, PyValue::Kind kind) {
    uint64_t len = 0;
    CKPTFS_RETURN_IF_ERROR(ReadLen(width, &len));
    std::string_view s;
    r_.Bytes(len, &s);
    return PushStr(s, kind);
  }
  Status PushLong(std::string_view le_bytes);
  Status PushGlobal(std::string_view module, std::string_view name);
  Status Call(PyRef callable, PyRef args, PyRef kwargs);
  Status SetItems(std::vector<PyRef> kv);
  Status Append(std::vector<PyRef> values);
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
  PyRef none_ = nullptr, false_ = nullptr, true_ = nullptr, empty_tuple_ = nullptr;
  std::array<PyRef, 256> small_ints_{};
  uint64_t dense_limit_ = 0;
  std::vector<PyRef> memo_;
  std::unordered_map<uint64_t, PyRef> sparse_memo_;
  uint64_t memo_count_ = 0;  // distinct memo keys stored: MEMOIZE's next index
  uint64_t memory_limit_;
  uint64_t charged_ = 0;  // bytes of values and container slots made so far
  std::unordered_set<PyRef, ItemsHash, ItemsEqual> tuples_;
  std::unordered_map<int64_t, PyRef> ints_;
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
  charged_ += hex.size();
  return PushStr(out_->Keep(std::move(hex)), PyValue::Kind::kBigInt);
}

Status Machine::PushGlobal(std::string_view module, std::string_view name) {
  if (RunsCode(module, name))
    return Status::Refused(where_, "pickle references " + std::string(module) + "." + std::string(name) +
                                       ", which would run code when loaded; refusing it");
  auto g = Make(PyValue::Kind::kGlobal);
  g->s = module;
  g->name = name;
  return Push(std::move(g));
}

Status Machine::Call(PyRef callable, PyRef args, PyRef kwargs) {
  if (callable->kind == PyValue::Kind::kGlobal && callable->name == "getattr" &&
      (callable->s == "builtins" || callable->s == "__builtin__")) {
    // Only the Enum-member form, getattr(<class>, "<name>"), is data.
    const bool enum_member = args->kind == PyValue::Kind::kTuple && args->items.size() == 2 &&
                             args->items[0]->kind == PyValue::Kind::kGlobal &&
                             args->items[1]->kind == PyValue::Kind::kStr;
    if (!enum_member)
      return Status::Refused(where_, "pickle calls " + std::string(callable->s) +
                                         ".getattr on something other than a class attribute, which could run "
                                         "code when loaded; refusing it");
  }
  auto obj = Make(PyValue::Kind::kObject);
  obj->callable = std::move(callable);
  obj->args = std::move(args);
  obj->kwargs = std::move(kwargs);
  return Push(std::move(obj));
}

Status Machine::SetItems(std::vector<PyRef> kv) {
  if (kv.size() % 2 != 0) return Fail("odd number of items for SETITEMS");
  PyRef target = nullptr;
  CKPTFS_RETURN_IF_ERROR(Top(&target));
  Mutable(&target);
  if (target->kind != PyValue::Kind::kDict && target->kind != PyValue::Kind::kObject)
    return Fail("SETITEM on something that is not a dict");
  const size_t before = target->entries.capacity();
  if (target->entries.size() + kv.size() / 2 > before) target->entries.reserve(std::max(target->entries.size() + kv.size() / 2, before * 2));
  for (size_t k = 0; k < kv.size(); k += 2) {
    target->entries.emplace_back(std::move(kv[k]), std::move(kv[k + 1]));
  }
  charged_ += (target->entries.capacity() - before) * sizeof(target->entries[0]);
  return Status::OK();
}

Status Machine::Append(std::vector<PyRef> values) {
  PyRef target = nullptr;
  CKPTFS_RETURN_IF_ERROR(Top(&target));
  Mutable(&target);
  if (target->kind != PyValue::Kind::kList && target->kind != PyValue::Kind::kSet &&
      target->kind != PyValue::Kind::kObject)
    return Fail("APPEND to something that is not a list");
  const size_t before = target->items.capacity();
  for (auto& v : values) {
    target->items.push_back(std::move(v));
  }
  charged_ += (target->items.capacity() - before) * sizeof(PyRef);
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
  using K = PyValue::Kind;
  PyRef a = nullptr, b = nullptr, c = nullptr;
  std::vector<PyRef> items;
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
    case POP_MARK: return PopMark(&items);
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
      a = Make(K::kFloat);
      a->f = std::strtod(s.c_str(), &end);
      if (s.empty() || end != s.c_str() + s.size()) return Fail("bad float literal");
      return Push(a);
    }
    case BINFLOAT: {
      uint64_t be;
      if (!r_.U64(&be)) return Truncated();
      uint64_t bits = __builtin_bswap64(be);  // BINFLOAT is big-endian
      a = Make(K::kFloat);
      std::memcpy(&a->f, &bits, sizeof bits);
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
      items.assign(std::make_move_iterator(stack_.end() - n), std::make_move_iterator(stack_.end()));
      stack_.resize(stack_.size() - n);
      return PushTuple(std::move(items));
    }
    case TUPLE: CKPTFS_RETURN_IF_ERROR(PopMark(&items)); return PushTuple(std::move(items));
    case EMPTY_LIST: return Push(Make(K::kList));
    case LIST: {
      CKPTFS_RETURN_IF_ERROR(PopMark(&items));
      CKPTFS_RETURN_IF_ERROR(Push(Make(K::kList)));
      return Append(std::move(items));
    }
    case APPEND: CKPTFS_RETURN_IF_ERROR(Pop(&a)); items.push_back(a); return Append(std::move(items));
    case APPENDS: CKPTFS_RETURN_IF_ERROR(PopMark(&items)); return Append(std::move(items));
    case EMPTY_DICT: return Push(Make(K::kDict));
    case DICT: {
      CKPTFS_RETURN_IF_ERROR(PopMark(&items));
      CKPTFS_RETURN_IF_ERROR(Push(Make(K::kDict)));
      return SetItems(std::move(items));
    }
    case SETITEM:
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      return SetItems({a, b});
    case SETITEMS: CKPTFS_RETURN_IF_ERROR(PopMark(&items)); return SetItems(std::move(items));
    case EMPTY_SET: return Push(Make(K::kSet));
    case ADDITEMS: CKPTFS_RETURN_IF_ERROR(PopMark(&items)); return Append(std::move(items));
    case FROZENSET: {
      CKPTFS_RETURN_IF_ERROR(PopMark(&items));
      CKPTFS_RETURN_IF_ERROR(Push(Make(K::kSet)));
      return Append(std::move(items));
    }

    case GLOBAL: {
      std::string_view module, name;
      if (!r_.Line(&module) || !r_.Line(&name)) return Truncated();
      return PushGlobal(module, name);
    }
    case STACK_GLOBAL: {
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      if (a->kind != K::kStr || b->kind != K::kStr) return Fail("STACK_GLOBAL needs two strings");
      return PushGlobal(a->s, b->s);
    }
    case REDUCE:
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      if (b->kind != K::kTuple) return Fail("REDUCE arguments are not a tuple");
      // torch.Size of an interned tuple: a DCP .metadata makes three per chunk, nearly all
      // repeats. Shared like the tuple it wraps (`b` marks it); Mutable() copies it first
      // should a BUILD, SETITEMS or APPENDS ever target it.
      if (b->b && a->IsGlobal("torch", "Size")) {
        if (auto it = sizes_.find(b); it != sizes_.end()) return Push(it->second);
        CKPTFS_RETURN_IF_ERROR(Call(a, b, nullptr));
        if (sizes_.size() < kMaxInterned) {
          stack_.back()->b = true;
          sizes_.emplace(b, stack_.back());
          charged_ += kInternedEntryBytes;
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
      CKPTFS_RETURN_IF_ERROR(PopMark(&items));
      CKPTFS_RETURN_IF_ERROR(PushGlobal(module, name));
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      CKPTFS_RETURN_IF_ERROR(PushTuple(std::move(items)));
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      return Call(a, b, nullptr);
    }
    case OBJ: {
      CKPTFS_RETURN_IF_ERROR(PopMark(&items));
      if (items.empty()) return Fail("OBJ without a class");
      a = items.front();
      items.erase(items.begin());
      CKPTFS_RETURN_IF_ERROR(PushTuple(std::move(items)));
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      return Call(a, b, nullptr);
    }
    case BUILD: {
      CKPTFS_RETURN_IF_ERROR(Pop(&b));
      CKPTFS_RETURN_IF_ERROR(Top(&a));
      Mutable(&a);
      if (a->kind != K::kObject) {
        // BUILD on a plain container (a dict subclass reduced to dict) keeps the state aside.
        auto wrapper = Make(K::kObject);
        wrapper->callable = Make(K::kNone);
        wrapper->args = a;
        stack_.back() = wrapper;
        a = wrapper;
      }
      a->state = b;
      return Status::OK();
    }
    case PERSID: case BINPERSID: {
      if (op == PERSID) {
        if (!r_.Line(&text)) return Truncated();
        CKPTFS_RETURN_IF_ERROR(PushStr(text, K::kStr));
      }
      CKPTFS_RETURN_IF_ERROR(Pop(&a));
      b = Make(K::kPersistent);
      b->args = a;
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
  if (kind != Kind::kObject || !callable || callable->kind != Kind::kGlobal) return "";
  return std::string(callable->s) + "." + std::string(callable->name);
}

PyRef Pickle::New() {
  if (used_in_last_ == last_chunk_size_) {
    last_chunk_size_ = last_chunk_size_ == 0 ? kFirstChunk : std::min(kMaxChunk, last_chunk_size_ * 2);
    chunks_.push_back(std::make_unique<PyValue[]>(last_chunk_size_));
    used_in_last_ = 0;
  }
  ++values_;
  return &chunks_.back()[used_in_last_++];
}

std::string_view Pickle::Keep(std::string text) { return kept_.emplace_back(std::move(text)); }

std::string_view Pickle::KeepBytes(std::string_view bytes) {
  bytes_ = std::make_unique<char[]>(bytes.size());
  std::memcpy(bytes_.get(), bytes.data(), bytes.size());
  return std::string_view(bytes_.get(), bytes.size());
}

void Pickle::Clear() {
  root = nullptr;
  chunks_.clear();
  last_chunk_size_ = used_in_last_ = values_ = 0;
  bytes_.reset();
  kept_.clear();
}

Status ParsePickle(std::string_view bytes, std::string_view where, Pickle* result, uint64_t memory_limit,
                   PickleEnd* end) {
  result->Clear();
  Machine m(result->KeepBytes(bytes), where, result, memory_limit);
  Status status = m.Run();
  if (end) {
    end->consumed = m.consumed();
    end->needs_more = !status.ok() && m.ran_out();
  }
  return status;
}

}  // namespace ckptfs
