// The files a folder source shows beside its tensors ("sibling files": config.json, the
// tokenizer, a README), served unchanged: the regular files of the folder that are not hidden
// and that the reader does not read itself (weights, indexes, rank files, its own markers).
#ifndef CKPTFS_FORMAT_SIBLING_FILES_HPP_
#define CKPTFS_FORMAT_SIBLING_FILES_HPP_

#include <functional>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// True for a file name the reader reads itself, which is then not shown as a sibling.
using ReadersOwnFile = std::function<bool(const std::string& name)>;

// The regular, non-hidden files of folder `dir`, in the Env's order (sorted by name).
Status ListFolderFiles(Env& env, const std::string& dir, std::vector<std::string>* names);

// Serves each of `names` (files of folder `dir`) that `is_own` does not claim (every one when
// `is_own` is empty) as a sibling file of the catalog, in the order given.
Status AddSiblingFiles(const std::string& dir, const std::vector<std::string>& names, const ReadersOwnFile& is_own,
                       Catalog* catalog);

// ListFolderFiles of the catalog's Env, then AddSiblingFiles.
Status AddFolderSiblingFiles(const std::string& dir, const ReadersOwnFile& is_own, Catalog* catalog);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_SIBLING_FILES_HPP_
