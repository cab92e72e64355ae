// Reading a source's catalog: which format reader a path needs, and what the reader includes.
//
// The format layer's public entry point. ReadCatalog walks the reader registry
// (src/format/registry.hpp), so a new format is a new reader file and a registry line behind
// it. The front ends call the open layer (include/ckptfs/open.hpp), which picks the Env, uses
// the catalog cache and calls ReadCatalog; they never call a reader.
#ifndef CKPTFS_SOURCE_HPP_
#define CKPTFS_SOURCE_HPP_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/remote.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// What a reader should include beyond the weights, and its limits (the source options of
// include/ckptfs/options.hpp).
struct SourceOptions {
  // DeepSpeed ZeRO: also serve each trainable parameter's Adam moments, as
  // "exp_avg.<name>" and "exp_avg_sq.<name>" after the weights.
  bool zero_moments = false;
  // veRL: also serve the optimizer state consolidated from the optim rank files, as
  // "optimizer.state.<parameter name>.<entry>" after the weights.
  bool optimizer_state = false;
  ReadLimits limits;
  // Where the source lives; null means the Env the open layer picks for the SOURCE string
  // (EnvForSource: a remote Env for http(s):// and s3:// URLs, else the local file system).
  std::shared_ptr<Env> env;
  // How remote sources are fetched and cached.
  RemoteOptions remote;
  // A folder for validated catalogs of single-file local sources ("" = off, "auto" = the
  // user's cache folder): reopening an unchanged checkpoint then skips parsing it.
  std::string catalog_cache;
  // The file system that folder is on; null means the local one.
  std::shared_ptr<Env> catalog_cache_env;
};

// Detects the format of `source` (a file or a folder reached through `env`: the first reader of
// the registry whose detect accepts it) and reads its catalog, then checks it: at most
// options.limits.tensors tensors (CheckTensorLimit), each laid out exactly inside its files.
Status ReadCatalog(const std::string& source, std::shared_ptr<Env> env, const SourceOptions& options,
                   std::shared_ptr<Catalog>* out);

// kRefused when `catalog` (of `source`) has more tensors than `limits` allow.
Status CheckTensorLimit(const Catalog& catalog, const std::string& source, const ReadLimits& limits);

// A format reader of the registry, as help texts and the README's table of sources name it.
struct ReaderDescription {
  std::string_view name;                  // "torch-zip"
  std::string_view description;           // "torch .pt/.bin: a torch.save zip (torch >= 1.6)"
  std::vector<std::string_view> formats;  // the Catalog::format values of its catalogs
};
// Every reader, in the order detection tries them.
std::vector<ReaderDescription> DescribeReaders();

}  // namespace ckptfs

#endif  // CKPTFS_SOURCE_HPP_
