// ReadCatalog: which reader of the registry a source needs, and the checks every catalog gets.
#include <cerrno>
#include <vector>

#include "ckptfs/source.hpp"
#include "format/registry.hpp"
#include "io/parallel.hpp"

namespace ckptfs {
namespace {

// Tensors per thread of the layout check, at least: below twice this, one thread.
constexpr size_t kLayoutsPerWorker = 65536;

// ValidateLayout of every tensor, on a few threads for a large catalog. The error is the
// first tensor's in catalog order whatever the threads' timing: each thread checks a
// consecutive range and stops at its first bad tensor, and the earliest range's error wins.
Status ValidateLayouts(const Catalog& catalog, const std::string& source) {
  const std::string& layout_file = catalog.layout_file.empty() ? source : catalog.layout_file;
  const size_t count = catalog.tensors.size();
  const size_t workers = WorkerCount(count, kLayoutsPerWorker);
  std::vector<Status> first_error(workers);
  RunOnWorkers(workers, [&](size_t w) {
    const auto [begin, end] = PartRange(count, workers, w);
    for (size_t i = begin; i < end; ++i) {
      Status s = ValidateLayout(catalog.tensors[i], *catalog.files, layout_file);
      if (!s.ok()) {
        first_error[w] = std::move(s);
        return;
      }
    }
  });
  for (Status& s : first_error)
    if (!s.ok()) return s;
  return Status::OK();
}

// The first reader of the registry that detects the source's format.
Status DetectReader(SourceProbe& probe, const ReaderEntry** out) {
  for (const ReaderEntry* reader : Readers()) {
    bool is_format = false;
    CKPTFS_RETURN_IF_ERROR(reader->detect(probe, &is_format));
    if (is_format) {
      *out = reader;
      return Status::OK();
    }
  }
  if (probe.is_file())
    return Status::InvalidArgument(probe.source(), "not a recognized checkpoint (expected a torch zip or safetensors file)");
  return Status::InvalidArgument(probe.source(), "not a file or folder");
}

}  // namespace

Status CheckTensorLimit(const Catalog& catalog, const std::string& source, const ReadLimits& limits) {
  // Every reader bounds what it parses; this also covers formats whose tensors come from
  // several files (folders, ZeRO ranks), and catalogs that were not parsed (the cache's).
  if (catalog.tensors.size() > limits.tensors)
    return Status::Refused(source, std::to_string(catalog.tensors.size()) + " tensors, over the limit of " +
                                       std::to_string(limits.tensors))
        .WithLimitOption("max_tensors");
  return Status::OK();
}

Status ReadCatalog(const std::string& source, std::shared_ptr<Env> env, const SourceOptions& options,
                   std::shared_ptr<Catalog>* out) {
  auto catalog = std::make_shared<Catalog>();
  catalog->source = source;
  catalog->files = std::make_shared<SourceFiles>(std::move(env));
  PathType type;
  CKPTFS_RETURN_IF_ERROR(catalog->files->env().Stat(source, &type));
  if (type == PathType::kMissing) return Status::FromErrno(source, "cannot access", ENOENT);
  SourceProbe probe(source, type, catalog.get());
  const ReaderEntry* reader = nullptr;
  CKPTFS_RETURN_IF_ERROR(DetectReader(probe, &reader));
  CKPTFS_RETURN_IF_ERROR(reader->read(probe, options, catalog.get()));
  CKPTFS_RETURN_IF_ERROR(CheckTensorLimit(*catalog, source, options.limits));
  // Nothing reads a tensor whose boxes do not tile it exactly inside their files.
  CKPTFS_RETURN_IF_ERROR(ValidateLayouts(*catalog, source));
  *out = std::move(catalog);
  return Status::OK();
}

std::vector<ReaderDescription> DescribeReaders() {
  std::vector<ReaderDescription> out;
  for (const ReaderEntry* reader : Readers()) {
    ReaderDescription d{reader->name, reader->description, {}};
    for (std::string_view format : reader->formats)
      if (!format.empty()) d.formats.push_back(format);
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace ckptfs
