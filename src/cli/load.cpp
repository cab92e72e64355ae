// `ckptfs load`: streams the tensors of a view into device memory (src/device/) and prints
// what it moved and how fast.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "ckptfs/device.hpp"
#include "cli/commands.hpp"

namespace ckptfs::cli {
namespace {

constexpr char kLoadUsage[] =
    "usage: ckptfs load [OPTIONS] SOURCE\n"
    "\n"
    "Streams every tensor of SOURCE (or a selection) into GPU memory: source reads into a ring\n"
    "of pinned host buffers overlapped with asynchronous host-to-device copies, or cuFile\n"
    "(GPUDirect Storage) reads straight into device memory. Prints tensors, bytes, seconds\n"
    "and GB/s. The memory is freed on exit: this measures and checks the path that\n"
    "python -c 'import ckptfs; ckptfs.load(SOURCE)' takes.\n"
    "\n"
    "  --backend B       host, cuda, cufile or auto (default: auto = cufile, else cuda; a\n"
    "                    machine without a GPU is an error, never a silent host load)\n"
    "  --device N        CUDA device (default 0)\n"
    "  --select PATTERN  only tensors whose key is PATTERN or matches it as a shell glob\n"
    "                    (repeatable)\n"
    "  --buffer-size S   each pinned buffer (default 16MiB)\n"
    "  --buffers N       ring size (default 4)\n"
    "  --io-threads N    threads filling buffers (default 2)\n"
    "  --no-direct-io    buffered reads of the source files instead of O_DIRECT\n"
    "  --verify          read each tensor back from the device and compare with the view\n"
    "  --json            print the summary as JSON\n";

bool ParseInt(const std::string& text, int min, int* out) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < min || v > 1 << 20) return false;
  *out = static_cast<int>(v);
  return true;
}

}  // namespace

int RunLoad(const Args& args) {
  if (WantsHelp(args)) return std::printf("%s%s", kLoadUsage, kReadOptionsHelp), 0;
  DeviceLoadOptions options;
  std::string backend_name = "auto";
  int device = 0;
  bool verify = false;
  Args rest;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i], value;
    bool has_value = false;
    if (a.rfind("--", 0) == 0) {
      if (size_t eq = a.find('='); eq != std::string::npos) {
        value = a.substr(eq + 1);
        a.resize(eq);
        has_value = true;
      }
    }
    auto take = [&](std::string* out) {
      if (has_value) return *out = value, true;
      if (i + 1 >= args.size()) return false;
      *out = args[++i];
      return true;
    };
    if (a == "--backend" || a == "--device" || a == "--select" || a == "--buffer-size" || a == "--buffers" ||
        a == "--io-threads") {
      std::string v;
      if (!take(&v)) return UsageError("option '" + a + "' needs a value", kLoadUsage);
      if (a == "--backend") {
        if (v != "host" && v != "cuda" && v != "cufile" && v != "auto")
          return UsageError("--backend takes host, cuda, cufile or auto, not '" + v + "'", kLoadUsage);
        backend_name = v;
      } else if (a == "--device") {
        if (!ParseInt(v, 0, &device)) return UsageError("--device takes a device number, not '" + v + "'", kLoadUsage);
      } else if (a == "--select") {
        options.select.push_back(v);
      } else if (a == "--buffer-size") {
        uint64_t bytes = 0;
        if (Status s = ParseSize(v, &bytes); !s.ok()) return UsageError(s.message(), kLoadUsage);
        if (bytes < 4096 || bytes > (uint64_t{1} << 34))
          return UsageError("--buffer-size must be between 4KiB and 16GiB", kLoadUsage);
        options.buffer_bytes = bytes;
      } else if (a == "--buffers") {
        if (!ParseInt(v, 1, &options.buffers)) return UsageError("--buffers takes a count >= 1", kLoadUsage);
      } else {
        if (!ParseInt(v, 1, &options.io_threads)) return UsageError("--io-threads takes a count >= 1", kLoadUsage);
      }
    } else if (a == "--verify" && !has_value) {
      verify = true;
    } else if (a == "--no-direct-io" && !has_value) {
      options.direct_io = false;
    } else {
      rest.push_back(args[i]);
    }
  }
  ReadOptions read_options;
  std::vector<std::string> positional;
  if (int rc = ParseReadArgs(rest, kLoadUsage, true, &read_options, &positional); rc >= 0) return rc;
  if (positional.size() != 1) return UsageError("load takes one SOURCE", kLoadUsage);

  std::unique_ptr<DeviceBackend> backend;
  if (Status s = OpenBackend(backend_name, device, &backend); !s.ok()) return Fail(s);
  std::unique_ptr<View> view;
  if (Status s = OpenView(positional[0], read_options, &view); !s.ok()) return Fail(s);

  std::vector<DeviceTensor> tensors;
  DeviceLoadStats stats;
  if (Status s = LoadToDevice(*view, *backend, options, &tensors, &stats); !s.ok()) return Fail(s);
  Status verified = verify ? VerifyDeviceTensors(*view, *backend, tensors) : Status::OK();
  FreeDeviceTensors(*backend, &tensors);
  if (!verified.ok()) return Fail(verified);

  const double gbps = stats.seconds > 0 ? static_cast<double>(stats.bytes) / stats.seconds / 1e9 : 0.0;
  if (read_options.json) {
    nlohmann::json j = {{"backend", backend->name()},
                        {"device", backend->Describe()},
                        {"tensors", stats.tensors},
                        {"bytes", stats.bytes},
                        {"bytes_read", stats.bytes_read},
                        {"direct_bytes", stats.direct_bytes},
                        {"view_bytes", stats.view_bytes},
                        {"buffers_filled", stats.buffers_filled},
                        {"o_direct", stats.used_o_direct},
                        {"seconds", stats.seconds},
                        {"gb_per_s", gbps},
                        {"verified", verify}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("loaded %llu tensors, %.3f GB in %.3f s: %.2f GB/s\n", static_cast<unsigned long long>(stats.tensors),
              static_cast<double>(stats.bytes) / 1e9, stats.seconds, gbps);
  std::printf("backend %s: %s\n", backend->name(), backend->Describe().c_str());
  const std::string buffer = options.buffer_bytes % (1 << 20) == 0
                                 ? std::to_string(options.buffer_bytes >> 20) + " MiB"
                                 : std::to_string(options.buffer_bytes >> 10) + " KiB";
  std::printf("buffers %d x %s, %s reads; %.3f GB read from source files, %.3f GB through the view "
              "(conversion, gather), %.3f GB direct to device\n",
              options.buffers, buffer.c_str(),
              stats.used_o_direct ? "O_DIRECT" : "buffered", static_cast<double>(stats.bytes_read) / 1e9,
              static_cast<double>(stats.view_bytes) / 1e9, static_cast<double>(stats.direct_bytes) / 1e9);
  if (verify) std::printf("verified: every tensor's device bytes equal the view's\n");
  return 0;
}

}  // namespace ckptfs::cli
