// The `dtype=` view: every floating tensor served converted to one type on read (the
// conversion itself is convert.cpp's); other tensors are served as stored. Packed float4
// pairs (F4) are floating but have no conversion, in torch either: a view that asks for one
// is refused rather than served with that tensor left as it was.
#include "view/convert.hpp"
#include "view/transform.hpp"

namespace ckptfs {
namespace {

class DTypeTransform : public Transform {
 public:
  explicit DTypeTransform(DType to) : to_(to) {}

  Status Apply(ServedTensors* served) const override {
    for (size_t i = 0; i < served->size(); ++i) {
      const DType from = (*served)[i].dtype;
      if (from == DType::kF4x2 && to_ != from)
        return Status::NotSupported(served->source().source,
                                    "tensor '" + std::string((*served)[i].key()) + "' is F4 (float4_e2m1fn_x2, two values a byte), " +
                                        "which has no conversion to " + std::string(Info(to_).safetensors_name) +
                                        " (torch has none either): read it without dtype=");
      if (ConvertsTo(from, to_)) ServedTensorsEditor(served).SetDType(i, to_);
    }
    (*ServedTensorsEditor(served).mutable_manifest_fields())["dtype"] = Info(to_).safetensors_name;
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
