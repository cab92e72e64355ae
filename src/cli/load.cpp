// `ckptfs load`: streams the tensors of a view into device memory (src/device/) and prints
// what it moved and how fast.
#include <cstdio>
#include <string>

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
    "  --json            print the summary as JSON\n";
constexpr CommandLine kLoad = {kLoadUsage, true, kLoadCommandGroups, 1, "load takes one SOURCE"};

}  // namespace

int RunLoad(const Args& args) {
  ReadOptions options;
  std::vector<std::string> positional;
  if (int rc = StartCommand(args, kLoad, &options, &positional); rc >= 0) return rc;

  std::unique_ptr<DeviceBackend> backend;
  if (Status s = OpenBackend(options.backend, options.device, &backend); !s.ok()) return Fail(s);
  std::unique_ptr<View> view;
  if (Status s = OpenView(positional[0], options, &view); !s.ok()) return Fail(s);

  std::vector<DeviceTensor> tensors;
  DeviceLoadStats stats;
  if (Status s = LoadToDevice(*view, *backend, options.load, &tensors, &stats); !s.ok()) return Fail(s);
  Status verified = options.verify ? VerifyDeviceTensors(*view, *backend, tensors) : Status::OK();
  FreeDeviceTensors(*backend, &tensors);
  if (!verified.ok()) return Fail(verified);

  const double gbps = stats.gb_per_s();
  if (options.json) {
    std::printf("%s\n", LoadStatsJson(stats, backend->name(), backend->Describe(), options.verify).c_str());
    return 0;
  }
  std::printf("loaded %llu tensors, %.3f GB in %.3f s: %.2f GB/s\n", static_cast<unsigned long long>(stats.tensors),
              static_cast<double>(stats.bytes) / 1e9, stats.seconds, gbps);
  std::printf("backend %s: %s\n", backend->name(), backend->Describe().c_str());
  const size_t buffer_bytes = options.load.buffer_bytes;
  const std::string buffer = buffer_bytes % (1 << 20) == 0 ? std::to_string(buffer_bytes >> 20) + " MiB"
                                                           : std::to_string(buffer_bytes >> 10) + " KiB";
  std::printf("buffers %d x %s, %s reads; %.3f GB read from source files, %.3f GB through the view "
              "(conversion, gather), %.3f GB direct to device\n",
              options.load.buffers, buffer.c_str(),
              stats.used_o_direct ? "O_DIRECT" : "buffered", static_cast<double>(stats.bytes_read) / 1e9,
              static_cast<double>(stats.view_bytes) / 1e9, static_cast<double>(stats.direct_bytes) / 1e9);
  if (options.verify) std::printf("verified: every tensor's device bytes equal the view's\n");
  return 0;
}

}  // namespace ckptfs::cli
