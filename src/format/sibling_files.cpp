#include "format/sibling_files.hpp"

namespace ckptfs {

Status ListFolderFiles(Env& env, const std::string& dir, std::vector<std::string>* names) {
  std::vector<FolderEntry> entries;
  CKPTFS_RETURN_IF_ERROR(env.ListFolder(dir, &entries));
  for (FolderEntry& e : entries)
    if (e.type == PathType::kFile && !e.name.empty() && e.name.front() != '.') names->push_back(std::move(e.name));
  return Status::OK();
}

Status AddSiblingFiles(const std::string& dir, const std::vector<std::string>& names, const ReadersOwnFile& is_own,
                       Catalog* catalog) {
  for (const std::string& name : names) {
    if (is_own && is_own(name)) continue;
    uint32_t index;
    CKPTFS_RETURN_IF_ERROR(catalog->files->Add(JoinPath(dir, name), &index));
    catalog->sibling_files.push_back(index);
  }
  return Status::OK();
}

Status AddFolderSiblingFiles(const std::string& dir, const ReadersOwnFile& is_own, Catalog* catalog) {
  std::vector<std::string> names;
  CKPTFS_RETURN_IF_ERROR(ListFolderFiles(catalog->files->env(), dir, &names));
  return AddSiblingFiles(dir, names, is_own, catalog);
}

}  // namespace ckptfs
