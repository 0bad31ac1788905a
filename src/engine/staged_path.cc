// StagedPath (staged_path.h): the owner's side of Commits. A Commit names ranges the writer put
// in this engine's pinned host mirror of a staged region; they are copied into the region's
// device memory, then the Commit's immediate is counted and the Commit acknowledged. A Commit
// of a reliable immediate for host memory (region 0) is counted at once. A read Commit names
// ranges of a readable staged region to copy out of the device into the mirror before the
// reader reads them there.

#include <fmt/format.h>

#include <utility>

#include "common/log.h"
#include "engine/staged_path.h"

namespace fabric::engine {

void StagedPath::on_commit(const MessageHeader& header, std::span<const std::byte> body,
                           uint32_t domain) {
  auto commit = Commit::decode(body);
  // (A Result never holds an ok Status: the reply address is decoded only from a Commit.)
  const bool malformed = !commit || [&] {
    auto reply = Address::decode(commit->reply_to);
    return !reply || reply->empty();
  }();
  if (malformed) {
    detail::log().warn("group {}: dropped a malformed commit message", group_);
    return;
  }
  auto owned = std::make_unique<CommitJob>();
  CommitJob& job = *owned;
  job.commit = std::move(*commit);
  job.sender = header.sender;
  job.seq = header.seq;
  job.reply_domain = domain;
  job.commit.read = header.kind == MessageKind::kReadCommit;
  CommitJob* key = owned.get();
  jobs_.emplace(key, std::move(owned));
  const CommitKey record{header.sender, header.seq};
  records_[record] = CommitRecord{key, ErrorCode::kOk, {}, 0, {}};
  order_.push_back(record);
  while (order_.size() > kMaxCommitRecords) {
    records_.erase(order_.front());
    order_.pop_front();
  }
  // Ends the job with `status` (its Ack carries it).
  auto refuse = [&](Status status) {
    job.status = std::move(status);
    commit_done(job);
  };
  if (job.commit.read && job.commit.has_imm) {
    job.commit.has_imm = false;
    return refuse(Status(ErrorCode::kInvalidArgument, "a read commit carries no immediate"));
  }
  if (job.commit.ipc) {  // the CUDA IPC path (ipc_copies.h)
    Event& e = events_.emplace_back();
    e.kind = Event::Kind::kStartIpc;
    e.job = &job;
    return;
  }
  if (job.commit.region == 0 && !job.commit.read) {
    // A reliable immediate (Config::reliable_imm) for host memory: the writes it follows have
    // completed, so the data is in place; nothing to copy, count it now.
    if (!job.commit.ranges.empty()) {
      job.status = Status(ErrorCode::kRemoteAccess, "commit of ranges without a staged region");
    }
    commit_done(job);
    return;
  }
  job.region = regions_ ? regions_->find(job.commit.region) : nullptr;
  if (!job.region || job.region->worker != self_ || !job.region->staged()) {
    return refuse(Status(ErrorCode::kRemoteAccess,
                         fmt::format("staged region {:#x} is not registered on this group (was "
                                     "it unregistered?)",
                                     job.commit.region)));
  }
  const LocalRegion& region = *job.region;
  if (job.commit.read && !region.remote_read) {
    return refuse(Status(ErrorCode::kRemoteAccess,
                         fmt::format("staged region {:#x} was not registered readable "
                                     "(RegisterOptions::remote_read); nothing was read",
                                     job.commit.region)));
  }
  for (const Range& r : job.commit.ranges) {
    if (r.offset > region.length || r.length > region.length - r.offset) {
      return refuse(Status(ErrorCode::kRemoteAccess,
                           fmt::format("staged commit of {} bytes at offset {} exceeds the region "
                                       "({} bytes)",
                                       r.length, r.offset, region.length)));
    }
  }
  if (job.commit.ranges.empty()) {
    commit_done(job);
    return;
  }
  auto copier = copiers_.get(region.memory);
  Status s = copier ? Status::ok() : copier.status();
  // A write's ranges go from the mirror into the GPU; a read's come out of the GPU into the
  // mirror, where the reader's fabric reads find them once the Ack has told it so.
  const auto direction =
      job.commit.read ? cuda::Copier::Direction::kToHost : cuda::Copier::Direction::kToDevice;
  for (const Range& r : job.commit.ranges) {
    if (!s.is_ok()) break;
    s = (*copier)->copy(region.ptr + r.offset, region.host + r.offset, r.length, direction);
  }
  if (s.is_ok()) s = (*copier)->fence(reinterpret_cast<uint64_t>(&job));
  if (!s.is_ok()) {
    job.status = s;
    commit_done(job);
  }
}

void StagedPath::commit_done(CommitJob& job) {
  if (job.status.is_ok() && job.commit.has_imm && job.commit.imm_times > 0) {
    Event& e = events_.emplace_back();
    e.kind = Event::Kind::kCountImm;
    e.imm = job.commit.imm;
    e.times = job.commit.imm_times;
  }
  if (!job.status.is_ok()) {
    detail::log().warn("group {}: staged commit failed: {}", group_, job.status.to_string());
  }
  Ack ack{job.commit.transfer, job.seq, job.status.code(), job.status.message()};
  auto record = records_.find({job.sender, job.seq});
  if (record != records_.end()) {
    record->second =
        CommitRecord{nullptr, ack.code, ack.message, ack.transfer, job.commit.reply_to};
  }
  send_ack(*Address::decode(job.commit.reply_to), job.reply_domain, std::move(ack));
  jobs_.erase(&job);
}

void StagedPath::on_duplicate(const MessageHeader& header, uint32_t domain) {
  auto it = records_.find({header.sender, header.seq});
  if (it == records_.end()) {
    detail::log().warn(
        "group {}: a commit message arrived again after its result was "
        "forgotten; not acknowledged",
        group_);
    return;
  }
  CommitRecord& r = it->second;
  if (r.job != nullptr) {  // still being copied: its Ack goes back the way this copy came
    r.job->reply_domain = domain;
    return;
  }
  auto reply = Address::decode(r.reply);
  if (!reply) return;
  send_ack(std::move(*reply), domain, Ack{r.transfer, header.seq, r.code, r.message});
}

void StagedPath::send_ack(Address to, uint32_t domain, Ack ack) {
  Event& e = events_.emplace_back();
  e.kind = Event::Kind::kSendAck;
  e.to = std::move(to);
  e.domain = domain;
  e.ack = std::move(ack);
}

bool StagedPath::poll() {
  done_.clear();
  if (copiers_.poll(done_) == 0) return false;
  for (const cuda::Copier::Done& d : done_) {
    auto* job = reinterpret_cast<CommitJob*>(d.token);
    if (!d.status.is_ok()) job->status = d.status;
    commit_done(*job);
  }
  return true;
}

bool StagedPath::copying() const {
  return copiers_.copying();
}

void StagedPath::drain() {
  copiers_.drain();
  jobs_.clear();
}

}  // namespace fabric::engine
