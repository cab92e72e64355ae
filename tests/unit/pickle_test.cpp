// The non-executing pickle machine on hand-assembled opcode streams (protocols 0, 2, 4),
// malformed streams, and the globals it must refuse.
#define BOOST_TEST_MODULE pickle_test
#include <boost/test/unit_test.hpp>

#include <cstring>
#include <functional>

#include "codec/pickle.hpp"
#include "test_util.hpp"

using ckptfs::ParsePickle;
using ckptfs::Pickle;
using ckptfs::PyRef;
using ckptfs::PyValue;
using ckptfs::Status;
using K = PyValue::Kind;
using namespace ckptfs_test;

namespace {

constexpr std::string_view kWhere = "ck.pt: data.pkl";

Pickle MustParse(std::string_view bytes) {
  Pickle p;
  Status s = ParsePickle(bytes, kWhere, &p);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE(p.root != nullptr);
  return p;
}

Status ParseStatus(std::string_view bytes) {
  Pickle p;
  return ParsePickle(bytes, kWhere, &p);
}

void CheckFails(std::string_view bytes, Status::Code code, std::string_view expected_part) {
  Status s = ParseStatus(bytes);
  BOOST_TEST(!s.ok());
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(code), s.message());
  BOOST_TEST(StartsWith(s.message(), std::string(kWhere) + ": "), s.message());
  BOOST_TEST(Contains(s.message(), expected_part), s.message());
}

// The value of `dict` under string key `key` (dict entries keep insertion order).
const PyValue* Get(const PyValue* dict, std::string_view key) {
  for (const auto& [k, v] : dict->entries())
    if (k->kind() == K::kStr && k->s() == key) return v;
  BOOST_FAIL("no key " << key);
  return nullptr;
}

}  // namespace

BOOST_AUTO_TEST_CASE(protocol2_dict_of_scalars) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().BinPut(0).Mark();
  p.BinUnicode("k1").BinInt1(200);
  p.BinUnicode("k2").BinInt2(0xBEEF);  // BININT2 is unsigned
  p.BinUnicode("k3").BinInt(-123456);
  p.BinUnicode("k4").BinFloat(1e-3);
  p.BinUnicode("k5").Long1(std::string("\x00\x00\x00\x00\x00\x00\x00\x00\x01", 9));  // 2**64
  p.BinUnicode("k6").Long1("\xff");                                                   // -1
  p.BinUnicode("k7").Long1(std::string("\x00\x00\x00\x00\x01", 5));                 // 2**32
  p.BinUnicode("k8").Long1("");                                                       // 0
  p.BinUnicode("k9").Long1(std::string("\x00\x00\x00\x00\x00\x00\x00\x80", 8));       // -2**63
  p.BinUnicode("k10").Long1(std::string("\x00\x00\x00\x00\x00\x00\x00\x00\xff", 9));  // -2**64
  p.BinUnicode("n").None().BinUnicode("t").Op(0x88).BinUnicode("f").Op(0x89);
  p.BinUnicode("caf\xc3\xa9").BinUnicode("");
  p.SetItems().Stop();
  Pickle pk = MustParse(p.bytes());
  const PyValue* d = pk.root;
  BOOST_REQUIRE(d->kind() == K::kDict);
  BOOST_REQUIRE_EQUAL(d->entries().size(), 14u);
  BOOST_TEST(d->entries()[0].first->s() == "k1");
  BOOST_TEST(d->entries()[13].first->s() == "caf\xc3\xa9");
  BOOST_TEST((Get(d, "k1")->kind() == K::kInt));
  BOOST_TEST(Get(d, "k1")->i() == 200);
  BOOST_TEST(Get(d, "k2")->i() == 0xBEEF);
  BOOST_TEST(Get(d, "k3")->i() == -123456);
  BOOST_TEST((Get(d, "k4")->kind() == K::kFloat));
  BOOST_TEST(Get(d, "k4")->f() == 1e-3);
  BOOST_TEST((Get(d, "k5")->kind() == K::kBigInt));
  BOOST_TEST(Get(d, "k5")->s() == "0x010000000000000000");
  BOOST_TEST(Get(d, "k6")->i() == -1);
  BOOST_TEST(Get(d, "k7")->i() == 4294967296LL);
  BOOST_TEST((Get(d, "k8")->kind() == K::kInt));
  BOOST_TEST(Get(d, "k8")->i() == 0);
  BOOST_TEST(Get(d, "k9")->i() == INT64_MIN);
  BOOST_TEST(Get(d, "k10")->s() == "0xff0000000000000000");
  BOOST_TEST((Get(d, "n")->kind() == K::kNone));
  BOOST_TEST((Get(d, "t")->kind() == K::kBool));
  BOOST_TEST(Get(d, "t")->b() == true);
  BOOST_TEST(Get(d, "f")->b() == false);
  BOOST_TEST(Get(d, "caf\xc3\xa9")->s() == "");
}

BOOST_AUTO_TEST_CASE(tuples_lists_and_sets) {
  PickleBuilder p;  // TUPLE1/2/3, MARK+TUPLE, APPENDS, APPEND, LIST, ADDITEMS
  p.Proto(2).Mark();
  p.EmptyTuple();
  p.BinInt1(1).Op(0x85);
  p.BinInt1(1).BinInt1(2).Tuple2();
  p.BinInt1(1).BinInt1(2).BinInt1(3).Op(0x87);
  p.Mark().BinInt1(4).BinInt1(5).BinInt1(6).BinInt1(7).Tuple();
  p.EmptyList().Mark().BinInt1(8).BinInt1(9).Op('e').BinInt1(10).Op('a');
  p.Mark().BinInt1(11).Op('l');
  p.Op(0x8f).Mark().BinInt1(12).Op(0x90);  // EMPTY_SET, ADDITEMS
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const PyValue* t = pk.root;
  BOOST_REQUIRE(t->kind() == K::kTuple);
  BOOST_REQUIRE_EQUAL(t->items().size(), 8u);
  BOOST_TEST(t->items()[0]->items().size() == 0u);
  BOOST_TEST(t->items()[1]->items().size() == 1u);
  BOOST_TEST(t->items()[2]->items().size() == 2u);
  BOOST_TEST(t->items()[3]->items().size() == 3u);
  BOOST_TEST(t->items()[3]->items()[2]->i() == 3);
  BOOST_TEST(t->items()[4]->items().size() == 4u);
  BOOST_TEST(t->items()[4]->items()[3]->i() == 7);
  const PyValue* list = t->items()[5];
  BOOST_REQUIRE(list->kind() == K::kList);
  BOOST_REQUIRE_EQUAL(list->items().size(), 3u);
  BOOST_TEST(list->items()[0]->i() == 8);
  BOOST_TEST(list->items()[2]->i() == 10);
  BOOST_TEST((t->items()[6]->kind() == K::kList));
  BOOST_REQUIRE_EQUAL(t->items()[6]->items().size(), 1u);
  BOOST_TEST(t->items()[6]->items()[0]->i() == 11);
  BOOST_TEST((t->items()[7]->kind() == K::kSet));
  BOOST_REQUIRE_EQUAL(t->items()[7]->items().size(), 1u);
  BOOST_TEST(t->items()[7]->items()[0]->i() == 12);
}

BOOST_AUTO_TEST_CASE(memo_binput_binget_share_values) {
  PickleBuilder p;
  p.Proto(2).Mark().BinUnicode("shared").BinPut(3).EmptyList().BinPut(200).BinGet(3).BinGet(200);
  p.Op('j').Raw(LE32(200));  // LONG_BINGET
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const auto& items = pk.root->items();
  BOOST_REQUIRE_EQUAL(items.size(), 5u);
  BOOST_TEST(items[2] == items[0]);  // the same node, not a copy
  BOOST_TEST(items[3] == items[1]);
  BOOST_TEST(items[4] == items[1]);
  BOOST_TEST(items[2]->s() == "shared");
}

BOOST_AUTO_TEST_CASE(memoize_numbers_by_memo_size) {
  PickleBuilder p;
  p.Proto(4).Mark().ShortBinUnicode("x").Op(0x94).ShortBinUnicode("y").Op(0x94);
  p.BinGet(1).BinGet(0).Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const auto& items = pk.root->items();
  BOOST_REQUIRE_EQUAL(items.size(), 4u);
  BOOST_TEST(items[2]->s() == "y");
  BOOST_TEST(items[3]->s() == "x");
  BOOST_TEST(items[2] == items[1]);
}

BOOST_AUTO_TEST_CASE(memoize_after_overwritten_and_sparse_puts) {
  // MEMOIZE stores at len(memo), as CPython's Unpickler does: a PUT that overwrites a slot
  // does not grow the memo. pickle.loads of this stream gives ('a', 'b', 'c', 'c', 'b').
  PickleBuilder p;
  p.Proto(4).Mark().ShortBinUnicode("a").BinPut(0).ShortBinUnicode("b").BinPut(0);
  p.ShortBinUnicode("c").Op(0x94).BinGet(1).BinGet(0).Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  BOOST_REQUIRE_EQUAL(pk.root->items().size(), 5u);
  BOOST_TEST(pk.root->items()[3]->s() == "c");
  BOOST_TEST(pk.root->items()[4]->s() == "b");

  // A PUT far beyond the pickle's size, then MEMOIZE at len(memo) == 1:
  // pickle.loads gives ('a', 'b', 'b', 'a').
  PickleBuilder q;
  q.Proto(4).Mark().ShortBinUnicode("a").Op('r').Raw(LE32(0xFFFFFFF0u)).ShortBinUnicode("b").Op(0x94);
  q.BinGet(1).Op('j').Raw(LE32(0xFFFFFFF0u)).Tuple().Stop();
  Pickle pq = MustParse(q.bytes());
  BOOST_REQUIRE_EQUAL(pq.root->items().size(), 4u);
  BOOST_TEST(pq.root->items()[2]->s() == "b");
  BOOST_TEST(pq.root->items()[3]->s() == "a");
}

BOOST_AUTO_TEST_CASE(protocol4_frame_stack_global_newobj_build) {
  // What `pickle.dumps(OrderedDict(), protocol=4)`-style streams look like: framed,
  // names as SHORT_BINUNICODE, classes through STACK_GLOBAL, objects via NEWOBJ + BUILD.
  PickleBuilder body;
  body.ShortBinUnicode("collections").Op(0x94).ShortBinUnicode("OrderedDict").Op(0x94).Op(0x93).Op(0x94);
  body.EmptyTuple().Op(0x81).Op(0x94);  // NEWOBJ
  body.EmptyDict().ShortBinUnicode("version").BinInt1(1).SetItem().Op('b');  // BUILD
  body.Stop();
  PickleBuilder p;
  p.Proto(4).Frame(body.bytes().size()).Raw(body.bytes());
  Pickle pk = MustParse(p.bytes());
  const PyValue* obj = pk.root;
  BOOST_REQUIRE(obj->kind() == K::kObject);
  BOOST_TEST(obj->CallableName() == "collections.OrderedDict");
  BOOST_TEST(obj->callable()->IsGlobal("collections", "OrderedDict"));
  BOOST_REQUIRE(obj->args());
  BOOST_TEST((obj->args()->kind() == K::kTuple));
  BOOST_TEST(obj->args()->items().empty());
  BOOST_TEST(obj->kwargs() == nullptr);
  BOOST_REQUIRE(obj->state());
  BOOST_TEST((obj->state()->kind() == K::kDict));
  BOOST_TEST(Get(obj->state(), "version")->i() == 1);
}

BOOST_AUTO_TEST_CASE(reduce_and_setitems_on_an_object) {
  // torch state_dicts: OrderedDict() by REDUCE, items by SETITEMS, _metadata by BUILD.
  PickleBuilder p;
  p.Proto(2).Global("collections", "OrderedDict").BinPut(0).EmptyTuple().Reduce().BinPut(1);
  p.Mark().BinUnicode("w").BinInt1(7).BinUnicode("b").BinInt1(8).SetItems();
  p.EmptyDict().Op('b').Stop();
  Pickle pk = MustParse(p.bytes());
  const PyValue* obj = pk.root;
  BOOST_REQUIRE(obj->kind() == K::kObject);
  BOOST_TEST(obj->CallableName() == "collections.OrderedDict");
  BOOST_REQUIRE_EQUAL(obj->entries().size(), 2u);
  BOOST_TEST(obj->entries()[1].first->s() == "b");
  BOOST_TEST(obj->entries()[1].second->i() == 8);
  BOOST_TEST((obj->state()->kind() == K::kDict));
}

BOOST_AUTO_TEST_CASE(binpersid_wraps_the_storage_tuple) {
  PickleBuilder p;
  p.Proto(2).Mark().BinUnicode("storage").Global("torch", "FloatStorage").BinUnicode("0").BinUnicode("cpu");
  p.BinInt2(512).Tuple().BinPersId().Stop();
  Pickle pk = MustParse(p.bytes());
  const PyValue* pid = pk.root;
  BOOST_REQUIRE(pid->kind() == K::kPersistent);
  BOOST_REQUIRE(pid->args());
  BOOST_REQUIRE_EQUAL(pid->args()->items().size(), 5u);
  BOOST_TEST(pid->args()->items()[0]->s() == "storage");
  BOOST_TEST(pid->args()->items()[1]->IsGlobal("torch", "FloatStorage"));
  BOOST_TEST(pid->args()->items()[4]->i() == 512);
}

BOOST_AUTO_TEST_CASE(protocol0_text_opcodes) {
  std::string bytes =
      "(dp0\n"
      "S'name'\np1\nS'demo'\np2\ns"
      "S'n'\nI-42\ns"
      "S'big'\nI123456789012345678901234567890\ns"
      "S'long'\nL7L\ns"
      "S'flag'\nI01\ns"
      "S'x'\nF0.25\ns"
      "S'u'\nVh\xe9llo\ns"  // raw-unicode-escape, as Python writes u'h\xe9llo'
      "S'u2'\nV\\u20ac\\\\u\xc3\ns"  // \u20ac; an even run of backslashes is no escape; latin1 byte
      "S'again'\ng1\ns"
      "S'set'\nc__builtin__\nset\n((lp3\nI5\natRs"
      "S'ns'\n(I1\nI2\niargparse\nNamespace\ns"
      ".";
  Pickle pk = MustParse(bytes);
  const PyValue* d = pk.root;
  BOOST_REQUIRE(d->kind() == K::kDict);
  BOOST_REQUIRE_EQUAL(d->entries().size(), 11u);
  BOOST_TEST(Get(d, "name")->s() == "demo");
  BOOST_TEST(Get(d, "n")->i() == -42);
  BOOST_TEST((Get(d, "big")->kind() == K::kBigInt));
  BOOST_TEST(Get(d, "big")->s() == "123456789012345678901234567890");
  BOOST_TEST(Get(d, "long")->i() == 7);
  BOOST_TEST((Get(d, "flag")->kind() == K::kBool));
  BOOST_TEST(Get(d, "flag")->b() == true);
  BOOST_TEST(Get(d, "x")->f() == 0.25);
  BOOST_TEST(Get(d, "u")->s() == "h\xc3\xa9llo");
  BOOST_TEST(Get(d, "u2")->s() == "\xe2\x82\xac\\\\u\xc3\x83");
  BOOST_TEST(Get(d, "again") == d->entries()[0].first);  // GET of memo 1: the 'name' key
  const PyValue* set = Get(d, "set");
  // Python 2's module names, as Python 3 maps them below protocol 3 (fix_imports).
  BOOST_TEST(set->CallableName() == "builtins.set");
  BOOST_REQUIRE_EQUAL(set->args()->items().size(), 1u);
  BOOST_REQUIRE_EQUAL(set->args()->items()[0]->items().size(), 1u);
  BOOST_TEST(set->args()->items()[0]->items()[0]->i() == 5);
  const PyValue* ns = Get(d, "ns");  // INST
  BOOST_TEST(ns->CallableName() == "argparse.Namespace");
  BOOST_REQUIRE_EQUAL(ns->args()->items().size(), 2u);
  BOOST_TEST(ns->args()->items()[1]->i() == 2);
}

// ---- Python 2 forms, read as torch.load(encoding="latin1") reads them -----------------------

BOOST_AUTO_TEST_CASE(python2_byte_strings_are_latin1_text) {
  PickleBuilder p;
  p.Proto(2).Mark();
  p.Op('U').Op(2).Raw("ab");                                   // SHORT_BINSTRING, ASCII
  p.Op('U').Op(3).Raw("\xe9t\xe9");                             // SHORT_BINSTRING, latin1 bytes
  p.Op('T').Raw(std::string("\x02\x00\x00\x00", 4)).Raw("\xff!");  // BINSTRING
  p.Op('S').Raw("'a\\x41\\101\\n\\'q\\\\\\z'\n");               // STRING: \x41 \101 \n \' \\ \z
  p.Op('S').Raw("\"\xe9\"\n");                                  // STRING, double quotes, latin1
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const auto& items = pk.root->items();
  BOOST_REQUIRE_EQUAL(items.size(), 5u);
  for (const PyValue* item : items) BOOST_TEST((item->kind() == K::kStr));
  BOOST_TEST(items[0]->s() == "ab");
  BOOST_TEST(items[1]->s() == "\xc3\xa9t\xc3\xa9");
  BOOST_TEST(items[2]->s() == "\xc3\xbf!");
  BOOST_TEST(items[3]->s() == "aAA\n'q\\\\z");
  BOOST_TEST(items[4]->s() == "\xc3\xa9");
  // What Python refuses: an unquoted STRING, a short \x escape, a trailing backslash, a
  // \u escape with too few digits.
  CheckFails("S abc\n.", Status::Code::kCorruption, "STRING operand is not quoted");
  CheckFails("S'\\x4'\n.", Status::Code::kCorruption, "STRING operand with a malformed escape");
  CheckFails("S'ab\\'\n.", Status::Code::kCorruption, "STRING operand with a malformed escape");
  CheckFails("V\\u12\n.", Status::Code::kCorruption, "UNICODE operand with a malformed");
}

BOOST_AUTO_TEST_CASE(python2_names_are_mapped_below_protocol_3) {
  PickleBuilder p;
  p.Proto(2).Mark().Global("__builtin__", "long").Global("copy_reg", "_reconstructor").Global("__builtin__", "set");
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  BOOST_TEST(pk.root->items()[0]->IsGlobal("builtins", "int"));
  BOOST_TEST(pk.root->items()[1]->IsGlobal("copyreg", "_reconstructor"));
  BOOST_TEST(pk.root->items()[2]->IsGlobal("builtins", "set"));
  // Protocol 3 and above are Python 3's: names stay as written.
  PickleBuilder q;
  q.Proto(3).Global("__builtin__", "set").Stop();
  BOOST_TEST(MustParse(q.bytes()).root->IsGlobal("__builtin__", "set"));
  // A Python 2 name that maps to a code-running one is refused under the name written.
  PickleBuilder r;
  r.Proto(2).Global("__builtin__", "intern").Mark().BinUnicode("x").Tuple().Reduce().Stop();
  Status s = ParseStatus(r.bytes());
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kRefused));
  BOOST_TEST(Contains(s.message(), "__builtin__.intern"), s.message());
}

BOOST_AUTO_TEST_CASE(ordered_dict_called_with_a_list_of_pairs_holds_them_as_entries) {
  // Python 2's OrderedDict.__reduce__: OrderedDict([[k, v], ...]), then BUILD of its
  // attributes; here with a tuple pair too, and the list appended to after the call, which
  // Python's OrderedDict never sees.
  PickleBuilder p;
  p.Proto(2).Global("collections", "OrderedDict").EmptyList().BinPut(0).Mark();
  p.EmptyList().Mark().Op('U').Op(1).Raw("a").BinInt1(1).Op('e');
  p.Op('U').Op(1).Raw("b").BinInt1(2).Tuple2();
  p.Op('e').Op(0x85).Reduce();
  p.EmptyDict().Op('U').Op(9).Raw("_metadata").EmptyDict().SetItem().Op('b');
  p.BinGet(0).EmptyList().Mark().Op('U').Op(1).Raw("c").BinInt1(3).Op('e').Op('a').Op('0');
  p.Stop();
  Pickle pk = MustParse(p.bytes());
  const PyValue* od = pk.root;
  BOOST_REQUIRE((od->kind() == K::kObject));
  BOOST_TEST(od->CallableName() == "collections.OrderedDict");
  BOOST_TEST(od->args()->items().empty());
  BOOST_REQUIRE_EQUAL(od->entries().size(), 2u);
  BOOST_TEST(od->entries()[0].first->s() == "a");
  BOOST_TEST(od->entries()[0].second->i() == 1);
  BOOST_TEST(od->entries()[1].first->s() == "b");
  BOOST_TEST(od->entries()[1].second->i() == 2);
  BOOST_TEST(Get(od->state(), "_metadata") != nullptr);
  // An argument of another shape (a triple) is left as it is.
  PickleBuilder q;
  q.Proto(2).Global("collections", "OrderedDict").EmptyList().Mark();
  q.BinInt1(1).BinInt1(2).BinInt1(3).Op(0x87).Op('e').Op(0x85).Reduce().Stop();
  Pickle odd = MustParse(q.bytes());
  BOOST_TEST(odd.root->entries().empty());
  BOOST_TEST(odd.root->args()->items().size() == 1u);
}

BOOST_AUTO_TEST_CASE(unknown_benign_global_becomes_an_object) {
  PickleBuilder p;
  p.Proto(2).Global("argparse", "Namespace").EmptyTuple().Reduce();
  p.EmptyDict().BinUnicode("lr").BinFloat(0.5).SetItem().Op('b').Stop();
  Pickle pk = MustParse(p.bytes());
  BOOST_TEST((pk.root->kind() == K::kObject));
  BOOST_TEST(pk.root->CallableName() == "argparse.Namespace");
  BOOST_TEST(Get(pk.root->state(), "lr")->f() == 0.5);
}

// ---- malformed streams -------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(truncated_inside_an_opcode) {
  using C = Status::Code;
  CheckFails(std::string("\x80\x02X\x05\x00\x00\x00" "ab", 9), C::kCorruption, "length runs past the end of the pickle");
  CheckFails(std::string("\x80\x02J\x01\x00", 5), C::kCorruption, "truncated pickle at byte 2");
  CheckFails(std::string("\x80", 1), C::kCorruption, "truncated pickle at byte 0");
  CheckFails("\x80\x02G\x3f\xf0", C::kCorruption, "truncated pickle");
  CheckFails("ctorch\nFloatSt", C::kCorruption, "truncated pickle");
  CheckFails(std::string("\x80\x02N", 3), C::kCorruption, "pickle ends without STOP");
  CheckFails("", C::kCorruption, "pickle ends without STOP");
}

BOOST_AUTO_TEST_CASE(every_prefix_of_a_valid_pickle_fails_cleanly) {
  PickleBuilder p;
  p.Proto(2).EmptyDict().BinPut(0).Mark().BinUnicode("model").BinPut(1);
  PickleTensor(&p, "FloatStorage", "0", 6, 0, {2, 3}, {3, 1});
  p.BinUnicode("lr").BinFloat(0.1).BinUnicode("big").Long1(std::string(12, '\x7f')).SetItems().Stop();
  const std::string& full = p.bytes();
  MustParse(full);
  for (size_t n = 0; n < full.size(); ++n) {
    Status s = ParseStatus(std::string_view(full).substr(0, n));
    BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kCorruption), "prefix " << n << ": " << s.message());
  }
}

BOOST_AUTO_TEST_CASE(unknown_opcode) {
  CheckFails(std::string("\x80\x02\xff.", 4), Status::Code::kCorruption, "unknown opcode 0xff at byte 2");
}

BOOST_AUTO_TEST_CASE(unsupported_protocol) {
  CheckFails(std::string("\x80\x06N.", 4), Status::Code::kCorruption, "unsupported pickle protocol 6");
}

BOOST_AUTO_TEST_CASE(stack_underflow) {
  CheckFails(std::string("\x80\x02R.", 4), Status::Code::kCorruption, "stack underflow");
  CheckFails(std::string("\x80\x02K\x01s.", 6), Status::Code::kCorruption, "stack underflow");
  // Values below a MARK are out of reach until the mark is popped.
  CheckFails(std::string("\x80\x02K\x01(\x85.", 7), Status::Code::kCorruption, "stack underflow");
  CheckFails(std::string("\x80\x02K\x01t.", 6), Status::Code::kCorruption, "MARK expected");
  CheckFails(std::string("\x80\x02NN.", 5), Status::Code::kCorruption, "STOP with a malformed stack");
}

BOOST_AUTO_TEST_CASE(get_of_a_missing_memo_key) {
  CheckFails(std::string("\x80\x02Nq\x01h\x07.", 8), Status::Code::kCorruption, "memo key 7 was never stored");
  CheckFails("g12\n.", Status::Code::kCorruption, "memo key 12 was never stored");
}

BOOST_AUTO_TEST_CASE(ext_opcodes_are_not_supported) {
  CheckFails(std::string("\x80\x02\x82\x01.", 5), Status::Code::kNotSupported, "extension registry");
}

// ---- globals that would run code -----------------------------------------------------------

BOOST_AUTO_TEST_CASE(os_system_is_refused) {
  PickleBuilder p;
  p.Proto(2).Global("os", "system").Mark().BinUnicode("echo pwned").Tuple().Reduce().Stop();
  Status s = ParseStatus(p.bytes());
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kRefused));
  BOOST_TEST(StartsWith(s.message(), std::string(kWhere) + ": "), s.message());
  BOOST_TEST(Contains(s.message(), "os.system"), s.message());
}

BOOST_AUTO_TEST_CASE(code_running_globals_are_refused_however_named) {
  struct Case { std::string module, name; };
  const Case cases[] = {{"builtins", "eval"}, {"subprocess", "Popen"}, {"__builtin__", "exec"},
                        {"posix", "system"}, {"os.path", "join"}, {"builtins", "getattr"},
                        {"importlib", "import_module"}, {"operator", "attrgetter"}, {"runpy", "run_path"}};
  for (const Case& c : cases) {
    // Through STACK_GLOBAL (protocol 4)...
    PickleBuilder p;
    p.Proto(4).ShortBinUnicode(c.module).ShortBinUnicode(c.name).Op(0x93);
    p.Mark().ShortBinUnicode("id").Tuple().Reduce().Stop();
    Status s = ParseStatus(p.bytes());
    BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kRefused), c.module << "." << c.name);
    BOOST_TEST(Contains(s.message(), c.module + "." + c.name), s.message());
    // ...and through INST (protocol 0), which calls without REDUCE.
    std::string inst = "(S'id'\ni" + c.module + "\n" + c.name + "\n.";
    s = ParseStatus(inst);
    BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kRefused), inst);
  }
}

BOOST_AUTO_TEST_CASE(harmless_builtins_are_not_refused) {
  for (std::string_view name : {"set", "slice", "complex", "bytearray"}) {
    PickleBuilder p;
    p.Proto(2).Global("builtins", name).EmptyTuple().Reduce().Stop();
    Pickle pk = MustParse(p.bytes());
    BOOST_TEST(pk.root->CallableName() == "builtins." + std::string(name));
  }
}

// ---- resource limits ------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(memory_limit_stops_a_dup_bomb) {
  // One list, duplicated on the stack 200,000 times: 200 KB of opcodes ask for 1.6 MB of
  // stack, more than the 1 MiB allowed here. Without the limit, a 1 GiB pickle would ask
  // for 8 GiB this way.
  std::string bytes("\x80\x02]", 3);
  bytes += std::string(200000, '2');
  bytes += '.';
  Pickle p;
  Status s = ParsePickle(bytes, kWhere, &p, uint64_t{1} << 20);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kRefused), s.message());
  BOOST_TEST(s.limit_option() == "max_pickle_memory", s.message());
}

BOOST_AUTO_TEST_CASE(memory_limit_counts_values_and_container_slots) {
  // 100,000 empty lists appended to one list: each value costs far more than its opcode.
  std::string bytes("\x80\x02](", 4);
  for (int i = 0; i < 100000; ++i) bytes += ']';
  bytes += "e.";
  Pickle p;
  Status s = ParsePickle(bytes, kWhere, &p, uint64_t{4} << 20);
  BOOST_TEST(static_cast<int>(s.code()) == static_cast<int>(Status::Code::kRefused), s.message());
  // The same pickle parses with the default limit.
  MustParse(bytes);
}

BOOST_AUTO_TEST_CASE(far_memo_index_does_not_allocate_the_gap) {
  // LONG_BINPUT 4,000,000 in a short pickle must not grow the dense memo to that size.
  std::string bytes("\x80\x02Nr", 4);
  bytes += LE32(4000000);
  bytes += "j" + LE32(4000000) + "0.";
  Pickle p;
  Status s = ParsePickle(bytes, kWhere, &p, uint64_t{1} << 20);
  BOOST_TEST(s.ok(), s.message());
}

// Tuples of numbers, large ints and torch.Size of such tuples are shared values (a DCP
// .metadata repeats them per chunk); a BUILD on a shared torch.Size changes a copy, so the
// other references keep what they were.
BOOST_AUTO_TEST_CASE(repeated_number_tuples_and_sizes_are_shared_and_copied_before_a_change) {
  PickleBuilder p;
  p.Proto(2).Mark();
  p.BinInt(70000).BinInt1(3).Tuple2();                                          // 0: (70000, 3)
  p.BinInt(70000).BinInt1(3).Tuple2();                                          // 1: the same
  p.Global("torch", "Size").BinInt(70000).BinInt1(3).Tuple2().Op(0x85).Reduce();  // 2: Size((70000, 3))
  p.Global("torch", "Size").BinInt(70000).BinInt1(3).Tuple2().Op(0x85).Reduce();  // 3: the same, then BUILD
  p.EmptyDict().Op('b');
  p.BinUnicode("x").BinInt1(1).Tuple2();                                        // 4: not numbers only
  p.BinUnicode("x").BinInt1(1).Tuple2();                                        // 5
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const auto& items = pk.root->items();
  BOOST_REQUIRE_EQUAL(items.size(), 6u);
  BOOST_TEST(items[0] == items[1]);
  BOOST_TEST(items[0]->items()[0]->i() == 70000);
  BOOST_TEST(items[2]->CallableName() == "torch.Size");
  BOOST_TEST(items[2]->state() == nullptr);  // the BUILD went to a copy
  BOOST_TEST(items[3] != items[2]);
  BOOST_TEST(items[3]->CallableName() == "torch.Size");
  BOOST_TEST((items[3]->state() != nullptr && items[3]->state()->kind() == K::kDict));
  BOOST_TEST(items[3]->args() == items[2]->args());
  BOOST_TEST(items[4] != items[5]);
  BOOST_TEST(items[4]->items()[0]->s() == "x");
}

BOOST_AUTO_TEST_CASE(items_appended_to_a_shared_size_go_to_copies_of_their_own) {
  // Every change to a shared (interned) object goes to a fresh copy: two changed copies
  // and the shared original hold different items.
  PickleBuilder p;
  p.Proto(2).Mark();
  p.Global("torch", "Size").BinInt1(2).BinInt1(3).Tuple2().Op(0x85).Reduce();   // 0: Size((2, 3))
  p.Mark().BinInt1(7).Op('e');                                                   //    APPENDS 7 to it
  p.Global("torch", "Size").BinInt1(2).BinInt1(3).Tuple2().Op(0x85).Reduce();   // 1: the shared Size
  p.Mark().BinInt1(8).BinInt1(9).Op('e');                                        //    APPENDS 8, 9 to a copy
  p.Global("torch", "Size").BinInt1(2).BinInt1(3).Tuple2().Op(0x85).Reduce();   // 2: the shared Size again
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const auto& items = pk.root->items();
  BOOST_REQUIRE_EQUAL(items.size(), 3u);
  BOOST_REQUIRE_EQUAL(items[0]->items().size(), 1u);
  BOOST_TEST(items[0]->items()[0]->i() == 7);
  BOOST_REQUIRE_EQUAL(items[1]->items().size(), 2u);  // a copy of its own: not 7, 8, 9
  BOOST_TEST(items[1]->items()[0]->i() == 8);
  BOOST_TEST(items[1]->items()[1]->i() == 9);
  BOOST_TEST(items[2] != items[0]);
  BOOST_TEST(items[2] != items[1]);
  BOOST_TEST(items[2]->items().empty());  // the interned Size itself was never changed
  BOOST_TEST(items[2]->args() == items[1]->args());
}

BOOST_AUTO_TEST_CASE(lists_and_dicts_grow_one_item_at_a_time_in_order) {
  PickleBuilder p;
  p.Proto(2).Mark().EmptyList();
  for (int k = 0; k < 1000; ++k) p.BinInt2(static_cast<uint16_t>(k)).Op('a');  // APPEND
  p.EmptyDict();
  for (int k = 0; k < 1000; ++k) p.BinUnicode("k" + std::to_string(k)).BinFloat(k * 0.5).SetItem();
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const PyValue* list = pk.root->items()[0];
  const PyValue* dict = pk.root->items()[1];
  BOOST_REQUIRE_EQUAL(list->items().size(), 1000u);
  BOOST_REQUIRE_EQUAL(dict->entries().size(), 1000u);
  for (int k = 0; k < 1000; ++k) {
    BOOST_TEST(list->items()[k]->i() == k);
    BOOST_TEST(dict->entries()[k].first->s() == "k" + std::to_string(k));
    BOOST_TEST(dict->entries()[k].second->f() == k * 0.5);
  }
}

BOOST_AUTO_TEST_CASE(number_tuples_are_shared_by_value) {
  // Ints are not interned; tuples of equal numbers (floats included) still are.
  PickleBuilder p;
  p.Proto(2).Mark();
  p.BinInt(-70000).BinFloat(1.5).Tuple2();
  p.BinInt(-70000).BinFloat(1.5).Tuple2();
  p.BinInt(-70000).BinFloat(2.5).Tuple2();
  p.Tuple().Stop();
  Pickle pk = MustParse(p.bytes());
  const auto& items = pk.root->items();
  BOOST_REQUIRE_EQUAL(items.size(), 3u);
  BOOST_TEST(items[0] == items[1]);
  BOOST_TEST(items[0] != items[2]);
  BOOST_TEST(items[2]->items()[0]->i() == -70000);
  BOOST_TEST(items[2]->items()[1]->f() == 2.5);
  BOOST_TEST(sizeof(PyValue) == 16u);
}

// ---- streamed parses ---------------------------------------------------------------------

namespace {

// Takes every call of `mod.f`, numbering them in parse order.
class TakeCalls : public ckptfs::PickleCallHook {
 public:
  Status OnCall(const PyValue* call, bool* take, uint64_t* index) override {
    *take = call->callable() && call->callable()->IsGlobal("mod", "f");
    if (*take) *index = taken++;
    return Status::OK();
  }
  uint64_t taken = 0;
};

ckptfs::PickleSource SourceOf(const std::string& bytes) {
  ckptfs::PickleSource source;
  source.size = bytes.size();
  source.read = [&bytes](uint64_t offset, size_t length, char* out) {
    if (offset > bytes.size() || length > bytes.size() - offset) return Status::Corruption("mem", "read past the end");
    std::memcpy(out, bytes.data() + offset, length);
    return Status::OK();
  };
  return source;
}

PickleBuilder& LongBinPut(PickleBuilder& p, uint32_t i) { return p.Op('r').Raw(LE32(i)); }
PickleBuilder& LongBinGet(PickleBuilder& p, uint32_t i) { return p.Op('j').Raw(LE32(i)); }

// [mod.f("key", n, [n]) for n in range(calls)], every value memoized as torch does, then
// `tail` appended to the list.
std::string ManyCalls(uint32_t calls, const std::function<void(PickleBuilder&)>& tail = {}) {
  PickleBuilder p;
  p.Proto(2).EmptyList().BinPut(0).Global("mod", "f").BinPut(1).Op('0');
  uint32_t memo = 2;
  for (uint32_t n = 0; n < calls; ++n) {
    p.BinGet(1).Mark().BinUnicode("key");
    LongBinPut(p, memo++).BinInt(static_cast<int32_t>(n)).EmptyList();
    LongBinPut(p, memo++).Mark().BinInt(static_cast<int32_t>(n)).Op('e').Tuple();
    LongBinPut(p, memo++).Reduce();
    LongBinPut(p, memo++).Op('a');  // APPEND
  }
  if (tail) tail(p);
  p.Stop();
  return p.bytes();
}

}  // namespace

BOOST_AUTO_TEST_CASE(streamed_parse_frees_the_arguments_of_taken_calls) {
  const std::string bytes = ManyCalls(20000);
  Pickle plain = MustParse(bytes);
  Pickle streamed;
  TakeCalls hook;
  const ckptfs::PickleSource source = SourceOf(bytes);
  Status s = ckptfs::ParsePickleStreamed(source, kWhere, &hook, &streamed);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_TEST(hook.taken == 20000u);
  BOOST_REQUIRE(streamed.root->kind() == K::kList);
  BOOST_REQUIRE_EQUAL(streamed.root->items().size(), 20000u);
  for (size_t n = 0; n < 20000; ++n) {
    BOOST_REQUIRE(streamed.root->items()[n]->kind() == K::kTaken);
    BOOST_REQUIRE_EQUAL(streamed.root->items()[n]->taken(), n);
  }
  // The values made (one more per call: its kTaken), but the arguments (list, tuple,
  // non-small ints) were freed as each call was taken: the list, its items and the kept
  // strings remain.
  BOOST_TEST(streamed.value_count() == plain.value_count() + 20000);
  BOOST_TEST(streamed.arena_bytes() * 2 < plain.arena_bytes(),
             streamed.arena_bytes() << " bytes streamed, " << plain.arena_bytes() << " plain");
}

BOOST_AUTO_TEST_CASE(streamed_parse_keeps_memoized_strings_and_refuses_dropped_entries) {
  // A string memoized inside a taken call's arguments is read again (torch's storage key of
  // a shared storage): it is kept. The call's argument tuple is dropped with it: reading it
  // again fails the streamed parse (the caller then parses without streaming).
  TakeCalls hook;
  const std::string kept = ManyCalls(3, [](PickleBuilder& p) { LongBinGet(p, 2 + 4 * 2).Op('a'); });
  Pickle streamed;
  const ckptfs::PickleSource kept_source = SourceOf(kept);
  Status s = ckptfs::ParsePickleStreamed(kept_source, kWhere, &hook, &streamed);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE_EQUAL(streamed.root->items().size(), 4u);
  BOOST_TEST((streamed.root->items()[3]->kind() == K::kStr));
  BOOST_TEST(streamed.root->items()[3]->s() == "key");

  const std::string dropped = ManyCalls(3, [](PickleBuilder& p) { LongBinGet(p, 2 + 4 * 1 + 2).Op('a'); });
  BOOST_TEST(MustParse(dropped).root->items().size() == 4u);  // fine without streaming
  const ckptfs::PickleSource dropped_source = SourceOf(dropped);
  s = ckptfs::ParsePickleStreamed(dropped_source, kWhere, &hook, &streamed);
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "holds arguments of a call the streamed parse took"), s.message());

  // BUILD on a taken call would set state on a value that is no longer the call.
  const std::string built = ManyCalls(1, [](PickleBuilder& p) { LongBinGet(p, 5).BinGet(1).Op('b'); });
  const ckptfs::PickleSource built_source = SourceOf(built);
  s = ckptfs::ParsePickleStreamed(built_source, kWhere, &hook, &streamed);
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "BUILD on a call the streamed parse took"), s.message());
}

BOOST_AUTO_TEST_CASE(streamed_parse_reads_operands_across_windows) {
  // The source is read 1 MiB at a time: a 3 MiB string, then line operands and counted
  // strings that straddle window edges, give the values a whole-buffer parse gives.
  PickleBuilder p;
  p.Proto(2).Mark().BinUnicode(std::string(3 << 20, 's'));
  for (int k = 0; k < 60000; ++k) p.Op('c').Raw("mod" + std::to_string(k) + "\nname\n").BinUnicode("v").Op('0').Op('0');
  p.Raw("I123456\n").Raw("F2.5\n").Tuple().Stop();
  const std::string bytes = p.bytes();
  BOOST_REQUIRE_GT(bytes.size(), 4u << 20);
  TakeCalls hook;
  Pickle streamed;
  const ckptfs::PickleSource source = SourceOf(bytes);
  Status s = ckptfs::ParsePickleStreamed(source, kWhere, &hook, &streamed);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE(streamed.root->kind() == K::kTuple);
  BOOST_REQUIRE_EQUAL(streamed.root->items().size(), 3u);
  BOOST_TEST(streamed.root->items()[0]->s() == std::string(3 << 20, 's'));
  BOOST_TEST(streamed.root->items()[1]->i() == 123456);
  BOOST_TEST(streamed.root->items()[2]->f() == 2.5);
  // Cut inside the long string: the parse reports that it ran out.
  const std::string cut = bytes.substr(0, 2 << 20);
  const ckptfs::PickleSource cut_source = SourceOf(cut);
  s = ckptfs::ParsePickleStreamed(cut_source, kWhere, &hook, &streamed);
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "runs past the end of the pickle"), s.message());
}
