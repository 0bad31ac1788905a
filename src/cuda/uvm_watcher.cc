// UvmWatchers, host side: the pinned pool and the polling thread.
#include "fabric/uvm_watcher.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda/cuda_status.h"

namespace fabric {

using cuda::cuda_error;

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

class UvmWatchers::Impl {
 public:
  ~Impl() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      ++version_;  // the spinning poller looks at the version on every pass
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    if (host_ != nullptr) cudaFreeHost(host_);
  }

  Status init(const WatcherOptions& o) {
    if (o.capacity == 0) return Status(ErrorCode::kInvalidArgument, "watcher capacity is 0");
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) return cuda_error("cudaGetDeviceCount", err);
    if (o.cuda_device < 0 || o.cuda_device >= count) {
      return Status(
          ErrorCode::kUnsupported,
          fmt::format("CUDA device {} does not exist ({} present)", o.cuda_device, count));
    }
    if ((err = cudaSetDevice(o.cuda_device)) != cudaSuccess)
      return cuda_error("cudaSetDevice", err);
    void* host = nullptr;
    err = cudaHostAlloc(&host, o.capacity * sizeof(uint64_t),
                        cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) return cuda_error("cudaHostAlloc", err);
    host_ = static_cast<uint64_t*>(host);
    void* dev = nullptr;
    if ((err = cudaHostGetDevicePointer(&dev, host, 0)) != cudaSuccess) {
      return cuda_error("cudaHostGetDevicePointer", err);
    }
    device_ = static_cast<uint64_t*>(dev);
    slots_ = std::vector<Slot>(o.capacity);
    for (uint32_t i = o.capacity; i > 0; --i) free_.push_back(i - 1);
    cpu_ = o.cpu;
    thread_ = std::thread([this] { run(); });
    return Status::ok();
  }

  Result<Watcher> watch(Callback cb, uint64_t initial) {
    if (!cb) return Status(ErrorCode::kInvalidArgument, "watch: the callback is empty");
    Watcher w;
    {
      std::lock_guard lock(mu_);
      if (free_.empty()) {
        return Status(ErrorCode::kOutOfRange,
                      fmt::format("all {} watcher words are in use", slots_.size()));
      }
      w.slot = free_.back();
      free_.pop_back();
      Slot& s = slots_[w.slot];
      __atomic_store_n(&host_[w.slot], initial, __ATOMIC_RELEASE);
      s.state = std::make_shared<State>(std::move(cb));
      s.initial = initial;
      ++version_;
    }
    cv_.notify_all();
    w.device_word = device_ + w.slot;
    w.host_word = host_ + w.slot;
    return w;
  }

  Status unwatch(uint32_t slot) {
    uint64_t version = 0;
    {
      std::lock_guard lock(mu_);
      if (slot >= slots_.size() || !slots_[slot].state) {
        return Status(ErrorCode::kNotFound, fmt::format("watcher slot {} is not live", slot));
      }
      release_locked(slot);
      version = ++version_;
    }
    if (std::this_thread::get_id() != thread_.get_id()) {
      // Wait until the poller has passed the version without this slot.
      std::unique_lock lock(mu_);
      cv_.notify_all();
      observed_cv_.wait(lock, [&] { return observed_ >= version || stop_; });
    }
    return Status::ok();
  }

  uint32_t live() const {
    std::lock_guard lock(mu_);
    return static_cast<uint32_t>(slots_.size() - free_.size());
  }

 private:
  // A watcher's callback and whether it is still wanted; the poller checks `live` right
  // before each call, so a word unwatched (or reused) mid-pass never reaches a stale callback.
  struct State {
    explicit State(Callback c) : callback(std::move(c)) {}
    Callback callback;
    std::atomic<bool> live{true};
  };
  struct Slot {
    uint64_t initial = 0;
    std::shared_ptr<State> state;  // null: free
  };
  struct Entry {
    uint32_t slot;
    uint64_t last;
    std::shared_ptr<State> state;
  };

  void release_locked(uint32_t slot) {
    slots_[slot].state->live.store(false);
    slots_[slot].state.reset();
    free_.push_back(slot);
  }

  void run() {
    pthread_setname_np(pthread_self(), "fabric-uvm");
    if (cpu_ >= 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu_, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    std::vector<Entry> entries;
    uint64_t seen = ~uint64_t{0};
    for (;;) {
      if (version_.load(std::memory_order_acquire) != seen) {
        std::unique_lock lock(mu_);
        if (stop_) return;
        // Rebuild the list of live words; continuing ones keep the value last seen.
        std::vector<Entry> next;
        for (uint32_t i = 0; i < slots_.size(); ++i) {
          if (!slots_[i].state) continue;
          uint64_t last = slots_[i].initial;
          for (const Entry& e : entries) {
            if (e.slot == i && e.state == slots_[i].state) last = e.last;
          }
          next.push_back({i, last, slots_[i].state});
        }
        entries.swap(next);
        seen = version_.load(std::memory_order_acquire);
        observed_ = seen;
        observed_cv_.notify_all();
        if (entries.empty()) {  // idle: sleep until a watch or the end
          cv_.wait(lock, [&] { return stop_ || version_.load() != seen; });
          continue;
        }
      }
      for (Entry& e : entries) {
        const uint64_t now = __atomic_load_n(&host_[e.slot], __ATOMIC_ACQUIRE);
        if (now == e.last || !e.state->live.load(std::memory_order_acquire)) continue;
        const uint64_t old = e.last;
        e.last = now;
        bool keep = true;
        try {
          keep = e.state->callback(old, now);
        } catch (...) {
          keep = true;  // a throwing callback is isolated; the watcher stays
        }
        if (!keep) {
          std::lock_guard lock(mu_);
          if (slots_[e.slot].state == e.state) {
            release_locked(e.slot);
            ++version_;
          }
        }
      }
      cpu_relax();
    }
  }

  uint64_t* host_ = nullptr;
  uint64_t* device_ = nullptr;
  int cpu_ = -1;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable observed_cv_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  std::atomic<uint64_t> version_{0};
  uint64_t observed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

Result<std::unique_ptr<UvmWatchers>> UvmWatchers::create(const WatcherOptions& options) {
  auto impl = std::make_unique<Impl>();
  if (Status s = impl->init(options); !s) return s;
  return std::unique_ptr<UvmWatchers>(new UvmWatchers(std::move(impl)));
}

UvmWatchers::UvmWatchers(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UvmWatchers::~UvmWatchers() = default;
Result<Watcher> UvmWatchers::watch(Callback callback, uint64_t initial) {
  return impl_->watch(std::move(callback), initial);
}
Status UvmWatchers::unwatch(const Watcher& watcher) {
  return impl_->unwatch(watcher.slot);
}
uint32_t UvmWatchers::live() const {
  return impl_->live();
}

cudaError_t launch_watcher_store(uint64_t* device_word, uint64_t value, cudaStream_t stream);

Status UvmWatchers::bump(const Watcher& watcher, uint64_t value, void* cuda_stream) {
  if (watcher.device_word == nullptr) {
    return Status(ErrorCode::kInvalidArgument, "bump: the watcher has no device word");
  }
  cudaError_t err =
      launch_watcher_store(watcher.device_word, value, static_cast<cudaStream_t>(cuda_stream));
  if (err != cudaSuccess) return cuda_error("launching the watcher store", err);
  return Status::ok();
}

}  // namespace fabric
