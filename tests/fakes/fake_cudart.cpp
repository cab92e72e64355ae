// A stand-in for libcudart, built for the tests: "device" memory is host memory, copies
// happen at once, and every call is logged, so the CUDA back end runs without a GPU and the
// tests can check what it asked the runtime for (current device, error clearing, stream
// ordering). Built twice: FAKE_CUDART_DRIVER_TOO_OLD makes cudaGetDeviceCount answer
// cudaErrorInsufficientDriver, like a runtime newer than the installed driver.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#define FAKE_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kErrorInvalidValue = 1;
constexpr int kErrorInvalidDevice = 101;
constexpr int kErrorInsufficientDriver = 35;

std::mutex g_mu;
std::string g_log;
int g_devices = 2;
std::string g_fail_call;
int g_fail_nth = 0;
int g_fail_error = 0;
int g_calls_of_failing = 0;
std::atomic<int> g_errors_set{0}, g_errors_cleared{0};
thread_local int t_device = 0;
thread_local int t_last_error = 0;

void Log(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_log += line;
  g_log += '\n';
}

std::string Ptr(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

int Fail(int error) {
  t_last_error = error;
  ++g_errors_set;
  return error;
}

// The injected failure for `name`, or 0.
int Injected(const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_fail_call != name) return 0;
  return ++g_calls_of_failing == g_fail_nth ? g_fail_error : 0;
}

struct Handle {
  int unused;
};

}  // namespace

// ---- control, for the tests ----------------------------------------------------------

FAKE_EXPORT void fake_cudart_reset(int devices) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_log.clear();
  g_devices = devices;
  g_fail_call.clear();
  g_fail_nth = g_calls_of_failing = 0;
  g_errors_set = g_errors_cleared = 0;
}
// The `nth` call of `name` from now on fails with `error`.
FAKE_EXPORT void fake_cudart_fail(const char* name, int nth, int error) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fail_call = name;
  g_fail_nth = nth;
  g_fail_error = error;
  g_calls_of_failing = 0;
}
FAKE_EXPORT const char* fake_cudart_log() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(g_mu);
  copy = g_log;
  return copy.c_str();
}
// Failures reported minus those cleared by cudaGetLastError, over every thread.
FAKE_EXPORT int fake_cudart_uncleared_errors() { return g_errors_set - g_errors_cleared; }

// ---- the runtime entry points ckptfs resolves ----------------------------------------

FAKE_EXPORT int cudaGetDeviceCount(int* count) {
  Log("cudaGetDeviceCount");
#ifdef FAKE_CUDART_DRIVER_TOO_OLD
  *count = 0;
  return Fail(kErrorInsufficientDriver);
#else
  *count = g_devices;
  return 0;
#endif
}
FAKE_EXPORT int cudaGetDevice(int* device) {
  *device = t_device;
  return 0;
}
FAKE_EXPORT int cudaSetDevice(int device) {
  Log("cudaSetDevice " + std::to_string(device));
  if (int e = Injected("cudaSetDevice")) return Fail(e);
  if (device < 0 || device >= g_devices) return Fail(kErrorInvalidDevice);
  t_device = device;
  return 0;
}
FAKE_EXPORT int cudaGetLastError() {
  Log("cudaGetLastError");
  const int e = t_last_error;
  t_last_error = 0;
  if (e != 0) ++g_errors_cleared;
  return e;
}
FAKE_EXPORT int cudaMalloc(void** ptr, size_t bytes) {
  if (int e = Injected("cudaMalloc")) return Fail(e);
  *ptr = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096 + 4096);
  return 0;
}
FAKE_EXPORT int cudaFree(void* ptr) {
  std::free(ptr);
  return 0;
}
FAKE_EXPORT int cudaHostAlloc(void** ptr, size_t bytes, unsigned) {
  if (int e = Injected("cudaHostAlloc")) return Fail(e);
  *ptr = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096 + 4096);
  return 0;
}
FAKE_EXPORT int cudaFreeHost(void* ptr) {
  std::free(ptr);
  return 0;
}
FAKE_EXPORT int cudaMemcpy(void* dst, const void* src, size_t bytes, int) {
  std::memcpy(dst, src, bytes);
  return 0;
}
FAKE_EXPORT int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int, void* stream) {
  Log("cudaMemcpyAsync " + Ptr(stream));
  if (int e = Injected("cudaMemcpyAsync")) return Fail(e);
  std::memcpy(dst, src, bytes);
  return 0;
}
FAKE_EXPORT int cudaStreamCreateWithFlags(void** stream, unsigned) {
  *stream = new Handle{};
  return 0;
}
FAKE_EXPORT int cudaStreamDestroy(void* stream) {
  delete static_cast<Handle*>(stream);
  return 0;
}
FAKE_EXPORT int cudaStreamSynchronize(void*) { return 0; }
FAKE_EXPORT int cudaStreamWaitEvent(void* stream, void* event, unsigned flags) {
  Log("cudaStreamWaitEvent " + Ptr(stream) + " " + Ptr(event));
  return flags == 0 ? 0 : Fail(kErrorInvalidValue);
}
FAKE_EXPORT int cudaEventCreateWithFlags(void** event, unsigned) {
  *event = new Handle{};
  return 0;
}
FAKE_EXPORT int cudaEventDestroy(void* event) {
  delete static_cast<Handle*>(event);
  return 0;
}
FAKE_EXPORT int cudaEventRecord(void* event, void* stream) {
  Log("cudaEventRecord " + Ptr(event) + " " + Ptr(stream));
  return 0;
}
FAKE_EXPORT int cudaEventSynchronize(void*) { return 0; }
FAKE_EXPORT const char* cudaGetErrorString(int error) {
  return error == kErrorInsufficientDriver ? "CUDA driver version is insufficient for CUDA runtime version"
                                           : "injected fake error";
}
FAKE_EXPORT int cudaRuntimeGetVersion(int* version) {
  *version = 12090;
  return 0;
}
FAKE_EXPORT int cudaDriverGetVersion(int* version) {
#ifdef FAKE_CUDART_DRIVER_TOO_OLD
  *version = 12020;
#else
  *version = 12090;
#endif
  return 0;
}
