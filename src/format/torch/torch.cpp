// Reader for plain torch.save checkpoints (torch >= 1.6): the pickled object is walked,
// tensors become catalog tensors, containers are flattened to dotted keys, and every other
// value becomes JSON metadata.
// The flattening (FlattenTorchObject) is shared with the readers of legacy streams and
// TorchScript archives, which resolve storages their own way.
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "format/readers.hpp"
#include "format/torch/torch_archive.hpp"
#include "format/torch/torch_distributed.hpp"
#include "io/page_prefault.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// Real checkpoints nest a handful of levels; deeper means a cycle or an attack.
constexpr int kMaxDepth = 256;

// What marks a value as tensor data (doc/FORMATS.md, "Objects that hold tensors"): a call
// of a torch rebuild function (torch._utils._rebuild_*, torch._tensor._rebuild_*, served or
// not), a streamed parse's taken tensor, or a storage persistent id. nullptr for anything
// else.
const char* TensorMarker(const PyValue* v) {
  switch (v->kind()) {
    case Kind::kTaken: return "a tensor";
    case Kind::kPersistent: {
      const PyValue* pid = v->args();
      if (pid && pid->kind() == Kind::kTuple && !pid->items().empty() && pid->items()[0]->kind() == Kind::kStr &&
          pid->items()[0]->s() == "storage")
        return "a storage";
      return nullptr;
    }
    case Kind::kObject: {
      const PyValue* c = v->callable();
      if (c && c->kind() == Kind::kGlobal && (c->s() == "torch._utils" || c->s() == "torch._tensor") &&
          c->name().starts_with("_rebuild_"))
        return "a tensor";
      return nullptr;
    }
    default: return nullptr;
  }
}

// Whether anything reachable from `v` is tensor data (TensorMarker). Each value is looked at
// once; `visit` charges the walk's budget.
Status HoldsTensors(const PyValue* v, const std::function<Status()>& visit, bool* holds) {
  *holds = false;
  std::vector<const PyValue*> stack = {v};
  std::unordered_set<const PyValue*> seen;
  while (!stack.empty()) {
    const PyValue* x = stack.back();
    stack.pop_back();
    if (!x || !seen.insert(x).second) continue;
    CKPTFS_RETURN_IF_ERROR(visit());
    if (TensorMarker(x)) {
      *holds = true;
      return Status::OK();
    }
    for (const PyValue* item : x->items()) stack.push_back(item);
    for (const auto& [k, val] : x->entries()) {
      stack.push_back(k);
      stack.push_back(val);
    }
    if (x->kind() == Kind::kObject) {
      stack.push_back(x->args());
      stack.push_back(x->kwargs());
      stack.push_back(x->state());
    }
  }
  return Status::OK();
}

// The Python attributes a served tensor carries beside its data: the `state` of
// _rebuild_parameter_with_state and of _rebuild_from_type_v2, at any level of the call.
// They are not served; tensors there are refused.
void TensorStates(const PyValue* v, int depth, std::vector<const PyValue*>* out) {
  if (v->kind() != Kind::kObject || depth > 16) return;
  const PyValue* c = v->callable();
  if (IsGlobal(c, "torch._utils._rebuild_parameter") || IsGlobal(c, "torch._utils._rebuild_parameter_with_state")) {
    if (IsGlobal(c, "torch._utils._rebuild_parameter_with_state") && Arg(v, 3)) out->push_back(Arg(v, 3));
    if (Arg(v, 0)) TensorStates(Arg(v, 0), depth + 1, out);
  } else if (IsGlobal(c, "torch._tensor._rebuild_from_type_v2")) {
    if (Arg(v, 3)) out->push_back(Arg(v, 3));
  }
}

// A plain Python object whose attributes are its data: made by calling its class with no
// arguments (NEWOBJ or REDUCE of `cls()`, protocol 0-1's copyreg._reconstructor(cls,
// object, None), INST), then given a dict by BUILD (or nothing). argparse.Namespace,
// dataclasses, a whole nn.Module (torch.save(model)) and TorchScript's modules are of
// this form. torch.distributed's classes (DTensor's specs, device meshes, ShardedTensor's
// shards) are not: their tensors have a layout of their own, which only a recogniser of
// that class may serve.
bool IsAttributeObject(const PyValue* v) {
  if (v->kind() != Kind::kObject || v->kwargs()) return false;
  const PyValue* cls = v->callable();
  const PyValue* args = v->args();
  if (!cls || cls->kind() != Kind::kGlobal || !args || args->kind() != Kind::kTuple) return false;
  if (IsGlobal(cls, "copyreg._reconstructor")) {
    if (args->items().size() != 3 || !IsGlobal(args->items()[1], "builtins.object") ||
        args->items()[2]->kind() != Kind::kNone)
      return false;
    cls = args->items()[0];
    if (cls->kind() != Kind::kGlobal) return false;
  } else if (!args->items().empty()) {
    return false;
  }
  if (cls->s() == "torch.distributed" || cls->s().starts_with("torch.distributed.") || cls->s() == "torch._utils" ||
      cls->s() == "torch._tensor")
    return false;
  return !v->state() || v->state()->kind() == Kind::kDict;
}

// The attribute dict of a pickled torch.nn.Module (an attribute object whose dict holds the
// mappings _parameters, _buffers and _modules, as Module.__init__ sets them), or nullptr.
const PyValue* ModuleState(const PyValue* v) {
  if (!IsAttributeObject(v) || !v->state()) return nullptr;
  const PyValue* state = AsMapping(v->state());
  for (std::string_view part : {"_parameters", "_buffers", "_modules"})
    if (!AsMapping(Find(state, part))) return nullptr;
  return state;
}

// The attributes Module.__init__ sets that are not the model's: the state_dict is made of
// _parameters, _buffers and _modules; the hooks are functions.
bool IsModuleInternal(std::string_view name) {
  static constexpr std::string_view kInternal[] = {
      "training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules", "_backward_pre_hooks",
      "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
      "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
      "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"};
  return std::find(std::begin(kInternal), std::end(kInternal), name) != std::end(kInternal);
}

// A tensor met where the walk serves none: a dict key, an attribute object's set or appended
// items (a dict or list subclass).
constexpr std::string_view kTensorServedNowhere = "a tensor where ckptfs serves none (a dict key, or an item of an object)";

// How a refusal names a path: the flattened key, or the saved object itself.
std::string Where(const std::vector<PathElement>& path) {
  return path.empty() ? std::string("the saved object") : "'" + FlattenKey(path) + "'";
}

// What the refusal of object `v` says it is.
std::string Describe(const PyValue* v) {
  const PyValue* c = v->callable();
  if (IsGlobal(c, "torch._tensor._rebuild_from_type_v2")) {
    const PyValue* func = Arg(v, 0);
    const PyValue* type = Arg(v, 1);
    return "a tensor of class " + (type && type->kind() == Kind::kGlobal ? QualifiedName(type) : std::string("?")) +
           " rebuilt by " + (func && func->kind() == Kind::kGlobal ? QualifiedName(func) : std::string("?"));
  }
  if (const char* marker = TensorMarker(v)) {
    (void)marker;
    return "a tensor rebuilt by " + QualifiedName(c);
  }
  const std::string cls = v->CallableName();
  if (IsGlobal(c, "copyreg._reconstructor") && Arg(v, 0) && Arg(v, 0)->kind() == Kind::kGlobal)
    return "an object of class " + QualifiedName(Arg(v, 0)) + " holding tensors";
  return cls.empty() ? std::string("an object holding tensors") : "an object of class " + cls + " holding tensors";
}

// Streams the parse of a torch.save archive's data.pkl: each tensor rebuild call becomes a
// catalog entry as soon as the parse makes it (key and path still empty), in parse order,
// and the call a kTaken value naming it. The flattening then gives the entries their keys
// and puts them in the order of its walk (TorchZipReader). Resolves storages through the
// archive, and the taken values to their entries.
class TensorStream : public PickleCallHook, public StorageResolver {
 public:
  TensorStream(const TorchArchive& archive, Catalog* catalog, const ReadLimits& limits)
      : archive_(archive), catalog_(catalog), first_(catalog->tensors.size()), limits_(limits) {}

  Status OnCall(const PyValue* call, bool* take, uint64_t* index) override;
  Status Resolve(const PyValue* pid, std::optional<DType> tensor_dtype, DType* dtype, std::string* storage_id,
                 StorageBytes* bytes) const override {
    return archive_.Resolve(pid, tensor_dtype, dtype, storage_id, bytes);
  }
  const std::string& path() const override { return archive_.path(); }
  const TensorEntry* Taken(uint64_t index) const override {
    return index < taken_ ? &catalog_->tensors[first_ + index] : nullptr;
  }
  // The catalog's entries before this archive's.
  size_t first() const { return first_; }
  size_t taken() const { return taken_; }
  // Ends the populating of the catalog's reserved entries (before anything may grow the
  // array past them, which would free them).
  void StopPrefault() { prefault_.Stop(); }

 private:
  const TorchArchive& archive_;
  Catalog* catalog_;
  size_t first_;
  size_t taken_ = 0;
  ReadLimits limits_;
  PagePrefault prefault_;
};

// Whether the rebuild call `v` reads only values the rest of the pickle can no longer
// change. A size or stride given as a list could be appended to after the call (through
// the memo): such a call is resolved when the object is walked, as without streaming.
bool RebuildInputsFixed(const PyValue* v, int depth) {
  if (v->kind() != Kind::kObject || depth > 16 || !v->callable() || v->callable()->kind() != Kind::kGlobal) return true;
  const PyValue* callable = v->callable();
  if (IsGlobal(callable, "torch._utils._rebuild_parameter") ||
      IsGlobal(callable, "torch._utils._rebuild_parameter_with_state")) {
    const PyValue* data = Arg(v, 0);
    return !data || RebuildInputsFixed(data, depth + 1);
  }
  if (IsGlobal(callable, "torch._tensor._rebuild_from_type_v2")) {
    const PyValue* func = Arg(v, 0);
    const PyValue* args = Arg(v, 2);
    if (!func || !args) return true;
    PyObjectBody body{const_cast<PyValue*>(func), const_cast<PyValue*>(args)};
    const PyValue inner = PyValue::CallOf(&body);
    return RebuildInputsFixed(&inner, depth + 1);
  }
  for (size_t i : {size_t{2}, size_t{3}}) {
    const PyValue* dims = Arg(v, i);
    if (dims && IsCall(dims, "torch.Size")) dims = Arg(dims, 0);
    if (dims && dims->kind() == Kind::kList) return false;
  }
  return true;
}

Status TensorStream::OnCall(const PyValue* call, bool* take, uint64_t* index) {
  *take = false;
  // Only torch's own rebuild functions make tensors: skip everything else at once.
  const PyValue* callable = call->callable();
  if (!callable || callable->kind() != Kind::kGlobal || (callable->s() != "torch._utils" && callable->s() != "torch._tensor"))
    return Status::OK();
  if (!RebuildInputsFixed(call, 0)) return Status::OK();
  // A tensor whose Python attributes hold tensors is left to the walk, which refuses it.
  std::vector<const PyValue*> states;
  TensorStates(call, 0, &states);
  for (const PyValue* state : states) {
    bool holds = false;
    CKPTFS_RETURN_IF_ERROR(HoldsTensors(state, [] { return Status::OK(); }, &holds));
    if (holds) return Status::OK();
  }
  // A parameter around a tensor already taken is that tensor.
  if ((IsGlobal(callable, "torch._utils._rebuild_parameter") ||
       IsGlobal(callable, "torch._utils._rebuild_parameter_with_state")) &&
      Arg(call, 0) && Arg(call, 0)->kind() == Kind::kTaken) {
    *take = true;
    *index = Arg(call, 0)->taken();
    return Status::OK();
  }
  TensorEntry t;
  bool is_tensor = false;
  CKPTFS_RETURN_IF_ERROR(RebuildTensor(call, *this, &t, &is_tensor));
  if (!is_tensor) return Status::OK();
  if (taken_ == 0) {
    // About one tensor per stored record: reserved, the catalog is not copied as it grows
    // (a million tensors' vector held its old and new copies, ~260 MB, at the parse's peak).
    std::vector<TensorEntry>& tensors = catalog_->tensors;
    tensors.reserve(first_ + std::min<size_t>(archive_.zip().entries().size(), limits_.tensors));
    // A million entries are ~180 MB of fresh pages, whose first-write faults cost the
    // parsing thread ~0.1 s: populated on another core while this one parses.
    prefault_.Start(tensors.data() + tensors.size(), (tensors.capacity() - tensors.size()) * sizeof(TensorEntry));
  }
  // The flattening reports the limit with the reader's message (a parse again without
  // streaming); this only bounds what the parse makes.
  if (first_ + taken_ >= limits_.tensors) return Status::Refused(archive_.path(), "too many tensors to stream");
  // More tensors than records (storages shared): growing the array frees what is populated.
  if (catalog_->tensors.size() == catalog_->tensors.capacity()) prefault_.Stop();
  catalog_->tensors.push_back(std::move(t));
  *index = taken_++;
  *take = true;
  return Status::OK();
}

// Flattens one torch pickle's object; its tensors resolve through `storages`. With a
// `stream`, the pickle was parsed through it: kTaken values are its entries.
class TorchZipReader {
 public:
  // With a `sink`, DTensors and ShardedTensors go to it instead of being served as local shards.
  TorchZipReader(const StorageResolver& storages, Catalog* catalog, const ReadLimits& limits,
                 const TensorStream* stream = nullptr, DistributedTensorSink* sink = nullptr)
      : storages_(storages), path_(storages.path()), catalog_(catalog), limits_(limits), stream_(stream), sink_(sink) {}

  // `walked`, when given, is called once the walk no longer needs the pickle's values, before
  // the keys are checked (the pickle can be freed then).
  Status Read(const PyValue* root, size_t value_count, json* metadata, const std::function<void()>& walked = {});

 private:
  Status Walk(const PyValue* v, std::vector<PathElement>* path, int depth, json* out, bool* keep);
  Status WalkOpaque(const PyValue* v, std::vector<PathElement>* path, int depth, json* out);
  Status WalkModule(const PyValue* v, const PyValue* state, std::vector<PathElement>* path, int depth, json* out);
  // The rule of the torch readers (doc/FORMATS.md, "Objects that hold tensors"): object `v`,
  // which is neither a served tensor nor a mapping nor a plain attribute object, is refused
  // at `path` when it holds tensors. Walk's one point of refusal; recognisers of objects with
  // a tensor layout of their own are tried before it.
  Status RefuseIfHoldsTensors(const PyValue* v, const std::vector<PathElement>& path);
  // Refusal of what the walker met at `path` and cannot serve.
  Status NotUnderstood(const std::vector<PathElement>& path, const std::string& what) const {
    return Status::NotSupported(path_, Where(path) + ": " + what + "; ckptfs does not know how to serve it");
  }
  Status Holds(const PyValue* v, bool* holds) {
    return HoldsTensors(v, [this] { return Visit(); }, holds);
  }
  // A DTensor or ShardedTensor at `path` (*found): its local shards served under
  // <key>.local_shards.<i> and described in *out, or handed to the sink.
  Status WalkDistributed(const PyValue* v, std::vector<PathElement>* path, json* out, bool* found);
  Status AddTensor(TensorEntry t, const std::vector<PathElement>& path);
  // A streamed entry met at `path`: its first place names it, any other gets a copy.
  Status AddTaken(uint64_t index, const std::vector<PathElement>& path);
  // Puts the streamed entries in the order the walk met them, dropping those it never met.
  Status PutInWalkOrder();
  Status Bad(const std::string& what) const { return Status::Corruption(path_, what); }
  // Memo references make the object graph a DAG: a pickle of a few KB can reference one
  // list from two places at each of 200 levels, 2^200 paths. Every node visit is charged.
  Status Visit() {
    if (visits_left_ == 0)
      return Status::Refused(path_, "the pickled objects reference each other so often that flattening them "
                                    "would visit more than " + std::to_string(visit_budget_) + " nodes");
    --visits_left_;
    return Status::OK();
  }

  const StorageResolver& storages_;
  std::string path_;  // how messages name the archive
  Catalog* catalog_;
  ReadLimits limits_;
  uint64_t visit_budget_ = 0, visits_left_ = 0;
  const TensorStream* stream_;
  DistributedTensorSink* sink_;
  // With a stream: the catalog entries in walk order (indices into catalog_->tensors), and
  // which streamed entries the walk has named.
  std::vector<uint32_t> walk_order_;
  std::vector<bool> named_;
  // Above 0 while the walk is inside an object found to hold no tensor: nothing below it
  // needs looking at again.
  int tensor_free_ = 0;
};

}  // namespace

Status TorchZipReader::Read(const PyValue* root, size_t value_count, json* metadata,
                           const std::function<void()>& walked) {
  // A tree visits each value once; tied weights and shared configs add a little.
  visit_budget_ = visits_left_ = 4 * static_cast<uint64_t>(value_count) + 1'000'000;
  const size_t first_tensor = stream_ ? stream_->first() : catalog_->tensors.size();
  if (stream_) {
    // Indices are 32-bit (a catalog of 2^32 tensors would not fit in memory anyway).
    if (catalog_->tensors.size() >= UINT32_MAX) return Bad("too many tensors to stream");
    named_.assign(stream_->taken(), false);
  }
  std::vector<PathElement> path;
  bool keep = false;
  CKPTFS_RETURN_IF_ERROR(Walk(root, &path, 0, metadata, &keep));
  if (!keep) *metadata = json::object();
  if (stream_) CKPTFS_RETURN_IF_ERROR(PutInWalkOrder());
  if (walked) walked();
  // Two tensors whose paths flatten to one key (e.g. {"a.b": x, "a": {"b": y}}) cannot
  // both be served.
  if (std::optional<size_t> repeated = FindRepeatedKey(catalog_->tensors, first_tensor))
    return Status::NotSupported(path_, "two tensors flatten to the same key '" + catalog_->tensors[*repeated].key + "'");
  return Status::OK();
}

Status TorchZipReader::AddTensor(TensorEntry t, const std::vector<PathElement>& path) {
  const size_t count = stream_ ? stream_->first() + walk_order_.size() : catalog_->tensors.size();
  if (count >= limits_.tensors)
    return Status::Refused(path_, "more than " + std::to_string(limits_.tensors) + " tensors")
        .WithLimitOption("max_tensors");
  t.path = path;
  t.key = path.empty() ? "tensor" : FlattenKey(path);
  if (stream_) {
    if (catalog_->tensors.size() >= UINT32_MAX) return Bad("too many tensors to stream");
    walk_order_.push_back(static_cast<uint32_t>(catalog_->tensors.size()));
  }
  catalog_->tensors.push_back(std::move(t));
  return Status::OK();
}

Status TorchZipReader::AddTaken(uint64_t index, const std::vector<PathElement>& path) {
  if (index >= named_.size()) return Bad("internal: a streamed tensor out of range");
  const size_t at = stream_->first() + static_cast<size_t>(index);
  if (named_[index]) {
    // Met again (memo references to one tensor): a copy of the entry, named here.
    TensorEntry copy;
    copy.dtype = catalog_->tensors[at].dtype;
    copy.shape = catalog_->tensors[at].shape;
    copy.boxes = catalog_->tensors[at].boxes;
    copy.storage_id = catalog_->tensors[at].storage_id;
    return AddTensor(std::move(copy), path);
  }
  if (stream_->first() + walk_order_.size() >= limits_.tensors)
    return Status::Refused(path_, "more than " + std::to_string(limits_.tensors) + " tensors")
        .WithLimitOption("max_tensors");
  named_[index] = true;
  TensorEntry& t = catalog_->tensors[at];
  t.path = path;
  t.key = path.empty() ? "tensor" : FlattenKey(path);
  walk_order_.push_back(static_cast<uint32_t>(at));
  return Status::OK();
}

Status TorchZipReader::PutInWalkOrder() {
  std::vector<TensorEntry>& tensors = catalog_->tensors;
  const size_t first = stream_->first();
  const size_t n = tensors.size() - first;
  const size_t met = walk_order_.size();
  // source_of[k]: the entry (relative to `first`) that goes to place k: those the walk met
  // in its order, then the others (dropped below).
  std::vector<uint32_t> source_of(n);
  std::vector<bool> placed(n, false);
  for (size_t k = 0; k < walk_order_.size(); ++k) {
    source_of[k] = walk_order_[k] - static_cast<uint32_t>(first);
    placed[source_of[k]] = true;
  }
  size_t k = walk_order_.size();
  for (size_t i = 0; i < n; ++i)
    if (!placed[i]) source_of[k++] = static_cast<uint32_t>(i);
  walk_order_ = std::vector<uint32_t>();
  placed = std::vector<bool>();
  // Applied in place, one cycle of the permutation at a time (moves, no copies).
  constexpr uint32_t kDone = UINT32_MAX;
  for (size_t start = 0; start < n; ++start) {
    if (source_of[start] == kDone) continue;
    if (source_of[start] == start) {
      source_of[start] = kDone;
      continue;
    }
    TensorEntry held = std::move(tensors[first + start]);
    size_t to = start;
    for (;;) {
      const size_t from = source_of[to];
      source_of[to] = kDone;
      if (from == start) {
        tensors[first + to] = std::move(held);
        break;
      }
      tensors[first + to] = std::move(tensors[first + from]);
      to = from;
    }
  }
  tensors.erase(tensors.begin() + static_cast<std::ptrdiff_t>(first + met), tensors.end());
  return Status::OK();
}

Status TorchZipReader::Walk(const PyValue* v, std::vector<PathElement>* path, int depth, json* out, bool* keep) {
  CKPTFS_RETURN_IF_ERROR(Visit());
  if (depth > kMaxDepth) return Bad("objects nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  *keep = true;
  if (v->kind() == Kind::kTaken && stream_) {
    *keep = false;
    return AddTaken(v->taken(), *path);
  }
  bool distributed = false;
  CKPTFS_RETURN_IF_ERROR(WalkDistributed(v, path, out, &distributed));
  if (distributed) {
    *keep = !out->is_null();
    return Status::OK();
  }
  TensorEntry t;
  bool is_tensor = false;
  CKPTFS_RETURN_IF_ERROR(RebuildTensor(v, storages_, &t, &is_tensor));
  if (is_tensor) {
    std::vector<const PyValue*> states;
    TensorStates(v, 0, &states);
    for (const PyValue* state : states) {
      bool holds = false;
      CKPTFS_RETURN_IF_ERROR(Holds(state, &holds));
      if (holds) return NotUnderstood(*path, "tensors among the Python attributes of a tensor");
    }
    *keep = false;
    return AddTensor(std::move(t), *path);
  }

  // Mappings: dict, OrderedDict(...) and defaultdict(...) with items, and BUILD-wrapped dicts.
  if (const PyValue* mapping = AsMapping(v)) {
    if (v->kind() == Kind::kObject) {
      // Only the entries are served: tensors in the object's other parts (attributes set by
      // BUILD, arguments other than a defaultdict's factory, appended items) are refused.
      const bool factory = IsCall(v, "collections.defaultdict") && v->args() && v->args()->items().size() <= 1 &&
                           (v->args()->items().empty() || !TensorMarker(v->args()->items()[0]));
      const PyValue items = PyValue::ListOf(v->items());
      const PyValue* parts[] = {factory || v->args() == mapping ? nullptr : v->args(), v->kwargs(), v->state(),
                                v->items().empty() ? nullptr : &items};
      for (const PyValue* part : parts) {
        bool holds = false;
        if (part) CKPTFS_RETURN_IF_ERROR(Holds(part, &holds));
        if (holds) return NotUnderstood(*path, "tensors in a mapping's attributes or arguments, not among its items");
      }
    }
    *out = json::object();
    bool dropped = false;
    for (const auto& [k, val] : mapping->entries()) {
      PathElement elem;
      if (k->kind() == Kind::kStr) elem = std::string(k->s());
      else if (k->kind() == Kind::kInt) elem = k->i();
      else {
        // Tuple or float keys: their JSON text is the key.
        json key_json;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(k, path, depth + 1, &key_json));
        elem = key_json.dump(-1, ' ', false, json::error_handler_t::replace);
      }
      // Moved, not copied, and named only when kept: a state dict of a million tensors
      // made three copies of each key here.
      path->push_back(std::move(elem));
      json child;
      bool child_keep;
      CKPTFS_RETURN_IF_ERROR(Walk(val, path, depth + 1, &child, &child_keep));
      if (child_keep) {
        const PathElement& named = path->back();
        (*out)[std::holds_alternative<std::string>(named) ? std::get<std::string>(named)
                                                          : std::to_string(std::get<int64_t>(named))] = std::move(child);
      } else {
        dropped = true;
      }
      path->pop_back();
    }
    *keep = !(dropped && out->empty());
    return Status::OK();
  }
  if (v->kind() == Kind::kList || v->kind() == Kind::kTuple || v->kind() == Kind::kSet) {
    *out = json::array();
    bool any_kept = v->items().empty();
    for (size_t i = 0; i < v->items().size(); ++i) {
      path->push_back(static_cast<int64_t>(i));
      json child;
      bool child_keep;
      CKPTFS_RETURN_IF_ERROR(Walk(v->items()[i], path, depth + 1, &child, &child_keep));
      path->pop_back();
      out->push_back(child_keep ? std::move(child) : json(nullptr));  // keep list positions
      any_kept |= child_keep;
    }
    *keep = any_kept;
    return Status::OK();
  }
  if (const PyValue* module = ModuleState(v)) return WalkModule(v, module, path, depth, out);
  if (v->kind() == Kind::kObject && !IsAttributeObject(v)) {
    // Recognisers of objects that hold tensors in a layout of their own go here.
    if (tensor_free_ == 0) CKPTFS_RETURN_IF_ERROR(RefuseIfHoldsTensors(v, *path));
    // Found to hold none: nothing below needs looking at again.
    ++tensor_free_;
    Status s = WalkOpaque(v, path, depth, out);
    --tensor_free_;
    return s;
  }
  return WalkOpaque(v, path, depth, out);
}

Status TorchZipReader::RefuseIfHoldsTensors(const PyValue* v, const std::vector<PathElement>& path) {
  bool holds = false;
  CKPTFS_RETURN_IF_ERROR(Holds(v, &holds));
  return holds ? NotUnderstood(path, Describe(v)) : Status::OK();
}

Status TorchZipReader::WalkDistributed(const PyValue* v, std::vector<PathElement>* path, json* out, bool* found) {
  DistributedTensor d;
  CKPTFS_RETURN_IF_ERROR(RecognizeDistributedTensor(v, storages_, *path, found, &d));
  if (!*found) return Status::OK();
  if (sink_) {
    *out = nullptr;
    const size_t before = stream_ ? stream_->first() + walk_order_.size() : catalog_->tensors.size();
    return sink_->Add(std::move(d), *path, before);
  }
  std::vector<std::string> keys;
  path->push_back(std::string(kLocalShardsName));
  for (size_t i = 0; i < d.local.size(); ++i) {
    path->push_back(static_cast<int64_t>(i));
    const PyValue* value = d.local[i].value;
    Status added = value->kind() == Kind::kTaken && stream_ ? AddTaken(value->taken(), *path)
                                                            : AddTensor(std::move(d.local[i].tensor), *path);
    path->pop_back();
    if (!added.ok()) {
      path->pop_back();
      return added;
    }
    keys.push_back(catalog_->tensors[stream_ ? walk_order_.back() : catalog_->tensors.size() - 1].key);
  }
  path->pop_back();
  *out = d.Describe(keys);
  return Status::OK();
}

// A pickled torch.nn.Module, served as its state_dict() names it (torch's
// Module._save_to_state_dict and state_dict): its parameters, then its buffers but those in
// _non_persistent_buffers_set, then each child module under its attribute name, None entries
// left out, all under the module's own path. Its other attributes are not the state dict:
// their values go to the metadata, and tensors among them are served apart, under
// "$attributes." and the module's path. A module with state_dict hooks is refused: what its
// state_dict() names depends on running them.
Status TorchZipReader::WalkModule(const PyValue* v, const PyValue* state, std::vector<PathElement>* path, int depth,
                                  json* out) {
  CKPTFS_RETURN_IF_ERROR(Visit());
  if (depth > kMaxDepth) return Bad("objects nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  const std::string cls = IsGlobal(v->callable(), "copyreg._reconstructor") ? QualifiedName(Arg(v, 0)) : v->CallableName();
  for (std::string_view hooks : {"_state_dict_hooks", "_state_dict_pre_hooks"})
    if (const PyValue* m = AsMapping(Find(state, hooks)); m && !m->entries().empty())
      return NotUnderstood(*path, "a module (" + cls + ") with " + std::string(hooks) +
                                      ": the names its state_dict() gives depend on running them");
  std::vector<std::string_view> non_persistent;
  if (const PyValue* names = Find(state, "_non_persistent_buffers_set")) {
    const PyValue* set = names->kind() == Kind::kSet ? names : IsCall(names, "builtins.set") ? Arg(names, 0) : nullptr;
    if (!set && names->kind() != Kind::kNone) return NotUnderstood(*path, "a module's _non_persistent_buffers_set that is no set");
    if (set)
      for (const PyValue* name : set->items()) {
        if (name->kind() != Kind::kStr) return NotUnderstood(*path, "a module's non-persistent buffer named by a non-string");
        non_persistent.push_back(name->s());
      }
  }
  *out = json{{"$class", cls}};
  // Each entry of `mapping` under path + its name; kept values (not tensors) into (*out)[field].
  auto walk_named = [&](const PyValue* mapping, const char* field, bool skip_non_persistent) -> Status {
    for (const auto& [k, val] : mapping->entries()) {
      if (k->kind() != Kind::kStr) return NotUnderstood(*path, "a module entry named by a non-string");
      if (val->kind() == Kind::kNone) continue;
      if (skip_non_persistent && std::find(non_persistent.begin(), non_persistent.end(), k->s()) != non_persistent.end())
        continue;
      path->push_back(std::string(k->s()));
      json child;
      bool child_keep;  // a child module is walked as a module by Walk itself
      CKPTFS_RETURN_IF_ERROR(Walk(val, path, depth + 1, &child, &child_keep));
      path->pop_back();
      if (child_keep) (*out)[field][std::string(k->s())] = std::move(child);
    }
    return Status::OK();
  };
  CKPTFS_RETURN_IF_ERROR(walk_named(AsMapping(Find(state, "_parameters")), "parameters", false));
  CKPTFS_RETURN_IF_ERROR(walk_named(AsMapping(Find(state, "_buffers")), "buffers", true));
  CKPTFS_RETURN_IF_ERROR(walk_named(AsMapping(Find(state, "_modules")), "modules", false));
  // The other attributes, tensors among them under "$attributes." + the module's path.
  std::vector<PathElement> attribute_path;
  attribute_path.reserve(path->size() + 2);
  attribute_path.emplace_back(std::string("$attributes"));
  attribute_path.insert(attribute_path.end(), path->begin(), path->end());
  for (const auto& [k, val] : state->entries()) {
    if (k->kind() != Kind::kStr || IsModuleInternal(k->s())) continue;
    attribute_path.emplace_back(std::string(k->s()));
    json child;
    bool child_keep;
    CKPTFS_RETURN_IF_ERROR(Walk(val, &attribute_path, depth + 1, &child, &child_keep));
    attribute_path.pop_back();
    if (child_keep) (*out)["attributes"][std::string(k->s())] = std::move(child);
  }
  return Status::OK();
}

// Values that are not containers: scalars become JSON, unknown objects become an inspectable
// {"$class", "args", "state"} node. Tensor data met here (a tensor as a dict key, inside an
// attribute object's appended or set items) cannot be served: it is refused.
Status TorchZipReader::WalkOpaque(const PyValue* v, std::vector<PathElement>* path, int depth, json* out) {
  CKPTFS_RETURN_IF_ERROR(Visit());
  if (depth > kMaxDepth) return Bad("objects nested deeper than " + std::to_string(kMaxDepth) + " levels (a cycle?)");
  switch (v->kind()) {
    case Kind::kNone: *out = nullptr; return Status::OK();
    case Kind::kBool: *out = v->b(); return Status::OK();
    case Kind::kInt: *out = v->i(); return Status::OK();
    case Kind::kBigInt: *out = json{{"$int", v->s()}}; return Status::OK();
    case Kind::kFloat:
      if (std::isfinite(v->f())) *out = v->f();
      else *out = std::isnan(v->f()) ? "nan" : (v->f() > 0 ? "inf" : "-inf");
      return Status::OK();
    case Kind::kStr: *out = v->s(); return Status::OK();
    case Kind::kBytes: *out = json{{"$bytes", v->s().size()}}; return Status::OK();
    case Kind::kGlobal: *out = json{{"$global", QualifiedName(v)}}; return Status::OK();
    case Kind::kPersistent: {
      if (TensorMarker(v)) return NotUnderstood(*path, "a storage outside any tensor");
      json pid;
      std::vector<PathElement> none;
      CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->args(), &none, depth + 1, &pid));
      *out = json{{"$persistent_id", std::move(pid)}};
      return Status::OK();
    }
    case Kind::kTuple: case Kind::kList: case Kind::kSet: case Kind::kDict: {
      // Containers met inside an opaque call: record them without serving tensors.
      *out = v->kind() == Kind::kDict ? json::object() : json::array();
      for (const PyValue* item : v->items()) {
        json child;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(item, path, depth + 1, &child));
        out->push_back(std::move(child));
      }
      for (const auto& [k, val] : v->entries()) {
        json key, child;
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(k, path, depth + 1, &key));
        CKPTFS_RETURN_IF_ERROR(WalkOpaque(val, path, depth + 1, &child));
        // A key's JSON text may hold strings that are not UTF-8: dump() would throw.
        (*out)[key.is_string() ? key.get<std::string>() : key.dump(-1, ' ', false, json::error_handler_t::replace)] =
            std::move(child);
      }
      return Status::OK();
    }
    case Kind::kTaken: return NotUnderstood(*path, std::string(kTensorServedNowhere));
    case Kind::kObject: break;
  }
  const std::string cls = v->CallableName();
  if (cls == "torch.Size") {
    std::vector<uint64_t> dims;
    if (AsUintTuple(v, &dims)) { *out = dims; return Status::OK(); }
  }
  if (cls == "torch.device" && Arg(v, 0) && Arg(v, 0)->kind() == Kind::kStr) {
    *out = Arg(v, 0)->s();
    return Status::OK();
  }
  if (TensorMarker(v)) {
    TensorEntry t;
    bool is_tensor = false;
    CKPTFS_RETURN_IF_ERROR(RebuildTensor(v, storages_, &t, &is_tensor));
    return NotUnderstood(*path, is_tensor ? std::string(kTensorServedNowhere) : Describe(v));
  }
  *out = json::object();
  // Protocols 0-1 make a plain object as copyreg._reconstructor(cls, object, None): its class
  // is cls, and those arguments say nothing more.
  const bool reconstructed = IsGlobal(v->callable(), "copyreg._reconstructor") && Arg(v, 0) &&
                             Arg(v, 0)->kind() == Kind::kGlobal && Arg(v, 1) && IsGlobal(Arg(v, 1), "builtins.object") &&
                             Arg(v, 2) && Arg(v, 2)->kind() == Kind::kNone && v->args()->items().size() == 3;
  if (reconstructed) (*out)["$class"] = QualifiedName(Arg(v, 0));
  else if (!cls.empty()) (*out)["$class"] = cls;
  else if (v->callable()) {
    json callable;
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->callable(), path, depth + 1, &callable));
    (*out)["$call"] = std::move(callable);
  }
  if (v->args() && !reconstructed) CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->args(), path, depth + 1, &(*out)["args"]));
  if (v->kwargs()) CKPTFS_RETURN_IF_ERROR(WalkOpaque(v->kwargs(), path, depth + 1, &(*out)["kwargs"]));
  if (v->state()) {
    // Attributes (argparse.Namespace, dataclasses) are walked like a dict: tensors
    // kept there are served under the object's key.
    bool keep;
    CKPTFS_RETURN_IF_ERROR(Walk(v->state(), path, depth + 1, &(*out)["state"], &keep));
    if (!keep) out->erase("state");
  }
  // Set items (SETITEMS on the object: a dict subclass) go under "items" as a mapping,
  // appended items (APPENDS: a list subclass) under "appended" as a list. They must not share
  // one synthetic dict: pushing list items into a JSON object throws, which escaped the
  // reader as an uncaught exception (found by fuzz_torch, tests/fuzz/regressions/torch/).
  if (!v->entries().empty()) {
    const PyValue rest = PyValue::DictOf(v->entries());
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(&rest, path, depth + 1, &(*out)["items"]));
  }
  if (!v->items().empty()) {
    const PyValue rest = PyValue::ListOf(v->items());
    CKPTFS_RETURN_IF_ERROR(WalkOpaque(&rest, path, depth + 1, &(*out)["appended"]));
  }
  return Status::OK();
}

Status NoTensorsFromTensorData(size_t served, size_t stored, const std::string& path, std::string_view what) {
  if (served > 0 || stored == 0) return Status::OK();
  return Status::NotSupported(path, "holds " + std::to_string(stored) + " " + std::string(what) +
                                        " but no tensor ckptfs can serve: the object that holds them is not one it "
                                        "understands");
}

Status FlattenTorchObject(const PyValue* root, size_t value_count, const StorageResolver& storages,
                          Catalog* catalog, const ReadLimits& limits, json* metadata, DistributedTensorSink* sink) {
  TorchZipReader reader(storages, catalog, limits, nullptr, sink);
  return reader.Read(root, value_count, metadata);
}

namespace {

Status ReadTorchZipIn(const FileWindow& window, Catalog* catalog, json* metadata, const ReadLimits& limits,
                      ZipArchive* opened, DistributedTensorSink* sink = nullptr) {
  TorchArchive archive;
  // Streamed first: the parsed tree of a million tensors (~330 bytes each) is never alive
  // beside the catalog. Whatever fails streamed is read again without streaming, and that
  // outcome is reported, so streaming changes no result, only the memory it takes.
  TensorStream stream(archive, catalog, limits);
  Status streamed = archive.Open(*catalog->files, window, limits, ArchiveRecords{}, nullptr, {}, opened, &stream);
  stream.StopPrefault();
  if (streamed.ok()) {
    // Every tensor the walk serves is resolved by now (any other lookup fails the streamed
    // read, which is then read again).
    archive.ReleaseDirectory();
    TorchZipReader reader(stream, catalog, limits, &stream, sink);
    // The pickle's values (a million keys and taken tensors, ~90 MB) are freed before the
    // keys are checked, which adds its own scratch.
    streamed = reader.Read(archive.root(), archive.value_count(), metadata, [&archive] { archive.ReleasePickle(); });
  }
  if (!streamed.ok() && archive.streamed()) {
    catalog->tensors.erase(catalog->tensors.begin() + static_cast<std::ptrdiff_t>(stream.first()),
                           catalog->tensors.end());
    CKPTFS_RETURN_IF_ERROR(archive.ParseAgain());
    // About one tensor per stored record: reserved, the catalog is not copied as it grows
    // (a million tensors' vector held its old and new copies, ~260 MB, at the parse's peak).
    catalog->tensors.reserve(catalog->tensors.size() +
                             std::min<size_t>(archive.zip().entries().size(), limits.tensors));
    streamed = FlattenTorchObject(archive.root(), archive.value_count(), archive, catalog, limits, metadata, sink);
  }
  CKPTFS_RETURN_IF_ERROR(streamed);
  // A sink takes the distributed tensors, whose storages the catalog then does not serve:
  // the set of rank files checks what it consolidates.
  if (sink) return Status::OK();
  return NoTensorsFromTensorData(catalog->tensors.size() - stream.first(), archive.storage_records(), archive.path(),
                                 "storage records");
}

}  // namespace

Status ReadTorchZip(const FileWindow& window, Catalog* catalog, json* metadata, const ReadLimits& limits) {
  return ReadTorchZipIn(window, catalog, metadata, limits, nullptr);
}

Status ReadTorchZip(const std::string& path, Catalog* catalog, json* metadata, const ReadLimits& limits,
                    ZipArchive* opened) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  return ReadTorchZipIn(catalog->files->whole(file), catalog, metadata, limits, opened);
}

Status ReadTorchZipDistributed(const std::string& path, Catalog* catalog, json* metadata, const ReadLimits& limits,
                               DistributedTensorSink* sink) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  return ReadTorchZipIn(catalog->files->whole(file), catalog, metadata, limits, nullptr, sink);
}

namespace {

// Any zip the TorchScript and torch.export readers (tried first) did not take.
Status DetectTorchZip(SourceProbe& probe, bool* is_format) {
  *is_format = false;
  return probe.is_file() ? probe.HeadStartsWith(std::string_view("PK\x03\x04", 4), is_format) : Status::OK();
}

}  // namespace

extern const ReaderEntry kTorchZipReader = {
    "torch-zip", "torch .pt/.bin: a torch.save zip (torch >= 1.6)", {"torch-zip"}, DetectTorchZip,
    [](SourceProbe& p, const SourceOptions& o, Catalog* c) {
      return ReadTorchZip(p.source(), c, &c->metadata, o.limits, p.zip());
    }};

}  // namespace ckptfs
