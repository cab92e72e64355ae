// Format readers: each appends what it learns from its source files to a Catalog.
// They parse metadata only (zip directories, pickles, headers) and never read or
// execute tensor data. See doc/FORMATS.md for the rules each one enforces. Detection reaches
// them through their registry entries (format/registry.hpp); these are the functions the
// entries and other readers (a folder's weight files, DCP's torch_save values) call.
//
// The catalog cache serves a catalog only under the reader code stamp that wrote it
// (ReaderStamp): a hash of these sources, so a change to any reader needs nothing else to
// retire the catalogs the old code built.
#ifndef CKPTFS_FORMAT_READERS_HPP_
#define CKPTFS_FORMAT_READERS_HPP_

#include <cstdint>
#include <string>
#include <string_view>

#include "ckptfs/catalog.hpp"
#include "ckptfs/source.hpp"
#include "ckptfs/status.hpp"
#include "format/registry.hpp"

namespace ckptfs {

class ZipArchive;

// A torch.save zip file (.pt/.bin, torch >= 1.6). Its non-tensor values are stored in
// `*metadata` (a JSON tree mirroring the saved object, tensors left out).
// `opened`: the file's zip directory when TorchZipKind has already read it (a million-entry
// directory costs a tenth of the whole read), taken over instead of read again.
Status ReadTorchZip(const std::string& path, Catalog* catalog, nlohmann::json* metadata,
                    const ReadLimits& limits = ReadLimits{}, ZipArchive* opened = nullptr);
// The same for a torch.save archive stored in `window` of a file already in catalog->files
// (a chunk of a larger file): tensor offsets are offsets in that file.
Status ReadTorchZip(const FileWindow& window, Catalog* catalog, nlohmann::json* metadata,
                    const ReadLimits& limits = ReadLimits{});

// True when a file's first bytes (`head`, the first 512 or all when shorter) start a legacy
// torch.save stream (a pickle) or a tar archive (torch <= 0.3 saved tar files).
bool IsTorchLegacy(std::string_view head);
// A legacy torch.save stream (torch < 1.6, or _use_new_zipfile_serialization=False), read
// like a torch.save zip; the tar-based format of torch <= 0.3 is refused by name.
Status ReadTorchLegacy(const std::string& path, std::string_view head, Catalog* catalog, nlohmann::json* metadata,
                       const ReadLimits& limits = ReadLimits{});

// A TorchScript archive (torch.jit.save): the module tree's tensors under the names
// Module.state_dict() gives them, constants under "CONSTANTS.c<i>"; code is never read.
Status ReadTorchScript(const std::string& path, Catalog* catalog, nlohmann::json* metadata,
                       const ReadLimits& limits = ReadLimits{});

// A torch.export.save package (.pt2): parameters, buffers and constants by their
// state-dict names, from the package's weight and constant configs.
Status ReadTorchExport(const std::string& path, Catalog* catalog, nlohmann::json* metadata,
                       const ReadLimits& limits = ReadLimits{});

// Which reader a zip file needs: "torchscript" (it holds <archive>/constants.pkl),
// "torch-export" (<archive>/archive_format says pt2) or "torch-zip". The directory it reads
// is left in `*zip` (empty when the file is not a readable zip) for ReadTorchZip.
Status TorchZipKind(const std::string& path, SourceFiles* files, std::string* kind, ZipArchive* zip);
// Whether the probed source is a zip whose TorchZipKind is `kind` (the zip-based readers' detect).
Status IsTorchZipOfKind(SourceProbe& probe, std::string_view kind, bool* is_kind);

// One .safetensors file; its "__metadata__" strings go to `*metadata`.
Status ReadSafetensorsFile(const std::string& path, Catalog* catalog, nlohmann::json* metadata,
                           const ReadLimits& limits = ReadLimits{});

// Reads the checkpoint in folder `dir` (through the Env of catalog->files): its weights are
// found by the frameworks' file names (format/safetensors/folder_weights.hpp: transformers' order, PEFT's
// adapter, other indexes, then .safetensors files, then torch files that are not training
// state). Other regular files in the folder become sibling files, served unchanged, and
// metadata["folder"] says of each file what it is and why, and catalog->components holds its
// one model and the names its weights are served under. A folder in which no rule finds
// weights is refused with a line naming what was looked for.
// `index_name`, when given, is the index file of `dir` to read the weights from (the SOURCE
// was that index); a folder the Env cannot list is read from the names the index and the
// Hugging Face layout give.
Status ReadCheckpointFolder(const std::string& dir, Catalog* catalog, const ReadLimits& limits = ReadLimits{},
                            const std::string& index_name = {});

// True when `dir` is a DeepSpeed save folder (it has `latest`) or tag folder (it holds
// ZeRO rank files or pipeline layer files).
bool IsDeepSpeedFolder(Env& env, const std::string& dir);

// A DeepSpeed checkpoint: a save folder (the tag comes from `latest`) or a tag folder,
// reached through the Env of catalog->files.
// Consolidates ZeRO 1/2/3 partitions (one subtree per model-parallel rank when there are
// several) or pipeline per-layer files.
Status ReadDeepSpeedCheckpoint(const std::string& dir, const SourceOptions& options, Catalog* catalog);

// True when `dir` is a DeepSpeed universal checkpoint: a step folder of ds_to_universal
// (model-states files beside a zero/ folder, no optimizer rank files), or a folder holding
// `latest_universal` and no `latest` (a save folder with both is the ZeRO reader's).
bool IsDeepSpeedUniversalFolder(Env& env, const std::string& dir);

// Such a folder (the step `latest_universal` names, or the step folder itself), reached through
// the Env of catalog->files: the fp32 weights of zero/<param>/fp32.pt with the names, order and
// model-states tensors of the ZeRO reader; the Adam moments too with options.zero_moments.
Status ReadDeepSpeedUniversal(const std::string& dir, const SourceOptions& options, Catalog* catalog);

// True when `dir` holds a torch.distributed.checkpoint `.metadata` file, or is a parent
// whose step folders (step-N/, iter_NNNNNNN/, ...) hold one.
bool IsDcpFolder(Env& env, const std::string& dir);

// A torch.distributed.checkpoint folder, or the latest step folder of a parent (the one
// latest_checkpointed_iteration.txt names, else the highest step number), reached through
// the Env of catalog->files. Tensor chunks become boxes of the full tensors; non-tensor
// entries are decoded into the catalog's metadata; metadata["dcp"] says what was served.
Status ReadDcpCheckpoint(const std::string& dir, const SourceOptions& options, Catalog* catalog);

// A veRL FSDP checkpoint: an actor or critic folder (model_world_size_W_rank_R.pt, ...), the
// global_step_N/ folder holding it or the run folder naming the step
// (latest_checkpointed_iteration.txt); the model rank files consolidated (format/verl/verl.cpp).

// A folder of torch.save rank files (one group of rank-numbered names) holding DTensors or
// ShardedTensors: consolidated into full tensors (format/torch/rank_shards.hpp).

// True when `dir` holds shard-<rank>-model-<i>-of-<n>.safetensors files: what torch's
// HuggingFaceStorageWriter(save_distributed=True) writes, with no .metadata.
bool IsDcpHfShardFolder(Env& env, const std::string& dir);

// Such a folder: every tensor assembled from the chunks its shard files hold, placed by the
// saved_offsets of their DCP_SHARDING_INFO (the full shape is where the chunks end). Other
// files in the folder are served as they are.
Status ReadDcpHfShards(const std::string& dir, const SourceOptions& options, Catalog* catalog);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_READERS_HPP_
