// The reader registry against what is written about it: the README's table of sources names
// every reader and no other, help lists every reader, and every format a reader builds has a
// catalog cache stamp.
#define BOOST_TEST_MODULE registry
#include <boost/test/unit_test.hpp>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "ckptfs/source.hpp"
#include "format/registry.hpp"

namespace {

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The first cells of the table rows of the README's "## Sources" section that name a reader
// (`name`).
std::set<std::string> ReadersInReadme() {
  const std::string readme = ReadText(CKPTFS_TEST_DATA "/../../README.md");
  const size_t start = readme.find("\n## Sources\n");
  BOOST_REQUIRE(start != std::string::npos);
  const size_t end = readme.find("\n## ", start + 1);
  std::istringstream section(readme.substr(start, end - start));
  std::set<std::string> names;
  for (std::string line; std::getline(section, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t close = line.find('`', 3);
    BOOST_REQUIRE(close != std::string::npos);
    names.insert(line.substr(3, close - 3));
  }
  return names;
}

}  // namespace

BOOST_AUTO_TEST_CASE(readme_table_names_every_reader) {
  std::set<std::string> registry;
  for (const ckptfs::ReaderDescription& r : ckptfs::DescribeReaders()) registry.insert(std::string(r.name));
  BOOST_TEST(registry.size() == ckptfs::Readers().size());
  const std::set<std::string> readme = ReadersInReadme();
  for (const std::string& name : registry) BOOST_TEST(readme.count(name) == 1u, name << " is not in the README's table");
  for (const std::string& name : readme) BOOST_TEST(registry.count(name) == 1u, name << " is no reader of the registry");
}

BOOST_AUTO_TEST_CASE(every_entry_is_complete) {
  for (const ckptfs::ReaderEntry* r : ckptfs::Readers()) {
    BOOST_TEST(!r->name.empty());
    BOOST_TEST(!r->description.empty(), r->name);
    BOOST_TEST(r->detect != nullptr, r->name);
    BOOST_TEST(r->read != nullptr, r->name);
    BOOST_TEST(!r->formats[0].empty(), r->name);
    for (std::string_view format : r->formats)
      if (!format.empty()) BOOST_TEST(!ckptfs::ReaderStamp(format).empty(), format);
  }
}
