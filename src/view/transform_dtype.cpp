// The `dtype=` view: every floating tensor served converted to one type on read (the
// conversion itself is convert.cpp's); other tensors are served as stored.
#include "view/convert.hpp"
#include "view/transform.hpp"

namespace ckptfs {
namespace {

class DTypeTransform : public Transform {
 public:
  explicit DTypeTransform(DType to) : to_(to) {}

  Status Apply(ServedTensors* served) const override {
    for (size_t i = 0; i < served->size(); ++i)
      if (ConvertsTo((*served)[i].dtype, to_)) served->SetDType(i, to_);
    (*served->mutable_manifest_fields())["dtype"] = Info(to_).safetensors_name;
    return Status::OK();
  }

 private:
  DType to_;
};

}  // namespace

std::unique_ptr<Transform> MakeDTypeTransform(const ViewOptions& options) {
  if (!options.dtype) return nullptr;
  return std::make_unique<DTypeTransform>(*options.dtype);
}

}  // namespace ckptfs
