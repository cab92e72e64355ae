// The commands' progress bar: one line on stderr, drawn only when stderr is a terminal.
#ifndef CKPTFS_CLI_PROGRESS_BAR_HPP_
#define CKPTFS_CLI_PROGRESS_BAR_HPP_

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

namespace ckptfs::cli {

// A one-line progress bar on stderr, redrawn at most ten times a second.
class ProgressBar {
 public:
  explicit ProgressBar(uint64_t total) : total_(total), enabled_(::isatty(STDERR_FILENO)) {}
  ~ProgressBar() {
    if (enabled_ && drawn_) std::fputc('\n', stderr);
  }
  // Moves the bar to `done` of `total` (a total that grows as more work is found).
  void Set(uint64_t done, uint64_t total) {
    total_ = total;
    Add(done - done_);
  }
  void Add(uint64_t n) {
    done_ += n;
    auto now = std::chrono::steady_clock::now();
    if (!enabled_ || (drawn_ && now - last_ < std::chrono::milliseconds(100) && done_ < total_)) return;
    last_ = now;
    drawn_ = true;
    const int width = 40;
    const double frac = total_ ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
    const int filled = static_cast<int>(frac * width);
    std::fprintf(stderr, "\r[%.*s%*s] %5.1f%%  %.1f / %.1f MiB", filled, "########################################",
                 width - filled, "", frac * 100, done_ / 1048576.0, total_ / 1048576.0);
    std::fflush(stderr);
  }

 private:
  uint64_t total_, done_ = 0;
  bool enabled_, drawn_ = false;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace ckptfs::cli

#endif  // CKPTFS_CLI_PROGRESS_BAR_HPP_
