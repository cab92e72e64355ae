// libFuzzer target: the symbolic pickle machine (src/codec/pickle.*) on arbitrary bytes.
// Invariants: a successful parse has a root; every value reachable from it (values may
// be shared or cyclic) is well-formed for its kind and its string views are readable
// (ASan catches views into freed or foreign memory); parsing is deterministic.
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "codec/pickle.hpp"
#include "fuzz_common.hpp"

using namespace ckptfs;

namespace {

uint64_t Touch(std::string_view s) {  // reads every byte of a view
  uint64_t h = s.size();
  for (char c : s) h = h * 131 + static_cast<uint8_t>(c);
  return h;
}

// Walks the value graph without recursion, visiting each value once; returns a hash of
// its shape so two parses can be compared.
uint64_t Walk(const Pickle& p) {
  std::unordered_set<const PyValue*> seen;
  std::vector<const PyValue*> stack{p.root};
  uint64_t h = 0;
  while (!stack.empty()) {
    const PyValue* v = stack.back();
    stack.pop_back();
    if (!v || !seen.insert(v).second) continue;
    FUZZ_CHECK(seen.size() <= p.value_count());  // every value lives in the arena
    h = h * 1000003 + static_cast<uint64_t>(v->kind()) + Touch(v->s()) + Touch(v->name()) + v->items().size();
    switch (v->kind()) {
      case PyValue::Kind::kGlobal:
        FUZZ_CHECK(v->callable() == nullptr);
        break;
      case PyValue::Kind::kObject:
        (void)v->CallableName();
        break;
      default:
        break;
    }
    for (const PyValue* c : v->items()) stack.push_back(c);
    for (const auto& [k, val] : v->entries()) stack.push_back(k), stack.push_back(val);
    stack.push_back(v->callable());
    stack.push_back(v->args());
    stack.push_back(v->kwargs());
    stack.push_back(v->state());
  }
  return h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  Pickle p;
  Status st = ParsePickle(bytes, "fuzz.pkl", &p, 64u << 20);
  if (!st.ok()) {
    FUZZ_CHECK(!st.message().empty());
    return 0;
  }
  FUZZ_CHECK(p.root != nullptr);
  const uint64_t h = Walk(p);
  // The same bytes parse to the same graph; a moved Pickle keeps every view valid.
  Pickle again;
  FUZZ_CHECK(ParsePickle(bytes, "fuzz.pkl", &again, 64u << 20).ok());
  Pickle moved = std::move(again);
  FUZZ_CHECK(Walk(moved) == h);
  return 0;
}
