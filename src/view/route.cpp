// The one decision of how a served tensor's bytes are produced (include/ckptfs/view.hpp,
// ReadRoute): the View, the layout builder, the device plan and the C API all ask here.
#include "ckptfs/view.hpp"

namespace ckptfs {

ReadRoute RouteOf(const ServedTensor& tensor) {
  if (tensor.converted()) return ReadRoute::kConvert;
  // A deferred entry that cannot be made (ServedTensor::Stored) takes the gather route, whose
  // read reports why.
  const TensorEntry* stored = nullptr;
  return tensor.Stored(&stored).ok() && StoredAsExtents(*stored) ? ReadRoute::kExtents : ReadRoute::kGather;
}

}  // namespace ckptfs
