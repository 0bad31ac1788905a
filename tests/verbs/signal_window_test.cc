// SignalWindow (src/transport/verbs/signal_window.h): which requests are signalled, and how
// completions retire the unsignalled requests before them: in order, each exactly once, with
// the right outcome after an error whether or not the device reports flushed unsignalled
// requests, and across the wrap of the sequence numbers. No verbs device needed.
#include "transport/verbs/signal_window.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <vector>

namespace fabric::transport::verbs_detail {
namespace {

using Outcome = SignalWindow::Outcome;

struct Reported {
  std::vector<uint64_t> order;
  std::map<uint64_t, std::vector<Outcome>> outcomes;
  auto fn() {
    return [this](uint64_t wr_id, Outcome o) {
      order.push_back(wr_id);
      outcomes[wr_id].push_back(o);
    };
  }
};

// Pushes wr_ids first..first+n-1; returns their sequence numbers and signalled flags.
std::vector<std::pair<uint32_t, bool>> push_n(SignalWindow& w, uint64_t first, uint32_t n,
                                              uint32_t every) {
  std::vector<std::pair<uint32_t, bool>> out;
  for (uint32_t i = 0; i < n; ++i) {
    bool sig = false;
    const uint32_t seq = w.push(first + i, every, sig);
    out.emplace_back(seq, sig);
  }
  return out;
}

TEST(SignalWindow, EveryNthRequestIsSignalledAndSealSignalsTheNewest) {
  SignalWindow w(64);
  auto p = push_n(w, 100, 10, 4);
  for (uint32_t i = 0; i < 10; ++i) {
    EXPECT_EQ(p[i].second, i == 3 || i == 7) << "request " << i;
    EXPECT_EQ(p[i].first, i);
  }
  EXPECT_FALSE(w.newest_signalled());
  EXPECT_TRUE(w.seal()) << "the chain's last request becomes signalled";
  EXPECT_TRUE(w.newest_signalled());
  EXPECT_FALSE(w.seal()) << "already signalled";
  // The count restarts after a sealed request: the next signalled one is 4 later.
  auto q = push_n(w, 200, 4, 4);
  EXPECT_FALSE(q[0].second);
  EXPECT_FALSE(q[2].second);
  EXPECT_TRUE(q[3].second);
  // signal_every = 1: every request signalled (the behaviour without selective signalling).
  SignalWindow all(8);
  for (const auto& [seq, sig] : push_n(all, 0, 5, 1)) EXPECT_TRUE(sig) << seq;
}

TEST(SignalWindow, TheRequestThatFillsTheWindowIsSignalled) {
  SignalWindow w(8);
  auto p = push_n(w, 0, 8, 1000);
  for (uint32_t i = 0; i < 7; ++i) EXPECT_FALSE(p[i].second) << i;
  EXPECT_TRUE(p[7].second) << "a full window must hold a signalled request";
  EXPECT_TRUE(w.full());
  // The drain marker fits beyond the capacity.
  const uint32_t m = w.push_marker(999);
  EXPECT_EQ(m, 8u);
  EXPECT_EQ(w.size(), 9u);
  EXPECT_TRUE(w.newest_signalled());
}

TEST(SignalWindow, ASignalledCompletionRetiresEveryOlderRequestOnceInOrder) {
  SignalWindow w(32);
  push_n(w, 10, 10, 4);  // 10..19, signalled: 13, 17
  Reported r;
  EXPECT_EQ(w.complete(3, true, false, r.fn()), 4u);
  EXPECT_EQ(r.order, (std::vector<uint64_t>{10, 11, 12, 13}));
  for (uint64_t id = 10; id <= 13; ++id) {
    EXPECT_EQ(r.outcomes[id], std::vector<Outcome>{Outcome::kOk});
  }
  EXPECT_EQ(w.size(), 6u);
  EXPECT_EQ(w.complete(3, true, false, r.fn()), 0u) << "a completion for a retired entry";
  EXPECT_EQ(w.complete(2, false, true, r.fn()), 0u) << "a flush for a retired entry";
  EXPECT_EQ(r.order.size(), 4u);
  EXPECT_TRUE(w.seal());
  EXPECT_EQ(w.complete(w.newest(), true, false, r.fn()), 6u);
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(r.order.size(), 10u);
  EXPECT_FALSE(w.broken());
}

// An error in the middle of an unsignalled run: the ones before it succeeded, it failed, the
// ones after it are flushed; once each, whether the device reports every flushed request
// (Soft-RoCE does) or only the signalled ones.
TEST(SignalWindow, AnErrorInAnUnsignalledRunFailsItAndFlushesTheRest) {
  for (const bool device_flushes_unsignalled : {true, false}) {
    SCOPED_TRACE(device_flushes_unsignalled ? "every request flushed" : "signalled ones only");
    SignalWindow w(64);
    auto p = push_n(w, 0, 20, 16);  // signalled: 15; sealed: 19
    EXPECT_TRUE(w.seal());
    Reported r;
    EXPECT_EQ(w.complete(9, false, false, r.fn()), 10u);  // wr 9: remote access error
    EXPECT_TRUE(w.broken());
    for (uint32_t seq = 10; seq < 20; ++seq) {
      const bool sig = seq == 15 || seq == 19;
      if (device_flushes_unsignalled || sig) w.complete(seq, false, true, r.fn());
    }
    // A late flush for an entry already retired changes nothing.
    EXPECT_EQ(w.complete(12, false, true, r.fn()), 0u);
    EXPECT_TRUE(w.empty());
    ASSERT_EQ(r.order.size(), 20u);
    for (uint64_t id = 0; id < 20; ++id) {
      EXPECT_EQ(r.order[id], id);
      ASSERT_EQ(r.outcomes[id].size(), 1u) << id;
      const Outcome want = id < 9 ? Outcome::kOk : id == 9 ? Outcome::kFailed : Outcome::kFlushed;
      EXPECT_EQ(r.outcomes[id][0], want) << id;
    }
  }
}

// A queue pair the backend moved to the error state itself: requests that finish without a
// completion of their own may have been flushed, so they are not reported as successes; but
// requests before a successful completion did succeed.
TEST(SignalWindow, AfterMarkBrokenUnsignalledRequestsBeforeAFlushAreFlushed) {
  SignalWindow w(64);
  push_n(w, 0, 12, 4);  // signalled: 3, 7, 11
  w.mark_broken();
  Reported r;
  EXPECT_EQ(w.complete(3, true, false, r.fn()), 4u);  // finished before the error state
  EXPECT_EQ(w.complete(11, false, true, r.fn()), 8u);
  for (uint64_t id = 0; id < 12; ++id) {
    EXPECT_EQ(r.outcomes[id], std::vector<Outcome>{id < 4 ? Outcome::kOk : Outcome::kFlushed})
        << id;
  }
  // A flush first on a healthy queue pair (it broke through an event not read yet): the older
  // unsignalled requests are not known to have succeeded either.
  SignalWindow h(64);
  push_n(h, 0, 8, 4);
  Reported f;
  EXPECT_EQ(h.complete(3, false, true, f.fn()), 4u);
  for (uint64_t id = 0; id < 4; ++id) {
    EXPECT_EQ(f.outcomes[id], std::vector<Outcome>{Outcome::kFlushed}) << id;
  }
  // A real error after the queue pair broke: it keeps its own status, the older are flushed.
  EXPECT_EQ(h.complete(6, false, false, f.fn()), 3u);
  EXPECT_EQ(f.outcomes[4], std::vector<Outcome>{Outcome::kFlushed});
  EXPECT_EQ(f.outcomes[6], std::vector<Outcome>{Outcome::kFailed});
}

TEST(SignalWindow, FailAllAndPopNewestRetireEachOnce) {
  SignalWindow w(16);
  push_n(w, 0, 6, 16);
  EXPECT_EQ(w.pop_newest(), 5u);  // refused by the provider: reported by the caller
  EXPECT_EQ(w.pop_newest(), 4u);
  EXPECT_EQ(w.size(), 4u);
  Reported r;
  EXPECT_EQ(w.fail_all(r.fn()), 4u);
  EXPECT_EQ(r.order, (std::vector<uint64_t>{0, 1, 2, 3}));
  for (uint64_t id = 0; id < 4; ++id) {
    EXPECT_EQ(r.outcomes[id], std::vector<Outcome>{Outcome::kFlushed});
  }
  EXPECT_EQ(w.fail_all(r.fn()), 0u);
  EXPECT_EQ(w.complete(2, true, false, r.fn()), 0u);
}

TEST(SignalWindow, SequenceNumbersWrap) {
  SignalWindow w(8, UINT32_MAX - 2);
  Reported r;
  uint64_t next = 0;
  for (int round = 0; round < 5; ++round) {
    auto p = push_n(w, next, 5, 3);
    next += 5;
    w.seal();
    EXPECT_TRUE(w.contains(p[4].first));
    EXPECT_EQ(w.complete(p[4].first, true, false, r.fn()), 5u);
    EXPECT_FALSE(w.contains(p[0].first));
  }
  ASSERT_EQ(r.order.size(), 25u);
  for (uint64_t i = 0; i < 25; ++i) EXPECT_EQ(r.order[i], i);
}

// Random runs against a model of an RC send queue: chains of random length, sealed when
// posted; the device completes in order, signalled requests (and, on some devices, every
// flushed one) produce a completion; one run in two has an error at a random request. Every
// request is reported exactly once, with the outcome its position implies.
TEST(SignalWindow, RandomRunsReportEveryRequestOnceWithTheRightOutcome) {
  std::mt19937 rng(12345);
  for (int run = 0; run < 400; ++run) {
    const uint32_t every = 1 + rng() % 20;
    const uint32_t cap = 8 + rng() % 64;
    const bool flush_all = rng() % 2;
    SignalWindow w(cap, static_cast<uint32_t>(rng()));
    Reported r;
    struct Posted {
      uint64_t id;
      uint32_t seq;
      bool sig;
    };
    std::vector<Posted> posted;  // the device's send queue, oldest first
    size_t done = 0;             // requests the device has completed
    uint64_t next = 0;
    const uint64_t total = 200 + rng() % 300;
    const int64_t error_at = rng() % 2 ? static_cast<int64_t>(rng() % total) : -1;
    bool errored = false;
    while (next < total || done < posted.size()) {
      // Post a chain that fits.
      const uint32_t room = cap - w.size();
      const uint32_t n = std::min<uint64_t>(rng() % 40, std::min<uint64_t>(room, total - next));
      for (uint32_t i = 0; i < n; ++i) {
        bool sig = false;
        const uint32_t seq = w.push(next, every, sig);
        posted.push_back({next++, seq, sig});
      }
      if (n > 0 && w.seal()) posted.back().sig = true;
      // The device completes some, in order.
      const size_t k = std::min<size_t>(posted.size() - done, rng() % 50);
      for (size_t i = 0; i < k; ++i) {
        Posted& e = posted[done++];
        if (!errored && static_cast<int64_t>(e.id) == error_at) {
          errored = true;
          w.complete(e.seq, false, false, r.fn());  // an error always completes
        } else if (errored) {
          if (flush_all || e.sig) w.complete(e.seq, false, true, r.fn());
        } else if (e.sig) {
          w.complete(e.seq, true, false, r.fn());
        }
      }
      ASSERT_LE(w.size(), cap);
    }
    ASSERT_TRUE(w.empty()) << "run " << run << ": the last request was not signalled";
    ASSERT_EQ(r.outcomes.size(), total) << "run " << run;
    for (uint64_t id = 0; id < total; ++id) {
      ASSERT_EQ(r.outcomes[id].size(), 1u) << "run " << run << " wr " << id;
      const int64_t i = static_cast<int64_t>(id);
      const Outcome want = error_at < 0 || i < error_at ? Outcome::kOk
                           : i == error_at              ? Outcome::kFailed
                                                        : Outcome::kFlushed;
      ASSERT_EQ(r.outcomes[id][0], want) << "run " << run << " wr " << id;
    }
    for (uint64_t i = 0; i < total; ++i) ASSERT_EQ(r.order[i], i) << "run " << run;
  }
}

}  // namespace
}  // namespace fabric::transport::verbs_detail
