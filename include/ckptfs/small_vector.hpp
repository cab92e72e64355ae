// SmallVector: a vector of trivially copyable values kept inline up to N of them.
//
// A catalog holds a shape and a box's offsets, extents and strides for every tensor: as
// std::vectors each would be a heap allocation (five million for a million-tensor catalog),
// while nearly all have rank 1 to 4. Only what the catalog's users need of std::vector is
// here.
#ifndef CKPTFS_SMALL_VECTOR_HPP_
#define CKPTFS_SMALL_VECTOR_HPP_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace ckptfs {

template <typename T, uint32_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T>, "SmallVector copies its values as bytes");
  static_assert(N > 0);

 public:
  using value_type = T;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = T&;
  using const_reference = const T&;
  using pointer = T*;
  using const_pointer = const T*;
  using iterator = T*;
  using const_iterator = const T*;

  SmallVector() = default;
  SmallVector(std::initializer_list<T> values) { assign(values.begin(), values.end()); }
  SmallVector(size_t count, const T& value) { assign(count, value); }
  // From any std::vector (readers build them): implicit, so a vector assigns as it is.
  SmallVector(const std::vector<T>& values) { assign(values.begin(), values.end()); }  // NOLINT
  template <typename It, typename = decltype(*std::declval<It>())>
  SmallVector(It first, It last) {
    assign(first, last);
  }
  template <uint32_t M>
  SmallVector(const SmallVector<T, M>& other) {  // NOLINT: a shape becomes a box's extent
    assign(other.begin(), other.end());
  }
  SmallVector(const SmallVector& other) { assign(other.begin(), other.end()); }
  SmallVector(SmallVector&& other) noexcept { Steal(&other); }
  SmallVector& operator=(const SmallVector& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  SmallVector& operator=(SmallVector&& other) noexcept {
    if (this != &other) {
      Release();
      Steal(&other);
    }
    return *this;
  }
  SmallVector& operator=(std::initializer_list<T> values) {
    assign(values.begin(), values.end());
    return *this;
  }
  ~SmallVector() { Release(); }

  // A copy as a std::vector, for APIs that take one.
  operator std::vector<T>() const { return std::vector<T>(begin(), end()); }  // NOLINT
  std::vector<T> to_vector() const { return std::vector<T>(begin(), end()); }

  T* data() { return on_heap() ? heap_ : inline_; }
  const T* data() const { return on_heap() ? heap_ : inline_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return capacity_; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& front() { return data()[0]; }
  const T& front() const { return data()[0]; }
  T& back() { return data()[size_ - 1]; }
  const T& back() const { return data()[size_ - 1]; }

  void reserve(size_t n) {
    if (n <= capacity_) return;
    T* grown = static_cast<T*>(std::malloc(n * sizeof(T)));
    if (!grown) throw std::bad_alloc();
    const uint32_t size = size_;
    if (size) std::memcpy(grown, data(), size * sizeof(T));
    Release();  // (empties this vector: the size is restored below)
    heap_ = grown;
    capacity_ = static_cast<uint32_t>(n);
    size_ = size;
  }
  void clear() { size_ = 0; }
  void push_back(const T& v) {
    if (size_ == capacity_) {
      const T copy = v;  // v may live in this vector
      reserve(size_t{capacity_} * 2);
      data()[size_++] = copy;
      return;
    }
    data()[size_++] = v;
  }
  template <typename... Args>
  T& emplace_back(Args&&... args) {
    push_back(T(std::forward<Args>(args)...));
    return back();
  }
  void pop_back() { --size_; }
  void resize(size_t n, const T& value = T()) {
    reserve(n);
    for (size_t i = size_; i < n; ++i) data()[i] = value;
    size_ = static_cast<uint32_t>(n);
  }
  void assign(size_t n, const T& value) {
    clear();
    resize(n, value);
  }
  template <typename It, typename = std::enable_if_t<!std::is_integral_v<It>>>
  void assign(It first, It last) {
    clear();
    reserve(static_cast<size_t>(std::distance(first, last)));
    for (; first != last; ++first) data()[size_++] = *first;
  }
  // Inserts [first, last) before `pos` (only at the end is used; any position works).
  template <typename It>
  T* insert(const T* pos, It first, It last) {
    const size_t at = static_cast<size_t>(pos - data());
    const size_t count = static_cast<size_t>(std::distance(first, last));
    reserve(std::max<size_t>(size_ + count, size_t{capacity_} * 2));
    T* base = data();
    std::memmove(base + at + count, base + at, (size_ - at) * sizeof(T));
    for (size_t i = 0; i < count; ++i, ++first) base[at + i] = *first;
    size_ += static_cast<uint32_t>(count);
    return base + at;
  }
  T* insert(const T* pos, const T& value) { return insert(pos, &value, &value + 1); }
  T* erase(const T* pos) {
    const size_t at = static_cast<size_t>(pos - data());
    std::memmove(data() + at, data() + at + 1, (size_ - at - 1) * sizeof(T));
    --size_;
    return data() + at;
  }

  friend bool operator==(const SmallVector& a, const SmallVector& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator==(const SmallVector& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator<(const SmallVector& a, const SmallVector& b) {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  bool on_heap() const { return capacity_ > N; }
  void Release() {
    if (on_heap()) std::free(heap_);
    capacity_ = N;
    size_ = 0;
  }
  void Steal(SmallVector* other) {
    size_ = other->size_;
    capacity_ = other->capacity_;
    if (other->on_heap()) heap_ = other->heap_;
    else std::memcpy(inline_, other->inline_, size_ * sizeof(T));
    other->capacity_ = N;
    other->size_ = 0;
  }

  uint32_t size_ = 0;
  uint32_t capacity_ = N;
  union {
    T inline_[N];
    T* heap_;
  };
};

}  // namespace ckptfs

#endif  // CKPTFS_SMALL_VECTOR_HPP_
