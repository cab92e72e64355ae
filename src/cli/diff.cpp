// `ckptfs diff A B`: compares two checkpoints tensor by tensor (include/ckptfs/diff.hpp)
// and prints a one-screen summary or, with --json, the whole result. Exit status as cmp(1)
// and diff(1) have it: 0 equal, 1 different, 2 trouble.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "ckptfs/diff.hpp"
#include "cli/commands.hpp"
#include "cli/progress_bar.hpp"

namespace ckptfs::cli {
namespace {

constexpr char kDiffUsage[] =
    "usage: ckptfs diff [OPTIONS] A B\n"
    "\n"
    "Compares the tensors of two checkpoints of any formats ckptfs reads: keys only in A or\n"
    "only in B, shape and dtype differences, and for tensors on both sides whether their\n"
    "bytes are identical or else how many elements differ, the largest absolute and relative\n"
    "difference and the relative L2 change ||A-B||/||A||, in float64. Exit status: 0 equal,\n"
    "1 different, 2 on error.\n"
    "  ckptfs diff ds_checkpoint/ consolidated.pt\n"
    "  ckptfs diff --dtype-b bf16 --rtol 0.004 model.pt model.pt     # fp32 against its bf16 view\n"
    "  ckptfs diff --root-a model step100.pt step200.safetensors\n"
    "\n"
    "  --json            the whole result as JSON\n";
// After the comparison's own options (the option table's diff groups).
constexpr char kDiffSidesUsage[] =
    "  -a OPT[,OPT...]   options of A only, in the mount's -o spelling (root=model,dtype=bf16)\n"
    "  -b OPT[,OPT...]   options of B only\n"
    "  --NAME-a, --NAME-b\n"
    "                    any option below for one side only: --root-a model, --dtype-b bf16\n"
    "The options below without a suffix apply to both sides.\n";

struct DiffCommand {
  ReadOptions side[2];
  OptionValues own;  // the comparison's options (diff, diff_rows)
  bool json = false;
  std::string source[2];
};

// One argument (with its value, if it takes one) of a side's options.
using OptionArgs = std::vector<std::string>;

// Applies the table option args[0] (and its value) to *options; *known false if it is none.
Status ApplyTableOption(const OptionArgs& args, ReadOptions* options, bool* known) {
  size_t next = 0;
  return ParseCommandLineOption(args, &next, kReadCommandGroups, options, known);
}

// -a/-b OPT,...: each entry one -o option of that side.
void AddSideList(const std::string& list, std::vector<OptionArgs>* side) {
  for (size_t start = 0; start <= list.size();) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string entry = list.substr(start, comma - start);
    start = comma + 1;
    if (!entry.empty()) side->push_back({"-o", entry});
  }
}

// Applies the options of both sides, then each side's own, so that a side's own options win
// whatever their order. Returns -1 to go on, or the exit status of a usage error.
int ApplySideOptions(const std::vector<OptionArgs>& shared, const std::vector<OptionArgs> (&per_side)[2],
                     DiffCommand* cmd) {
  for (int s = 0; s < 2; ++s) {
    std::vector<const OptionArgs*> all;
    for (const OptionArgs& o : shared) all.push_back(&o);
    for (const OptionArgs& o : per_side[s]) all.push_back(&o);
    for (const OptionArgs* o : all) {
      bool known = false;
      Status st;
      if ((*o)[0] == "-o") {
        st = ParseMountOption((*o)[1], kReadCommandGroups, &cmd->side[s], &known);
        if (st.ok() && !known) st = Status::InvalidArgument((*o)[1], "no such option");
      } else {
        st = ApplyTableOption(*o, &cmd->side[s], &known);
      }
      if (!st.ok()) return UsageError(st.message(), kDiffUsage);
    }
  }
  return -1;
}

// Parses the command line. Returns -1 to go on, or the exit status (help, usage error).
int ParseDiffArgs(const Args& args, DiffCommand* cmd) {
  std::vector<OptionArgs> shared, per_side[2];
  std::vector<std::string> positional;
  bool only_positional = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kDiffUsage, stdout);
      std::fputs(CommandLineHelp(kDiffOwnGroups).c_str(), stdout);
      std::fputs(kDiffSidesUsage, stdout);
      std::fputs(CommandLineHelp(kReadCommandGroups).c_str(), stdout);
      return 0;
    }
    if (only_positional || a.size() < 2 || a[0] != '-') {
      positional.push_back(a);
      continue;
    }
    if (a == "--") {
      only_positional = true;
      continue;
    }
    if (a == "--json") {
      cmd->json = true;
      continue;
    }
    // The comparison's own options.
    {
      size_t next = i;
      bool known = false;
      const Status st = ParseCommandLineOption(args, &next, kDiffOwnGroups, &cmd->own, &known);
      if (known) {
        if (!st.ok()) return UsageError(st.message(), kDiffUsage);
        i = next;
        continue;
      }
    }
    // The per-side -a/-b lists.
    const size_t eq = a.find('=');
    const std::string flag = a.substr(0, eq);
    const bool inline_value = eq != std::string::npos && a.rfind("--", 0) == 0;
    auto value = [&](std::string* out) {
      if (inline_value) {
        *out = a.substr(eq + 1);
        return true;
      }
      if (i + 1 >= args.size()) return false;
      *out = args[++i];
      return true;
    };
    if (a == "-a" || a == "-b") {
      std::string v;
      if (!value(&v)) return UsageError("option '" + flag + "' needs a value", kDiffUsage);
      AddSideList(v, &per_side[a == "-a" ? 0 : 1]);
      continue;
    }
    // --NAME-a / --NAME-b: a table option for one side.
    const bool suffixed = flag.size() > 4 && flag.rfind("--", 0) == 0 &&
                          (flag.ends_with("-a") || flag.ends_with("-b"));
    if (suffixed) {
      const int s = flag.back() == 'a' ? 0 : 1;
      const std::string base = flag.substr(0, flag.size() - 2);
      OptionArgs option = {inline_value ? base + a.substr(eq) : base};
      if (!inline_value && i + 1 < args.size()) option.push_back(args[i + 1]);
      ReadOptions probe;
      bool known = false;
      size_t next = 0;
      Status st = ParseCommandLineOption(option, &next, kReadCommandGroups, &probe, &known);
      if (known) {
        if (!st.ok()) return UsageError(st.message(), kDiffUsage);
        option.resize(next + 1);
        i += next;
        per_side[s].push_back(std::move(option));
        continue;
      }
    }
    // A table option for both sides.
    OptionArgs option = {a};
    if (i + 1 < args.size()) option.push_back(args[i + 1]);
    ReadOptions probe;
    bool known = false;
    size_t next = 0;
    Status st = ParseCommandLineOption(option, &next, kReadCommandGroups, &probe, &known);
    if (!known) return UsageError("unknown option '" + a + "'", kDiffUsage);
    if (!st.ok()) return UsageError(st.message(), kDiffUsage);
    option.resize(next + 1);
    i += next;
    shared.push_back(std::move(option));
  }
  if (positional.size() != 2) return UsageError("diff takes two sources, A and B", kDiffUsage);
  cmd->source[0] = positional[0];
  cmd->source[1] = positional[1];
  return ApplySideOptions(shared, per_side, cmd);
}

// "ckptfs: SOURCE: REASON": the message names the source when it does not already.
int FailSide(const std::string& source, const Status& status) {
  const std::string& m = status.message();
  if (m.rfind(source + ":", 0) == 0) std::fprintf(stderr, "ckptfs: %s\n", m.c_str());
  else std::fprintf(stderr, "ckptfs: %s: %s\n", source.c_str(), m.c_str());
  return 2;
}

std::string ShapeText(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string Figure(double v) {
  if (std::isinf(v)) return "inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

// How bad a pair is, for the table's order: shape and type mismatches first, then by
// relative L2 change, then by differing elements.
bool Worse(const PairDiff& x, const PairDiff& y) {
  auto rank = [](const PairDiff& p) {
    return p.verdict == PairVerdict::kShape || p.verdict == PairVerdict::kIncomparable ? 2 : p.equal() ? 0 : 1;
  };
  if (rank(x) != rank(y)) return rank(x) > rank(y);
  if (x.rel_l2() != y.rel_l2()) return x.rel_l2() > y.rel_l2();
  return x.differing > y.differing;
}

void ListKeys(const char* what, const std::vector<std::string>& keys, size_t rows) {
  if (keys.empty()) return;
  std::printf("%s: %zu\n", what, keys.size());
  for (size_t i = 0; i < keys.size() && i < rows; ++i) std::printf("  %s\n", keys[i].c_str());
  if (keys.size() > rows) std::printf("  ... %zu more (--json lists all)\n", keys.size() - rows);
}

void PrintSummary(const DiffResult& r, size_t rows) {
  std::printf("A: %s (%zu tensors)\nB: %s (%zu tensors)\n", r.source_a.c_str(), r.tensors_a, r.source_b.c_str(),
              r.tensors_b);
  ListKeys("only in A", r.only_a, std::min<size_t>(rows, 5));
  ListKeys("only in B", r.only_b, std::min<size_t>(rows, 5));
  size_t counts[5] = {0, 0, 0, 0, 0}, dtype_differs = 0;
  for (const PairDiff& p : r.pairs) {
    ++counts[static_cast<int>(p.verdict)];
    dtype_differs += p.dtype_a != p.dtype_b;
  }
  std::printf("in both: %zu: %zu identical, %zu equal", r.pairs.size(), counts[0], counts[1]);
  if (r.atol > 0 || r.rtol > 0) std::printf(" (atol %g, rtol %g)", r.atol, r.rtol);
  std::printf(", %zu different, %zu of other shape", counts[2], counts[3]);
  if (counts[4]) std::printf(", %zu complex against real", counts[4]);
  if (dtype_differs) std::printf("; %zu of other dtype", dtype_differs);
  std::printf("\n");
  std::vector<const PairDiff*> worst;
  for (const PairDiff& p : r.pairs)
    if (p.verdict != PairVerdict::kIdentical) worst.push_back(&p);
  std::stable_sort(worst.begin(), worst.end(), [](const PairDiff* x, const PairDiff* y) { return Worse(*x, *y); });
  if (!worst.empty() && rows > 0) {
    std::printf("\n%-10s %-10s %-10s %14s %10s %10s %10s  %s\n", "status", "dtype A", "dtype B", "differing",
                "max abs", "max rel", "rel L2", "key");
    for (size_t i = 0; i < worst.size() && i < rows; ++i) {
      const PairDiff& p = *worst[i];
      const std::string verdict(VerdictName(p.verdict));
      std::string differing, max_abs, max_rel, rel_l2;
      if (p.verdict == PairVerdict::kShape) {
        differing = ShapeText(p.shape_a) + "/" + ShapeText(p.shape_b);
      } else if (p.verdict != PairVerdict::kIncomparable) {
        differing = std::to_string(p.differing) + "/" + std::to_string(p.numel);
        max_abs = Figure(p.max_abs);
        max_rel = Figure(p.max_rel);
        rel_l2 = Figure(p.rel_l2());
      }
      std::printf("%-10s %-10s %-10s %14s %10s %10s %10s  %s\n", verdict.c_str(),
                  std::string(Info(p.dtype_a).torch_name).c_str(), std::string(Info(p.dtype_b).torch_name).c_str(),
                  differing.c_str(), max_abs.c_str(), max_rel.c_str(), rel_l2.c_str(), p.key.c_str());
    }
    if (worst.size() > rows) std::printf("... %zu more not identical (--rows, --json)\n", worst.size() - rows);
  }
  std::printf("\n%s\n", r.equal() ? "equal" : "different");
}

}  // namespace

int RunDiff(const Args& args) {
  DiffCommand cmd;
  if (int rc = ParseDiffArgs(args, &cmd); rc >= 0) return rc;
  std::unique_ptr<View> view[2];
  for (int s = 0; s < 2; ++s)
    if (Status st = OpenView(cmd.source[s], cmd.side[s], &view[s]); !st.ok()) return FailSide(cmd.source[s], st);
  DiffResult result;
  DiffSide failed = DiffSide::kNone;
  Status st;
  {
    ProgressBar bar(0);
    st = CompareViews(*view[0], *view[1], cmd.own.diff, [&bar](uint64_t done, uint64_t total) { bar.Set(done, total); },
                      &result, &failed);
  }
  if (!st.ok()) {
    if (failed == DiffSide::kNone) {
      std::fprintf(stderr, "ckptfs: %s\n", st.message().c_str());
      return 2;
    }
    return FailSide(cmd.source[failed == DiffSide::kA ? 0 : 1], st);
  }
  if (cmd.json) std::printf("%s\n", DiffToJson(result).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  else PrintSummary(result, cmd.own.diff_rows);
  return result.equal() ? 0 : 1;
}

}  // namespace ckptfs::cli
