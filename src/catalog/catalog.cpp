// The catalog's value types: element counts of tensors and boxes, flattened keys.
#include "ckptfs/catalog.hpp"

#include <xxhash.h>

#include <algorithm>
#include <functional>
#include <utility>

namespace ckptfs {

uint64_t TensorEntry::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;  // readers and ValidateLayout reject shapes whose product overflows
  return n;
}

uint64_t Box::numel() const {
  uint64_t n = 1;
  for (uint64_t e : extent) n *= e;  // a valid box lies inside its tensor's shape
  return n;
}

Box Box::Range(uint32_t file, uint64_t base_offset, uint64_t first_element, uint64_t count) {
  Box box;
  box.file = file;
  box.base_offset = base_offset;
  box.offset = {first_element};
  box.extent = {count};
  box.strides = {1};
  return box;
}

Box Box::Strided(uint32_t file, uint64_t base_offset, BoxDims shape, BoxDims strides) {
  Box box;
  box.file = file;
  box.base_offset = base_offset;
  box.offset.assign(shape.size(), 0);
  box.extent = std::move(shape);
  box.strides = std::move(strides);
  return box;
}

BoxList::BoxList(std::vector<Box>&& boxes) {
  if (boxes.size() == 1) {
    one_ = std::move(boxes[0]);
    inline_count_ = 1;
  } else if (boxes.size() > 1) {
    many_ = std::move(boxes);
  }
}

void BoxList::push_back(Box box) {  // by value: `box` may be one of this list's own
  if (many_.empty()) {
    if (inline_count_ == 0) {
      one_ = std::move(box);
      inline_count_ = 1;
      return;
    }
    many_.reserve(2);
    many_.push_back(std::move(one_));
    inline_count_ = 0;
  }
  many_.push_back(std::move(box));
}

void BoxList::resize(size_t count) {
  if (many_.empty() && count <= 1) {
    if (count == 1 && inline_count_ == 0) one_ = Box();
    inline_count_ = static_cast<uint8_t>(count);
    return;
  }
  if (many_.empty()) {  // one or none inline, more wanted
    many_.reserve(count);
    if (inline_count_ == 1) many_.push_back(std::move(one_));
    inline_count_ = 0;
    many_.resize(count);
    return;
  }
  if (count > 1) {
    many_.resize(count);
    return;
  }
  if (count == 1) one_ = std::move(many_[0]);  // back inline
  inline_count_ = static_cast<uint8_t>(count);
  std::vector<Box>().swap(many_);
}

void BoxList::reserve(size_t count) {
  if (count <= 1 || count <= many_.capacity()) return;
  if (many_.empty() && inline_count_ == 1) {
    many_.reserve(count);
    many_.push_back(std::move(one_));
    inline_count_ = 0;
    return;
  }
  many_.reserve(count);
}

void BoxList::clear() {
  std::vector<Box>().swap(many_);
  inline_count_ = 0;
}

namespace {

void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

}  // namespace

// Only KeyPath writes its packed string, so reads need no bounds checks.
uint64_t KeyPath::ReadVarint(const char** at) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t b = static_cast<uint8_t>(*(*at)++);
    v |= uint64_t{b & 0x7Fu} << shift;
    if (!(b & 0x80)) return v;
  }
}

KeyPath::KeyPath(std::initializer_list<PathElement> elements) {
  for (const PathElement& e : elements) push_back(e);
}

KeyPath::KeyPath(const std::vector<PathElement>& elements) {
  for (const PathElement& e : elements) push_back(e);
}

void KeyPath::push_back(const PathElement& element) {
  if (const std::string* s = std::get_if<std::string>(&element)) {
    AppendVarint(&packed_, uint64_t{s->size()} << 1);
    packed_ += *s;
  } else {
    const int64_t i = std::get<int64_t>(element);
    AppendVarint(&packed_, 1);
    AppendVarint(&packed_, (static_cast<uint64_t>(i) << 1) ^ static_cast<uint64_t>(i >> 63));
  }
}

bool KeyPath::FromPacked(std::string_view packed, KeyPath* out) {
  // Every varint and string must end inside `packed`: walked with bounds here, so that the
  // unchecked decoding of ForEach and the iterators stays inside the string.
  size_t at = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at >= packed.size()) return false;
      const uint8_t b = static_cast<uint8_t>(packed[at++]);
      *v |= uint64_t{b & 0x7Fu} << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  while (at < packed.size()) {
    uint64_t h;
    if (!varint(&h)) return false;
    if (h & 1) {
      uint64_t z;
      if (h != 1 || !varint(&z)) return false;
    } else {
      if ((h >> 1) > packed.size() - at) return false;
      at += h >> 1;
    }
  }
  out->packed_.assign(packed);
  return true;
}

size_t KeyPath::size() const {
  size_t n = 0;
  ForEach([&](std::string_view) { ++n; }, [&](int64_t) { ++n; });
  return n;
}

PathElement KeyPath::operator[](size_t i) const {
  auto it = begin();
  for (; i > 0; --i) ++it;
  return *it;
}

PathElement KeyPath::const_iterator::operator*() const {
  const char* at = at_;
  const uint64_t h = ReadVarint(&at);
  if (h & 1) {
    const uint64_t z = ReadVarint(&at);
    return static_cast<int64_t>((z >> 1) ^ (~(z & 1) + 1));
  }
  return std::string(at, h >> 1);
}

KeyPath::const_iterator& KeyPath::const_iterator::operator++() {
  const uint64_t h = ReadVarint(&at_);
  if (h & 1) ReadVarint(&at_);
  else at_ += h >> 1;
  return *this;
}

std::string FlattenKey(const KeyPath& path) {
  std::string key;
  bool first = true;
  path.ForEach(
      [&](std::string_view s) {
        if (!first) key += '.';
        first = false;
        key += s;
      },
      [&](int64_t i) {
        if (!first) key += '.';
        first = false;
        key += std::to_string(i);
      });
  return key;
}

std::string FlattenKey(const std::vector<PathElement>& path) {
  std::string key;
  for (size_t i = 0; i < path.size(); ++i) {
    if (i) key += '.';
    if (const auto* s = std::get_if<std::string>(&path[i])) key += *s;
    else key += std::to_string(std::get<int64_t>(path[i]));
  }
  return key;
}

std::optional<size_t> FindRepeatedKey(size_t n, const std::function<std::string_view(size_t)>& key_at) {
  auto hash = [&](size_t i) {
    const std::string_view key = key_at(i);
    return XXH3_64bits(key.data(), key.size());
  };
  // Each pair packed in one word, the hash's top 32 bits above the index: half the memory of
  // (hash, index) pairs and a plain integer sort, for a million keys at the end of a parse's
  // peak. A 32-bit hash collides for ~100 of a million distinct keys, each costing one key
  // comparison. Indices past 32 bits keep the full pairs.
  if (n >= (uint64_t{1} << 32)) {
    std::vector<std::pair<uint64_t, size_t>> hashes;
    hashes.reserve(n);
    for (size_t i = 0; i < n; ++i) hashes.emplace_back(hash(i), i);
    std::sort(hashes.begin(), hashes.end());
    for (size_t k = 0; k < hashes.size();) {
      size_t end = k + 1;
      while (end < hashes.size() && hashes[end].first == hashes[k].first) ++end;
      for (size_t a = k; a < end; ++a)
        for (size_t b = a + 1; b < end; ++b)
          if (key_at(hashes[a].second) == key_at(hashes[b].second)) return hashes[b].second;
      k = end;
    }
    return std::nullopt;
  }
  std::vector<uint64_t> packed(n);
  for (size_t i = 0; i < n; ++i) packed[i] = (hash(i) & ~uint64_t{0xFFFFFFFF}) | i;
  std::sort(packed.begin(), packed.end());
  // Within a run of equal hashes the indices (the low word) ascend, so the later of the
  // first pair found is the one reported.
  constexpr uint64_t kIndexBits = 0xFFFFFFFF;
  for (size_t k = 0; k < n;) {
    size_t end = k + 1;
    while (end < n && (packed[end] >> 32) == (packed[k] >> 32)) ++end;
    for (size_t a = k; a < end; ++a)
      for (size_t b = a + 1; b < end; ++b)
        if (key_at(packed[a] & kIndexBits) == key_at(packed[b] & kIndexBits)) return packed[b] & kIndexBits;
    k = end;
  }
  return std::nullopt;
}

std::optional<size_t> FindRepeatedKey(const std::vector<TensorEntry>& tensors, size_t first) {
  first = std::min(first, tensors.size());
  std::optional<size_t> found =
      FindRepeatedKey(tensors.size() - first, [&](size_t i) -> std::string_view { return tensors[first + i].key; });
  if (found) *found += first;
  return found;
}

std::string ShapeText(std::span<const uint64_t> dims) {
  std::string text = "[";
  for (size_t d = 0; d < dims.size(); ++d) text += (d ? ", " : "") + std::to_string(dims[d]);
  return text + "]";
}

}  // namespace ckptfs
