// The bad-input table of docs/bad-input.md: one test per row. Each row feeds one bad input to an
// engine and checks that the call fails with the row's error code and a message naming what is
// wrong, that no callback runs, and that nothing reached the peer (its memory still holds the
// poison it was filled with, and the row's immediate was never counted).
//
// Rows whose input is bytes or strings rather than calls (malformed descriptors and addresses,
// environment overrides, the engine's own messages) are tested in tests/common (codec_test,
// config_test) and fuzzed in tests/fuzz; the table names those tests.
#include <limits>
#include <thread>

#include "reliability_support.h"

namespace fabric::testing {
namespace {

constexpr uint64_t kBytes = 4096;
constexpr uint32_t kImm = 4242;
constexpr std::byte kPoison{0xA5};

struct Env {
  TransferEngine* a;  // the engine under test
  TransferEngine* b;  // its peer
  Buffer* src;        // registered on a
  Buffer* dst;        // registered on b, poisoned
  Callbacks cb;       // must never run
};

struct Row {
  const char* name;
  ErrorCode code;
  const char* names;  // what the error message must mention
  std::function<Status(Env&)> act;
  bool fresh = false;  // changes the engines for good (closes them, sets a handler): own pair
};

// A descriptor of b's buffer with its fields replaced.
RemoteMemory descriptor_with(const RemoteMemory& d, uint64_t length,
                             std::vector<RemoteMemory::Rail> rails) {
  return RemoteMemory(d.owner(), d.base(), length, std::move(rails), d.staged_region());
}

const std::vector<Row>& rows() {
  using W = SingleWrite;
  static const std::vector<Row> kRows = {
      // --- zero where zero is illegal
      {"register_zero_length", ErrorCode::kInvalidArgument, "zero length",
       [](Env& e) { return e.a->register_memory(e.src->bytes.data(), 0).status(); }},
      {"register_null_pointer", ErrorCode::kInvalidArgument, "null pointer",
       [](Env& e) { return e.a->register_memory(nullptr, 16).status(); }},
      {"paged_zero_page_bytes", ErrorCode::kInvalidArgument, "page_bytes",
       [](Env& e) {
         return e.a
             ->submit(
                 PagedWrite{
                     e.src->reg.handle, e.dst->reg.descriptor, 0, {0}, 64, 0, {0}, 64, 0, kImm},
                 e.cb)
             .status();
       }},
      {"paged_no_pages", ErrorCode::kInvalidArgument, "no pages",
       [](Env& e) {
         return e.a
             ->submit(
                 PagedWrite{
                     e.src->reg.handle, e.dst->reg.descriptor, 64, {}, 64, 0, {}, 64, 0, kImm},
                 e.cb)
             .status();
       }},
      {"paged_page_count_mismatch", ErrorCode::kInvalidArgument, "destination pages",
       [](Env& e) {
         return e.a
             ->submit(
                 PagedWrite{
                     e.src->reg.handle, e.dst->reg.descriptor, 64, {0}, 64, 0, {0, 1}, 64, 0, kImm},
                 e.cb)
             .status();
       }},
      {"scatter_no_targets", ErrorCode::kInvalidArgument, "no targets",
       [](Env& e) {
         auto g = e.a->add_peer_group({e.b->address()});
         return e.a->submit(Scatter{e.src->reg.handle, *g, {}, kImm, {}}, e.cb).status();
       }},
      {"expect_imm_count_zero", ErrorCode::kInvalidArgument, "count",
       [](Env& e) { return e.b->expect_imm(kImm, 0, [] { ADD_FAILURE() << "ran"; }); }},
      {"peer_group_empty", ErrorCode::kInvalidArgument, "no peers",
       [](Env& e) { return e.a->add_peer_group({}).status(); }},
      {"receive_handler_zero_buffers", ErrorCode::kInvalidArgument, "at least 1",
       [](Env& e) { return e.a->set_receive_handler([](auto) {}, 1024, 0); }},
      // --- offset + length past the region
      {"single_source_past_end", ErrorCode::kOutOfRange, "source",
       [](Env& e) {
         return e.a
             ->submit(W{e.src->reg.handle, 1, e.dst->reg.descriptor, 0, kBytes, kImm, {}}, e.cb)
             .status();
       }},
      {"single_destination_past_end", ErrorCode::kOutOfRange, "destination",
       [](Env& e) {
         return e.a
             ->submit(W{e.src->reg.handle, 0, e.dst->reg.descriptor, 1, kBytes, kImm, {}}, e.cb)
             .status();
       }},
      {"paged_destination_page_past_end", ErrorCode::kOutOfRange, "dst_pages[1]",
       [](Env& e) {
         return e.a
             ->submit(PagedWrite{e.src->reg.handle,
                                 e.dst->reg.descriptor,
                                 1024,
                                 {0, 1},
                                 1024,
                                 0,
                                 {0, 4},
                                 1024,
                                 0,
                                 kImm},
                      e.cb)
             .status();
       }},
      {"scatter_target_past_end", ErrorCode::kOutOfRange, "scatter target 0 destination",
       [](Env& e) {
         auto g = e.a->add_peer_group({e.b->address()});
         return e.a
             ->submit(
                 Scatter{
                     e.src->reg.handle, *g, {{e.dst->reg.descriptor, 16, 0, kBytes - 8}}, kImm, {}},
                 e.cb)
             .status();
       }},
      // --- overflow near 2^64
      {"single_source_offset_overflows", ErrorCode::kOutOfRange, "source",
       [](Env& e) {
         return e.a
             ->submit(W{e.src->reg.handle, UINT64_MAX, e.dst->reg.descriptor, 0, 2, kImm, {}}, e.cb)
             .status();
       }},
      {"single_destination_offset_overflows", ErrorCode::kOutOfRange, "destination",
       [](Env& e) {
         return e.a
             ->submit(W{e.src->reg.handle, 0, e.dst->reg.descriptor, UINT64_MAX - 1, 4, kImm, {}},
                      e.cb)
             .status();
       }},
      {"single_length_overflows", ErrorCode::kOutOfRange, "source",
       [](Env& e) {
         return e.a
             ->submit(W{e.src->reg.handle, 8, e.dst->reg.descriptor, 8, UINT64_MAX - 4, kImm, {}},
                      e.cb)
             .status();
       }},
      {"paged_index_times_stride_overflows", ErrorCode::kOutOfRange, "overflows",
       [](Env& e) {
         return e.a
             ->submit(PagedWrite{e.src->reg.handle,
                                 e.dst->reg.descriptor,
                                 8,
                                 {0xffffffff},
                                 UINT64_MAX / 2,
                                 0,
                                 {0},
                                 8,
                                 0,
                                 kImm},
                      e.cb)
             .status();
       }},
      {"paged_base_plus_offset_overflows", ErrorCode::kOutOfRange, "overflows",
       [](Env& e) {
         return e.a
             ->submit(PagedWrite{e.src->reg.handle,
                                 e.dst->reg.descriptor,
                                 8,
                                 {0},
                                 8,
                                 0,
                                 {1},
                                 8,
                                 UINT64_MAX - 4,
                                 kImm},
                      e.cb)
             .status();
       }},
      {"scatter_offset_overflows", ErrorCode::kOutOfRange, "scatter target 0",
       [](Env& e) {
         auto g = e.a->add_peer_group({e.b->address()});
         return e.a
             ->submit(
                 Scatter{
                     e.src->reg.handle, *g, {{e.dst->reg.descriptor, 16, 0, UINT64_MAX}}, kImm, {}},
                 e.cb)
             .status();
       }},
      {"register_range_wraps", ErrorCode::kInvalidArgument, "wraps",
       [](Env& e) { return e.a->register_memory(e.src->bytes.data(), UINT64_MAX).status(); }},
      // --- unregistered or foreign source
      {"unknown_source_handle", ErrorCode::kNotFound, "not made by this engine",
       [](Env& e) {
         return e.a->submit(W{MemoryHandle{12345}, 0, e.dst->reg.descriptor, 0, 1, kImm, {}}, e.cb)
             .status();
       }},
      {"source_handle_of_another_engine", ErrorCode::kNotFound, "not made by this engine",
       [](Env& e) {
         return e.a->submit(W{e.dst->reg.handle, 0, e.dst->reg.descriptor, 0, 1, kImm, {}}, e.cb)
             .status();
       }},
      {"source_unregistered", ErrorCode::kNotFound, "unregistered",
       [](Env& e) {
         auto r = e.a->register_memory(e.src->bytes.data(), 64);
         if (!r) return r.status();
         if (Status s = e.a->unregister_memory(r->handle); !s) return s;
         return e.a->submit(W{r->handle, 0, e.dst->reg.descriptor, 0, 1, kImm, {}}, e.cb).status();
       }},
      {"unregister_twice", ErrorCode::kNotFound, "unregistered",
       [](Env& e) {
         auto r = e.a->register_memory(e.src->bytes.data(), 64);
         if (!r) return r.status();
         if (Status s = e.a->unregister_memory(r->handle); !s) return s;
         return e.a->unregister_memory(r->handle);
       }},
      // --- bad descriptors and unknown peers
      {"empty_descriptor", ErrorCode::kInvalidArgument, "descriptor is empty",
       [](Env& e) {
         return e.a->submit(W{e.src->reg.handle, 0, RemoteMemory{}, 0, 1, kImm, {}}, e.cb).status();
       }},
      {"descriptor_without_rails", ErrorCode::kInvalidArgument, "rails",
       [](Env& e) {
         const RemoteMemory d = descriptor_with(e.dst->reg.descriptor, kBytes, {});
         return e.a->submit(W{e.src->reg.handle, 0, d, 0, 64, kImm, {}}, e.cb).status();
       }},
      {"descriptor_of_another_provider", ErrorCode::kInvalidArgument, "provider",
       [](Env& e) {
         const RemoteMemory& d = e.dst->reg.descriptor;
         const Address other(e.a->group_info().provider == "shm" ? "tcp;ofi_rxm" : "shm",
                             d.owner().nics());
         const RemoteMemory foreign(other, d.base(), d.length(), d.rails());
         return e.a->submit(W{e.src->reg.handle, 0, foreign, 0, 64, kImm, {}}, e.cb).status();
       }},
      {"imm_to_empty_address", ErrorCode::kInvalidArgument, "peer address is empty",
       [](Env& e) {
         return e.a->submit(ImmWrite{Address{}, kImm, 0, 0}, e.cb).status();
       }},
      {"send_to_empty_address", ErrorCode::kInvalidArgument, "peer address is empty",
       [](Env& e) {
         const std::byte m[4] = {};
         return e.a->submit_send(Address{}, m, e.cb).status();
       }},
      {"scatter_to_owner_outside_group", ErrorCode::kNotFound, "not a member",
       [](Env& e) {
         auto g = e.a->add_peer_group({e.a->address()});
         return e.a
             ->submit(Scatter{e.src->reg.handle, *g, {{e.dst->reg.descriptor, 16, 0, 0}}, kImm, {}},
                      e.cb)
             .status();
       }},
      // The fast check of a scatter's targets must hold a descriptor made by hand to the rule
      // that check_remote holds single writes to: one rail per owner NIC (the plan indexes the
      // owner's NICs by rail).
      {"scatter_descriptor_rails_mismatch", ErrorCode::kInvalidArgument, "rails",
       [](Env& e) {
         const RemoteMemory& d = e.dst->reg.descriptor;
         std::vector<RemoteMemory::Rail> rails(d.rails().size() + 2, d.rails()[0]);
         const RemoteMemory wide = descriptor_with(d, kBytes, std::move(rails));
         auto g = e.a->add_peer_group({e.b->address()});
         return e.a->submit(Scatter{e.src->reg.handle, *g, {{wide, 16, 0, 0}}, kImm, {}}, e.cb)
             .status();
       }},
      {"scatter_unknown_peer_group", ErrorCode::kNotFound, "does not exist",
       [](Env& e) {
         return e.a
             ->submit(Scatter{e.src->reg.handle,
                              PeerGroup{999},
                              {{e.dst->reg.descriptor, 1, 0, 0}},
                              kImm,
                              {}},
                      e.cb)
             .status();
       }},
      {"barrier_unknown_peer_group", ErrorCode::kNotFound, "does not exist",
       [](Env& e) {
         return e.a->submit(Barrier{PeerGroup{999}, kImm, 0, 0}, e.cb).status();
       }},
      {"remove_unknown_peer_group", ErrorCode::kNotFound, "does not exist",
       [](Env& e) { return e.a->remove_peer_group(PeerGroup{999}); }},
      {"peer_group_duplicate_address", ErrorCode::kInvalidArgument, "same address",
       [](Env& e) {
         return e.a->add_peer_group({e.b->address(), e.b->address()}).status();
       }},
      {"unknown_device_group", ErrorCode::kNotFound, "device group 5",
       [](Env& e) { return e.a->register_memory(e.src->bytes.data(), 64, 5).status(); }},
      // --- NICs that do not exist
      {"single_pinned_to_missing_nic", ErrorCode::kInvalidArgument, "NIC 5",
       [](Env& e) {
         return e.a
             ->submit(
                 W{e.src->reg.handle, 0, e.dst->reg.descriptor, 0, 64, kImm, Routing::pinned(5)},
                 e.cb)
             .status();
       }},
      {"imm_on_missing_nic", ErrorCode::kInvalidArgument, "NIC 3",
       [](Env& e) {
         return e.a->submit(ImmWrite{e.b->address(), kImm, 3, 0}, e.cb).status();
       }},
      {"barrier_on_missing_nic", ErrorCode::kInvalidArgument, "NIC 2",
       [](Env& e) {
         auto g = e.a->add_peer_group({e.b->address()});
         return e.a->submit(Barrier{*g, kImm, 2, 0}, e.cb).status();
       }},
      // --- sizes above a limit
      {"send_above_max_message_bytes", ErrorCode::kOutOfRange, "max_message_bytes",
       [](Env& e) {
         std::vector<std::byte> big(Config{}.max_message_bytes + 1);
         return e.a->submit_send(e.b->address(), big, e.cb).status();
       }},
      {"paged_page_above_max_wr_bytes", ErrorCode::kUnsupported, "largest work request",
       [](Env& e) {
         const RemoteMemory huge =
             descriptor_with(e.dst->reg.descriptor, UINT64_MAX / 2, e.dst->reg.descriptor.rails());
         return e.a
             ->submit(PagedWrite{e.src->reg.handle,
                                 huge,
                                 Config{}.max_wr_bytes + 1,
                                 {0},
                                 0,
                                 0,
                                 {0},
                                 0,
                                 0,
                                 kImm},
                      e.cb)
             .status();
       }},
      // --- set twice
      {"expect_imm_twice", ErrorCode::kAlreadyExists, "already has a pending expectation",
       [](Env& e) {
         if (Status s = e.b->expect_imm(kImm, 5, [] {}); !s) return s;
         Status second = e.b->expect_imm(kImm, 5, [] { ADD_FAILURE() << "ran"; });
         (void)e.b->cancel_expect_imm(kImm);
         return second;
       }},
      {"receive_handler_twice", ErrorCode::kAlreadyExists, "already has a receive handler",
       [](Env& e) {
         if (Status s = e.a->set_receive_handler([](auto) {}); !s) return s;
         return e.a->set_receive_handler([](auto) { ADD_FAILURE() << "ran"; });
       },
       true},
      {"cancel_unknown_expectation", ErrorCode::kNotFound, "no pending expectation",
       [](Env& e) { return e.b->cancel_expect_imm(kImm + 1); }},
      // --- after close
      {"submit_after_close", ErrorCode::kClosed, "closed",
       [](Env& e) {
         e.a->close();
         return e.a->submit(W{e.src->reg.handle, 0, e.dst->reg.descriptor, 0, 64, kImm, {}}, e.cb)
             .status();
       },
       true},
      {"imm_after_close", ErrorCode::kClosed, "closed",
       [](Env& e) {
         e.a->close();
         return e.a->submit(ImmWrite{e.b->address(), kImm, 0, 0}, e.cb).status();
       },
       true},
      {"register_after_close", ErrorCode::kClosed, "closed",
       [](Env& e) {
         e.a->close();
         return e.a->register_memory(e.src->bytes.data(), 64).status();
       },
       true},
      {"expect_imm_after_close", ErrorCode::kClosed, "closed",
       [](Env& e) {
         e.b->close();
         return e.b->expect_imm(kImm, 1, [] { ADD_FAILURE() << "ran"; });
       },
       true},
  };
  return kRows;
}

// Engines and buffers shared by the rows that leave them as they were (saves an engine pair per
// row; the rows that close an engine or set a handler get their own).
struct Pair {
  std::unique_ptr<TransferEngine> a, b;
  std::unique_ptr<Buffer> src, dst;
  Status open() {
    Backend backend{"tcp", "tcp", false};  // the checks run before anything reaches a provider
    auto ea = TransferEngine::create(make_config(backend, 2));
    if (!ea) return ea.status();
    auto eb = TransferEngine::create(make_config(backend, 2));
    if (!eb) return eb.status();
    a = std::move(*ea);
    b = std::move(*eb);
    src = make_buffer(*a, kBytes);
    dst = make_buffer(*b, kBytes);
    fill_pattern(src->bytes.data(), kBytes, 1);
    return Status::ok();
  }
  ~Pair() {
    b.reset();  // engines before the memory they registered
    a.reset();
  }
};

class BadInput : public ::testing::TestWithParam<size_t> {
 protected:
  static void TearDownTestSuite() { shared_.reset(); }
  static std::unique_ptr<Pair> shared_;
};
std::unique_ptr<Pair> BadInput::shared_;

TEST_P(BadInput, IsRejectedWithItsErrorAndPostsNothing) {
  const Row& row = rows()[GetParam()];
  std::unique_ptr<Pair> own;
  Pair* pair = nullptr;
  if (row.fresh || !shared_) {
    auto p = std::make_unique<Pair>();
    Status s = p->open();
    if (s.code() == ErrorCode::kUnsupported) GTEST_SKIP() << "tcp not available: " << s.to_string();
    ASSERT_TRUE(s) << s.to_string();
    (row.fresh ? own : shared_) = std::move(p);
  }
  pair = row.fresh ? own.get() : shared_.get();
  std::fill(pair->dst->bytes.begin(), pair->dst->bytes.end(), kPoison);
  const uint64_t imms_before = pair->b->imm_count(kImm);
  Tally never;
  Env env{pair->a.get(), pair->b.get(), pair->src.get(), pair->dst.get(), never.callbacks()};

  const Status s = row.act(env);
  EXPECT_EQ(s.code(), row.code) << row.name << ": " << s.to_string();
  EXPECT_FALSE(s.message().empty()) << row.name << ": the error says nothing";
  EXPECT_NE(s.message().find(row.names), std::string::npos)
      << row.name << ": the error does not mention '" << row.names << "': " << s.to_string();

  // Nothing was posted: a write that had been posted would have landed by now (loopback), and
  // its immediate been counted.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(never.done() + never.failed(), 0) << "a rejected call ran a callback";
  EXPECT_EQ(pair->b->imm_count(kImm), imms_before) << "an immediate reached the peer";
  for (uint64_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(pair->dst->bytes[i], kPoison) << "byte " << i << " of the peer's memory was written";
  }
}

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::Range<size_t>(0, rows().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return std::string(rows()[info.param].name);
                         });

}  // namespace
}  // namespace fabric::testing
