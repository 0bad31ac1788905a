// KvLayout: the geometry of one tensor-parallel rank's paged KV cache, and the plan that maps
// the heads of a prefill layout onto those of a decode layout with another TP size.
//
// Memory of one rank, inside one registered region:
//
//   region + base_offset + layer * layer_stride + page * page_stride
//     -> one page: [part][local head][token][head_bytes]
//
// where part is K then V (split_kv) or a single part (a latent cache), and the local heads are
// the heads this rank holds. Heads are the outer dimension inside a part so that any range of
// heads is one contiguous run of bytes in every page: moving heads [a, b) between two TP
// layouts is one strided paged write per (layer, part), whatever the two TP sizes are.
//
// Heads of a TP group: with tp_size <= num_kv_heads (which it must divide), rank r holds heads
// [r * H / tp, (r + 1) * H / tp). With tp_size > num_kv_heads (a multiple of it), each head is
// replicated on tp_size / H consecutive ranks and rank r holds the one head r / (tp_size / H).
//
// Everything here is pure computation: no engine, no blocking, safe from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fabric/status.h"

namespace fabric::kv {

struct KvLayout {
  uint32_t num_layers = 0;
  uint32_t num_pages = 0;        // pages per layer in this rank's pool
  uint32_t tokens_per_page = 0;  // tokens in one page
  uint32_t num_kv_heads = 0;     // KV heads of one layer of the whole model (all TP ranks)
  uint32_t head_bytes = 0;       // bytes of one head of one token (head_dim * dtype size)
  bool split_kv = true;          // K and V as two parts; false: one part (e.g. MLA latent)
  uint32_t tp_size = 1;
  uint32_t tp_rank = 0;
  uint64_t base_offset = 0;   // offset of layer 0, page 0 in the registered region
  uint64_t layer_stride = 0;  // bytes between layers; 0: num_pages * page_stride (packed)
  uint64_t page_stride = 0;   // bytes between pages; 0: page_bytes() (packed)

  // Ok, or kInvalidArgument naming the field at fault (a zero size, a TP size that neither
  // divides nor is a multiple of num_kv_heads, a rank outside the TP group, strides smaller
  // than what they step over).
  Status validate() const;

  uint32_t parts() const { return split_kv ? 2 : 1; }
  uint32_t first_head() const;   // the first head this rank holds
  uint32_t local_heads() const;  // how many heads this rank holds
  uint64_t head_slice_bytes() const { return uint64_t{tokens_per_page} * head_bytes; }
  uint64_t part_bytes() const { return local_heads() * head_slice_bytes(); }
  uint64_t page_bytes() const { return parts() * part_bytes(); }
  uint64_t page_step() const { return page_stride ? page_stride : page_bytes(); }
  uint64_t layer_step() const { return layer_stride ? layer_stride : num_pages * page_step(); }
  // Offset of (layer, page) in the region.
  uint64_t page_offset(uint32_t layer, uint32_t page) const {
    return base_offset + layer * layer_step() + page * page_step();
  }
  // Offset inside a page of `head` (a global head index this rank holds) in `part`.
  uint64_t head_offset(uint32_t part, uint32_t head) const {
    return part * part_bytes() + (head - first_head()) * head_slice_bytes();
  }
  // Bytes the registered region must hold: the end of the last page of the last layer.
  uint64_t region_bytes() const;

  // The same model geometry on another rank of another TP size (strides reset to packed).
  KvLayout with_rank(uint32_t size, uint32_t rank) const;
  std::string to_string() const;
};

// One contiguous run of bytes, the same in every page, that prefill rank src_rank writes into
// decode rank dst_rank: src_offset/dst_offset are offsets inside a page of each side.
struct SliceCopy {
  uint32_t src_rank = 0;
  uint32_t dst_rank = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
  friend bool operator==(const SliceCopy&, const SliceCopy&) = default;
};

// Every slice needed to fill every decode rank of a TP group of layout `dst` from the prefill
// TP group of layout `src` (their tp_rank fields are ignored): each head of each decode rank is
// written by exactly one prefill rank (replicated prefill heads are spread over their holders
// by decode rank). Adjacent runs are merged, so identical layouts give one slice per rank
// pair carrying the whole page. Errors: kInvalidArgument when the two layouts disagree on the
// model (layers, tokens per page, heads, head bytes, K/V split) or one is invalid.
Result<std::vector<SliceCopy>> plan_slices(const KvLayout& src, const KvLayout& dst);

// The slices of `plan` from src_rank to dst_rank.
std::vector<SliceCopy> slices_between(const std::vector<SliceCopy>& plan, uint32_t src_rank,
                                      uint32_t dst_rank);

// How many paged writes per page per layer decode rank dst_rank receives in total (the number
// of immediates it counts per page per layer).
uint32_t slices_into(const std::vector<SliceCopy>& plan, uint32_t dst_rank);

// The prefill ranks that write into decode rank dst_rank, ascending.
std::vector<uint32_t> sources_of(const std::vector<SliceCopy>& plan, uint32_t dst_rank);
// The decode ranks that prefill rank src_rank writes into, ascending.
std::vector<uint32_t> targets_of(const std::vector<SliceCopy>& plan, uint32_t src_rank);

}  // namespace fabric::kv
