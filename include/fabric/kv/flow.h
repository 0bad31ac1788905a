// The disaggregated prefill/decode flow over one TransferEngine per rank.
//
//   decoder rank                                   prefill rank
//   submit(): reserve pages, take an immediate,
//   expect layers * pages * slices of it    --Pull(request, imm, pages, layout, descriptor)-->
//                                                  layer_done(l): one paged write per slice of
//                                                  layer l, each page carrying the immediate
//   <------------------------------------------------ writes land, the engine counts them
//   on_ready(pages): exactly once, when every write of every layer of every source landed
//
// Cancellation (either side) and failure end a request with a handshake: a decoder gives its
// pages back only once every prefill rank it asked has said "nothing of mine is in flight for
// this request" (Finished), or, for a rank that died, once Options::quarantine has passed since
// the death was noticed. So a late write never lands in a page given to another request.
//
// Immediates. Only the receiver counts immediates, so each decoder allocates its own from its
// engine's immediate space, [imm_first, imm_first + imm_count): a 32-bit sequence that skips
// values still held (by a live request, or one whose writes may still arrive). Prefillers only
// echo the value they were given, so two prefillers writing into one decoder never collide,
// and no coordination between decoders is needed. A value is reset in the engine's tally before
// it is used again.
//
// Ownership of the engine. A KvDecoder or KvPrefiller installs the engine's receive handler
// (group 0) and, for a decoder, uses expect_imm on its immediate range: give each its own
// engine, or keep other users of that engine off the receive handler and the range.
//
// Threads. Every call is thread-safe and non-blocking. Callbacks (on_ready, on_error,
// on_finished) run on the engine's callback thread or on the object's timer thread, never with
// an internal lock held: they may call back into the object.
//
// Dead peers. Each side sends a small Ping every Options::heartbeat to the peers it has live
// requests with; a send that fails (the engine reports a peer unreachable after at most
// Config::peer_timeout) or fail_peer() (e.g. from a membership watch) fails that peer's
// requests, and only those.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "fabric/engine.h"
#include "fabric/kv/layout.h"
#include "fabric/uvm_watcher.h"

namespace fabric::kv {

using RequestId = uint64_t;

struct Options {
  // How often a side pings the peers it has live requests with.
  std::chrono::milliseconds heartbeat{200};
  // After a peer is declared dead, how long pages it may still have been writing stay held.
  std::chrono::milliseconds quarantine{500};
  // Prefiller: how long a started request waits for the pulls of all its decode ranks (and a
  // pull for a request not started yet waits for start()) before giving up with kTimeout.
  std::chrono::milliseconds pull_timeout{30000};
  // Decoder: the immediates this decoder may use.
  uint32_t imm_first = 1u << 20;
  uint32_t imm_count = 1u << 30;
};

// One decode request as a decoder rank sees it.
struct DecodeRequest {
  RequestId id = 0;
  // Pages of this rank's pool to fill; reserved from the pool when empty (num_pages of them).
  std::vector<uint32_t> pages;
  uint32_t num_pages = 0;
  // The prefill instance computing it: the address (group 0) of each of its TP ranks, in rank
  // order. The decoder asks only the ranks holding heads it needs.
  std::vector<Address> prefill_ranks;
  // Exactly one of the two runs, once. on_ready hands the pages over (give them back with
  // release()); on_error runs once no write of the request can still land (the pages are
  // back in the pool, or held in quarantine and returned later by the decoder itself).
  std::function<void(RequestId, std::span<const uint32_t> pages)> on_ready;
  std::function<void(RequestId, const Status&)> on_error;
};

class KvDecoder {
 public:
  // `memory` is this rank's registered KV region, laid out as `layout`. Errors:
  // kInvalidArgument (bad layout, a region smaller than layout.region_bytes()),
  // kAlreadyExists (the engine already has a receive handler).
  static Result<std::unique_ptr<KvDecoder>> create(TransferEngine& engine, const KvLayout& layout,
                                                   const Registration& memory,
                                                   const Options& options = {});
  // Fails nothing and calls nothing: callbacks of requests still live never run.
  ~KvDecoder();
  KvDecoder(const KvDecoder&) = delete;
  KvDecoder& operator=(const KvDecoder&) = delete;

  // Reserves the pages, arms the immediate and sends the pulls. Returns the pages. Errors:
  // kInvalidArgument (no prefill ranks, zero pages, a page outside the pool, a prefill TP
  // size that does not fit this layout), kAlreadyExists (the id is live, or a page is taken),
  // kOutOfRange (not enough free pages: retry after a release), kClosed.
  Result<std::vector<uint32_t>> submit(DecodeRequest request);
  // Cancels a request that is not ready yet: its on_error gets kCancelled once every prefill
  // rank confirmed that nothing is in flight. Errors: kNotFound (unknown, already ended or
  // ready).
  Status cancel(RequestId id);
  // Gives the pages of a ready request back to the pool. Errors: kNotFound.
  Status release(RequestId id);
  // Fails every live request that has `peer` among its prefill ranks (e.g. the membership
  // registry saw it leave), as a failed heartbeat would.
  void fail_peer(const Address& peer);

  uint32_t free_pages() const;
  size_t live_requests() const;  // submitted, not yet ready or ended
  const KvLayout& layout() const;

  class Impl;

 private:
  explicit KvDecoder(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

class KvPrefiller {
 public:
  // Runs once per started request, when every decode rank's pull has ended and no write of the
  // request is in flight: Ok when every pull got every layer, else the first error. The source
  // pages may be reused from then on.
  using FinishedFn = std::function<void(RequestId, const Status&)>;
  // Runs when every write of one layer into one decode rank has completed (the layer's source
  // pages are no longer read for that rank). Optional; for pipelining and measurements.
  using LayerFn = std::function<void(RequestId, uint32_t decode_rank, uint32_t layer)>;

  static Result<std::unique_ptr<KvPrefiller>> create(TransferEngine& engine, const KvLayout& layout,
                                                     const Registration& memory,
                                                     const Options& options = {});
  ~KvPrefiller();
  KvPrefiller(const KvPrefiller&) = delete;
  KvPrefiller& operator=(const KvPrefiller&) = delete;

  // Declares a request computed here into `pages` (one per logical page, in order), to be
  // pulled by a decode instance of TP size decode_tp. Pulls may arrive before or after.
  // Errors: kInvalidArgument (no pages, a page outside the pool, a decode TP size that does not
  // fit), kAlreadyExists (the id is live), kClosed.
  Status start(RequestId id, std::vector<uint32_t> pages, uint32_t decode_tp,
               FinishedFn on_finished, LayerFn on_layer = nullptr);
  // Layer `layer` of the request is computed: write it to every decode rank that pulled (and
  // later to those that pull later). Errors: kNotFound, kOutOfRange (no such layer).
  Status layer_done(RequestId id, uint32_t layer);
  // Stops the request: no further layer is written; decode ranks get Finished(kCancelled) once
  // their writes are out of flight; on_finished gets kCancelled. Errors: kNotFound.
  Status cancel(RequestId id);
  // Ends every pull towards `peer` with kPeerUnreachable (membership saw it leave).
  void fail_peer(const Address& peer);

  // The GPU trigger: a watcher whose word counts the layers computed so far (a kernel stores
  // 1, 2, ... as layers finish); each new value calls layer_done for the layers it covers, and
  // the watch ends after the last layer. `observer`, when set, runs after each of those
  // layer_done calls (on the watcher's polling thread). Errors: those of UvmWatchers::watch
  // (kUnsupported without CUDA).
  Result<Watcher> watch_layers(UvmWatchers& watchers, RequestId id,
                               std::function<void(uint32_t layer)> observer = nullptr);

  size_t live_requests() const;
  const KvLayout& layout() const;

  class Impl;

 private:
  explicit KvPrefiller(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace fabric::kv
