// DecodeGroup: one request over every decode rank of a TP group in this process, one callback.
//
// Each request's State records how each rank ended (0 live, kReady, kFailed, kNever for ranks
// never submitted); the last rank to end decides: every rank ready -> on_ready; else release
// the ranks that were ready and on_error with the first error. The first failure cancels the
// ranks still live, so a group does not wait for the slowest rank of a lost request.
#include "fabric/kv/group.h"

#include <map>
#include <mutex>

namespace fabric::kv {

namespace {

enum : uint8_t { kLive = 0, kReady = 1, kFailed = 2, kNever = 3 };

struct State {
  GroupRequest request;  // the caller's callbacks
  std::vector<std::vector<uint32_t>> pages;
  std::vector<uint8_t> ended;
  size_t remaining = 0;
  Status error;
  bool silent = false;  // submit failed: the caller got the error, no callback runs
  bool ready = false;   // every rank ready; waiting for release()
};

}  // namespace

class DecodeGroup::Impl : public std::enable_shared_from_this<Impl> {
 public:
  explicit Impl(std::vector<KvDecoder*> decoders) : decoders_(std::move(decoders)) {}

  void close() {
    std::lock_guard lock(mu_);
    closed_ = true;
  }

  Status submit(GroupRequest rq) {
    const size_t n = decoders_.size();
    const RequestId id = rq.id;
    auto st = std::make_shared<State>();
    st->pages.resize(n);
    st->ended.assign(n, kLive);
    st->remaining = n;
    const uint32_t num_pages = rq.num_pages;
    const std::vector<Address> prefill = rq.prefill_ranks;
    st->request = std::move(rq);
    {
      std::lock_guard lock(mu_);
      if (closed_) return Status(ErrorCode::kClosed, "the DecodeGroup is closed");
      if (requests_.count(id)) {
        return Status(ErrorCode::kAlreadyExists,
                      "request " + std::to_string(id) + " is live in this DecodeGroup");
      }
      requests_[id] = st;
    }
    std::weak_ptr<Impl> weak = weak_from_this();
    for (size_t r = 0; r < n; ++r) {
      DecodeRequest d;
      d.id = id;
      d.num_pages = num_pages;
      d.prefill_ranks = prefill;
      d.on_ready = [weak, st, r](RequestId id, std::span<const uint32_t> pages) {
        if (auto self = weak.lock()) self->rank_ended(st, r, id, Status::ok(), pages);
      };
      d.on_error = [weak, st, r](RequestId id, const Status& s) {
        if (auto self = weak.lock()) self->rank_ended(st, r, id, s, {});
      };
      auto got = decoders_[r]->submit(std::move(d));
      if (got) continue;
      // Undo: the ranks already submitted are cancelled; whichever ends last releases the
      // ranks that were ready.
      std::vector<size_t> release;
      {
        std::lock_guard lock(mu_);
        st->silent = true;
        if (st->error.is_ok()) st->error = got.status();
        for (size_t k = r; k < n; ++k) st->ended[k] = kNever;
        st->remaining -= n - r;
        if (st->remaining == 0) release = ready_ranks(*st);
        auto it = requests_.find(id);
        if (it != requests_.end() && it->second == st) requests_.erase(it);
      }
      for (size_t k = 0; k < r; ++k) decoders_[k]->cancel(id).ignore();
      for (size_t k : release) decoders_[k]->release(id).ignore();
      return Status(got.status().code(),
                    "decode rank " + std::to_string(r) + ": " + got.status().message());
    }
    return Status::ok();
  }

  Status cancel(RequestId id) {
    std::vector<size_t> live;
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(id);
      if (it == requests_.end() || it->second->ready) {
        return Status(ErrorCode::kNotFound,
                      "request " + std::to_string(id) + " is not live (unknown, ended or ready)");
      }
      for (size_t r = 0; r < it->second->ended.size(); ++r) {
        if (it->second->ended[r] == kLive) live.push_back(r);
      }
    }
    for (size_t r : live) decoders_[r]->cancel(id).ignore();  // kNotFound: it just ended
    return Status::ok();
  }

  Status release(RequestId id) {
    {
      std::lock_guard lock(mu_);
      auto it = requests_.find(id);
      if (it == requests_.end() || !it->second->ready) {
        return Status(ErrorCode::kNotFound, "request " + std::to_string(id) + " is not ready");
      }
      requests_.erase(it);
    }
    for (KvDecoder* d : decoders_) d->release(id).ignore();
    return Status::ok();
  }

  size_t live() const {
    std::lock_guard lock(mu_);
    size_t n = 0;
    for (auto& [id, st] : requests_) n += st->ready ? 0 : 1;
    return n;
  }
  size_t size() const { return decoders_.size(); }

 private:
  // Holding mu_.
  static std::vector<size_t> ready_ranks(const State& st) {
    std::vector<size_t> out;
    for (size_t r = 0; r < st.ended.size(); ++r) {
      if (st.ended[r] == kReady) out.push_back(r);
    }
    return out;
  }

  void rank_ended(const std::shared_ptr<State>& st, size_t rank, RequestId id, const Status& s,
                  std::span<const uint32_t> pages) {
    std::vector<size_t> cancel, release;
    bool finish = false, call = false;
    {
      std::lock_guard lock(mu_);
      if (st->ended[rank] != kLive) return;
      st->ended[rank] = s.is_ok() ? kReady : kFailed;
      if (s.is_ok()) st->pages[rank].assign(pages.begin(), pages.end());
      --st->remaining;
      if (!s.is_ok() && st->error.is_ok()) {
        st->error = s;
        for (size_t r = 0; r < st->ended.size(); ++r) {
          if (st->ended[r] == kLive) cancel.push_back(r);
        }
      }
      finish = st->remaining == 0;
      if (finish) {
        if (st->error.is_ok()) {
          st->ready = true;
        } else {
          release = ready_ranks(*st);
          auto it = requests_.find(id);
          if (it != requests_.end() && it->second == st) requests_.erase(it);
        }
        call = !st->silent && !closed_;
      }
    }
    for (size_t r : cancel) decoders_[r]->cancel(id).ignore();
    for (size_t r : release) decoders_[r]->release(id).ignore();
    if (!call) return;
    if (st->error.is_ok()) {
      if (st->request.on_ready) st->request.on_ready(id, st->pages);
    } else if (st->request.on_error) {
      st->request.on_error(id, st->error);
    }
  }

  const std::vector<KvDecoder*> decoders_;
  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<RequestId, std::shared_ptr<State>> requests_;
};

Result<std::unique_ptr<DecodeGroup>> DecodeGroup::create(std::vector<KvDecoder*> decoders) {
  if (decoders.empty()) {
    return Status(ErrorCode::kInvalidArgument, "DecodeGroup: no decoders");
  }
  for (size_t r = 0; r < decoders.size(); ++r) {
    if (decoders[r] == nullptr) {
      return Status(ErrorCode::kInvalidArgument,
                    "DecodeGroup: decoder " + std::to_string(r) + " is null");
    }
    const KvLayout& l = decoders[r]->layout();
    if (l.tp_size != decoders.size() || l.tp_rank != r) {
      return Status(ErrorCode::kInvalidArgument, "DecodeGroup: decoder " + std::to_string(r) +
                                                     " is TP rank " + std::to_string(l.tp_rank) +
                                                     " of " + std::to_string(l.tp_size) +
                                                     ", not rank " + std::to_string(r) + " of " +
                                                     std::to_string(decoders.size()));
    }
  }
  return std::unique_ptr<DecodeGroup>(new DecodeGroup(std::make_shared<Impl>(std::move(decoders))));
}

DecodeGroup::DecodeGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
DecodeGroup::~DecodeGroup() {
  impl_->close();
}
Status DecodeGroup::submit(GroupRequest request) {
  return impl_->submit(std::move(request));
}
Status DecodeGroup::cancel(RequestId id) {
  return impl_->cancel(id);
}
Status DecodeGroup::release(RequestId id) {
  return impl_->release(id);
}
size_t DecodeGroup::live_requests() const {
  return impl_->live();
}
size_t DecodeGroup::size() const {
  return impl_->size();
}

}  // namespace fabric::kv
