// The legacy torch.save stream reader on streams built by hand, for what today's torch no
// longer writes (pre-0.4 storage views, whole-module pickles) and for exact offsets. Real
// files written by torch 2.x and Debian's torch 1.13 are tests/compat/test_torch_family.py.
#define BOOST_TEST_MODULE torch_legacy_test
#include <boost/test/unit_test.hpp>

#include "ckptfs/catalog.hpp"
#include "test_util.hpp"

using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::Status;
using namespace ckptfs_test;

namespace {

// The magic number, protocol version and system info pickles of a legacy stream.
std::string Header(bool little_endian = true) {
  PickleBuilder magic, protocol, info;
  // 0x1950a86a20f9469cfc6c, little-endian two's complement: LONG1 of 10 bytes.
  magic.Proto(2).Long1(std::string("\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10)).Stop();
  protocol.Proto(2).BinInt2(1001).Stop();
  info.Proto(2).EmptyDict().Mark().BinUnicode("protocol_version").BinInt2(1001).BinUnicode("little_endian");
  info.Op(little_endian ? 0x88 : 0x89).SetItems().Stop();
  return magic.bytes() + protocol.bytes() + info.bytes();
}

// ('storage', torch.<cls>, key, 'cpu', numel, view) with view None or (view_key, offset, size).
void Pid(PickleBuilder* p, std::string_view cls, std::string_view key, uint32_t numel, const char* view_key = nullptr,
         uint32_t view_offset = 0, uint32_t view_size = 0) {
  p->Mark().BinUnicode("storage").Global("torch", cls).BinUnicode(key).BinUnicode("cpu").BinInt(static_cast<int32_t>(numel));
  if (view_key) p->Mark().BinUnicode(view_key).BinInt(static_cast<int32_t>(view_offset)).BinInt(static_cast<int32_t>(view_size)).Tuple();
  else p->None();
  p->Tuple().BinPersId();
}

// _rebuild_tensor_v2(<pid>, offset, (n,), (1,), False, OrderedDict()) of a 1-d tensor.
void Tensor1d(PickleBuilder* p, uint32_t offset, uint32_t n) {
  p->BinInt(static_cast<int32_t>(offset)).Mark().BinInt(static_cast<int32_t>(n)).Tuple().Mark().BinInt(1).Tuple();
  p->NewFalse().Global("collections", "OrderedDict").EmptyTuple().Reduce().Tuple().Reduce();
}

std::string KeyList(const std::vector<std::string>& keys) {
  PickleBuilder p;
  p.Proto(2).EmptyList().Mark();
  for (const auto& k : keys) p.BinUnicode(k);
  p.Op('e').Stop();
  return p.bytes();
}

std::string Storage(uint64_t count, const std::string& bytes) { return LE64(count) + bytes; }

void CheckError(const Status& s, const std::string& path, Status::Code code, std::string_view part) {
  BOOST_TEST(!s.ok());
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(code), s.message());
  BOOST_TEST(StartsWith(s.message(), path + ": "), s.message());
  BOOST_TEST(Contains(s.message(), part), s.message());
}

struct Built : BuiltCatalog {
  explicit Built(const std::string& bytes) : BuiltCatalog(bytes, "/mem/legacy.pt") {}
};

}  // namespace

BOOST_AUTO_TEST_CASE(storages_are_found_by_walking_their_headers) {
  PickleBuilder obj;
  obj.Proto(2).EmptyDict().Mark().BinUnicode("a").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  Pid(&obj, "HalfStorage", "20", 3);
  Tensor1d(&obj, 1, 2);
  obj.BinUnicode("b").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  Pid(&obj, "DoubleStorage", "100", 2);
  Tensor1d(&obj, 0, 2);
  obj.BinUnicode("epoch").BinInt1(7).SetItems().Stop();
  const std::string head = Header() + obj.bytes() + KeyList({"100", "20"});  // sorted as strings
  const std::string doubles = PatternBytes(16, 1), halfs = PatternBytes(6, 2);
  Built b(head + Storage(2, doubles) + Storage(3, halfs));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_TEST(b.catalog->format == "torch-legacy");
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 2u);
  const auto& a = b.catalog->tensors[0];
  const auto& d = b.catalog->tensors[1];
  BOOST_TEST((a.dtype == DType::kF16));
  BOOST_TEST((d.dtype == DType::kF64));
  const auto ea = ckptfs::ExtentsOf(a), ed = ckptfs::ExtentsOf(d);
  BOOST_REQUIRE_EQUAL(ed.size(), 1u);
  BOOST_REQUIRE_EQUAL(ea.size(), 1u);
  BOOST_TEST(ed[0].offset == head.size() + 8);
  BOOST_TEST(ed[0].length == 16u);
  BOOST_TEST(ea[0].offset == head.size() + 8 + 16 + 8 + 2);  // element 1 of the halfs
  BOOST_TEST(ea[0].length == 4u);
  BOOST_TEST(b.catalog->metadata == nlohmann::json({{"epoch", 7}}));
}

BOOST_AUTO_TEST_CASE(pre_0_4_storage_views_read_inside_their_root_storage) {
  // Two views of root storage "r" (8 floats): elements [2, 6) and [4, 8).
  PickleBuilder obj;
  obj.Proto(2).EmptyDict().Mark().BinUnicode("v").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  Pid(&obj, "FloatStorage", "r", 8, "v1", 2, 4);
  Tensor1d(&obj, 1, 3);
  obj.BinUnicode("w").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  Pid(&obj, "FloatStorage", "r", 8, "v2", 4, 4);
  Tensor1d(&obj, 0, 4);
  obj.SetItems().Stop();
  const std::string head = Header() + obj.bytes() + KeyList({"r"});
  Built b(head + Storage(8, PatternBytes(32, 3)));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 2u);
  const auto ev = ckptfs::ExtentsOf(b.catalog->tensors[0]), ew = ckptfs::ExtentsOf(b.catalog->tensors[1]);
  BOOST_TEST(ev[0].offset == head.size() + 8 + 4 * (2 + 1));
  BOOST_TEST(ev[0].length == 12u);
  BOOST_TEST(ew[0].offset == head.size() + 8 + 4 * 4);
  BOOST_TEST(b.catalog->tensors[0].storage_id == b.catalog->tensors[1].storage_id);
}

BOOST_AUTO_TEST_CASE(a_view_past_its_root_storage_is_corrupt) {
  PickleBuilder obj;
  obj.Proto(2).EmptyDict().Mark().BinUnicode("v").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  Pid(&obj, "FloatStorage", "r", 8, "v1", 6, 4);
  Tensor1d(&obj, 0, 4);
  obj.SetItems().Stop();
  Built b(Header() + obj.bytes() + KeyList({"r"}) + Storage(8, PatternBytes(32, 3)));
  CheckError(b.status, b.path, Status::Code::kCorruption, "storage view of storage 'r' lies outside it");
}

BOOST_AUTO_TEST_CASE(module_source_records_are_not_storages) {
  // torch.save(model) adds ('module', <class>, source file, source) persistent ids.
  PickleBuilder obj;
  obj.Proto(2).EmptyDict().Mark().BinUnicode("cls");
  obj.Mark().BinUnicode("module").Global("mymodels", "Net").BinUnicode("net.py").BinUnicode("class Net: ...").Tuple().BinPersId();
  obj.BinUnicode("w").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  Pid(&obj, "LongStorage", "5", 1);
  Tensor1d(&obj, 0, 1);
  obj.SetItems().Stop();
  Built b(Header() + obj.bytes() + KeyList({"5"}) + Storage(1, PatternBytes(8, 4)));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 1u);
  BOOST_TEST(b.catalog->tensors[0].key == "w");
}

BOOST_AUTO_TEST_CASE(big_endian_writer_is_refused) {
  PickleBuilder obj;
  obj.Proto(2).EmptyDict().Stop();
  Built b(Header(false) + obj.bytes() + KeyList({}));
  CheckError(b.status, b.path, Status::Code::kNotSupported, "written on a big-endian machine");
}

BOOST_AUTO_TEST_CASE(a_large_object_pickle_is_read_past_the_first_window) {
  // A 100 KB string makes the object pickle outgrow the first 4 KB window several times.
  PickleBuilder obj;
  obj.Proto(2).EmptyDict().Mark().BinUnicode("note").BinUnicode(std::string(100000, 'x'));
  obj.BinUnicode("w").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  Pid(&obj, "FloatStorage", "0", 2);
  Tensor1d(&obj, 0, 2);
  obj.SetItems().Stop();
  const std::string head = Header() + obj.bytes() + KeyList({"0"});
  Built b(head + Storage(2, PatternBytes(8, 5)));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_TEST(ckptfs::ExtentsOf(b.catalog->tensors[0])[0].offset == head.size() + 8);
  BOOST_TEST(b.catalog->metadata["note"].get<std::string>().size() == 100000u);
}

BOOST_AUTO_TEST_CASE(a_python2_stream_is_read_as_torch_load_with_latin1) {
  // As Python 2 wrote it (the pretrained weights of the lpips package): str as
  // SHORT_BINSTRING, numel as LONG1, a CUDA location, and the state dict as
  // OrderedDict([[key, tensor], ...]).
  auto Str = [](PickleBuilder* p, std::string_view s) { p->Op('U').Op(static_cast<uint8_t>(s.size())).Raw(s); };
  PickleBuilder obj;
  obj.Proto(2).Global("collections", "OrderedDict").EmptyList().Mark();
  for (const char* key : {"lin0.weight", "lin\xe9.weight"}) {
    obj.EmptyList().Mark();
    Str(&obj, key);
    obj.Global("torch._utils", "_rebuild_tensor_v2").Mark().Mark();
    Str(&obj, "storage");
    obj.Global("torch", "FloatStorage");
    Str(&obj, key[3] == '0' ? "140" : "141");
    Str(&obj, "cuda:0");
    obj.Long1(std::string("\x04", 1)).None().Tuple().BinPersId();
    obj.BinInt1(0).Mark().BinInt1(1).BinInt1(4).Tuple().Mark().BinInt1(4).BinInt1(1).Tuple().NewFalse().None();
    obj.Tuple().Reduce().Op('e');
  }
  obj.Op('e').Op(0x85).Reduce().Stop();
  PickleBuilder keys;
  keys.Proto(2).EmptyList().Mark();
  Str(&keys, "140");
  Str(&keys, "141");
  keys.Op('e').Stop();
  const std::string head = Header() + obj.bytes() + keys.bytes();
  Built b(head + Storage(4, PatternBytes(16, 1)) + Storage(4, PatternBytes(16, 2)));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());
  BOOST_REQUIRE_EQUAL(b.catalog->tensors.size(), 2u);
  BOOST_TEST(b.catalog->tensors[0].key == "lin0.weight");
  BOOST_TEST(b.catalog->tensors[1].key == "lin\xc3\xa9.weight");  // latin1 é
  BOOST_TEST(b.catalog->tensors[1].shape == std::vector<uint64_t>({1, 4}), boost::test_tools::per_element());
  BOOST_TEST(ckptfs::ExtentsOf(b.catalog->tensors[1]).at(0).offset == head.size() + 8 + 16 + 8);
}

BOOST_AUTO_TEST_CASE(a_storage_inside_an_object_ckptfs_does_not_understand_is_refused) {
  PickleBuilder obj;
  obj.Proto(2).EmptyDict().Mark().BinUnicode("epoch").BinInt1(1).SetItems().Stop();
  Built b(Header() + obj.bytes() + KeyList({}));
  BOOST_REQUIRE_MESSAGE(b.status.ok(), b.status.message());  // no storage: nothing to serve
  PickleBuilder q;
  q.Proto(2).EmptyDict().BinUnicode("w").Global("mod", "Opaque").EmptyTuple().Reduce().Mark();
  Pid(&q, "FloatStorage", "0", 2);
  q.Tuple().Op('b').SetItem().Stop();  // BUILD with a tuple state holding the storage
  Built c(Header() + q.bytes() + KeyList({"0"}) + Storage(2, PatternBytes(8, 1)));
  CheckError(c.status, c.path, Status::Code::kNotSupported, "'w': an object of class mod.Opaque holding tensors");
}
