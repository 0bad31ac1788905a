#include "fabric/kv/layout.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/invalid.h"

namespace fabric::kv {

using fabric::invalid;  // common/invalid.h

Status KvLayout::validate() const {
  if (num_layers == 0) return invalid("KvLayout.num_layers is 0");
  if (num_pages == 0) return invalid("KvLayout.num_pages is 0");
  if (tokens_per_page == 0) return invalid("KvLayout.tokens_per_page is 0");
  if (num_kv_heads == 0) return invalid("KvLayout.num_kv_heads is 0");
  if (head_bytes == 0) return invalid("KvLayout.head_bytes is 0");
  if (tp_size == 0) return invalid("KvLayout.tp_size is 0");
  if (tp_rank >= tp_size) {
    return invalid(fmt::format("KvLayout.tp_rank {} is outside tp_size {}", tp_rank, tp_size));
  }
  if (tp_size <= num_kv_heads ? num_kv_heads % tp_size != 0 : tp_size % num_kv_heads != 0) {
    return invalid(
        fmt::format("KvLayout.tp_size {} neither divides nor is a multiple of num_kv_heads {}",
                    tp_size, num_kv_heads));
  }
  if (page_stride != 0 && page_stride < page_bytes()) {
    return invalid(fmt::format("KvLayout.page_stride {} is smaller than a page ({} bytes)",
                               page_stride, page_bytes()));
  }
  if (layer_stride != 0 && layer_stride < num_pages * page_step()) {
    return invalid(
        fmt::format("KvLayout.layer_stride {} is smaller than a layer's pages ({} bytes)",
                    layer_stride, num_pages * page_step()));
  }
  return Status::ok();
}

uint32_t KvLayout::first_head() const {
  if (tp_size <= num_kv_heads) return tp_rank * (num_kv_heads / tp_size);
  return tp_rank / (tp_size / num_kv_heads);
}

uint32_t KvLayout::local_heads() const {
  return tp_size <= num_kv_heads ? num_kv_heads / tp_size : 1;
}

uint64_t KvLayout::region_bytes() const {
  return page_offset(num_layers - 1, num_pages - 1) + page_bytes();
}

KvLayout KvLayout::with_rank(uint32_t size, uint32_t rank) const {
  KvLayout l = *this;
  l.tp_size = size;
  l.tp_rank = rank;
  l.base_offset = 0;
  l.layer_stride = 0;
  l.page_stride = 0;
  return l;
}

std::string KvLayout::to_string() const {
  return fmt::format(
      "{} layers x {} pages of {} tokens, {} KV heads of {} bytes{}, TP rank {}/{} (heads "
      "{}..{}, {} bytes a page)",
      num_layers, num_pages, tokens_per_page, num_kv_heads, head_bytes, split_kv ? " (K/V)" : "",
      tp_rank, tp_size, first_head(), first_head() + local_heads() - 1, page_bytes());
}

Result<std::vector<SliceCopy>> plan_slices(const KvLayout& src, const KvLayout& dst) {
  KvLayout s = src.with_rank(src.tp_size, 0);
  KvLayout d = dst.with_rank(dst.tp_size, 0);
  if (auto st = s.validate(); !st) return Status(st.code(), "prefill layout: " + st.message());
  if (auto st = d.validate(); !st) return Status(st.code(), "decode layout: " + st.message());
  auto mismatch = [](const char* field, uint64_t a, uint64_t b) {
    return invalid(fmt::format("prefill and decode layouts disagree on {}: {} vs {}", field, a, b));
  };
  if (s.num_layers != d.num_layers) return mismatch("num_layers", s.num_layers, d.num_layers);
  if (s.tokens_per_page != d.tokens_per_page) {
    return mismatch("tokens_per_page", s.tokens_per_page, d.tokens_per_page);
  }
  if (s.num_kv_heads != d.num_kv_heads) {
    return mismatch("num_kv_heads", s.num_kv_heads, d.num_kv_heads);
  }
  if (s.head_bytes != d.head_bytes) return mismatch("head_bytes", s.head_bytes, d.head_bytes);
  if (s.split_kv != d.split_kv) return mismatch("split_kv", s.split_kv, d.split_kv);

  const uint32_t heads = s.num_kv_heads;
  const uint64_t slice = s.head_slice_bytes();
  std::vector<SliceCopy> plan;
  for (uint32_t dr = 0; dr < d.tp_size; ++dr) {
    KvLayout dl = d.with_rank(d.tp_size, dr);
    for (uint32_t part = 0; part < d.parts(); ++part) {
      for (uint32_t h = dl.first_head(); h < dl.first_head() + dl.local_heads(); ++h) {
        // The prefill ranks holding head h; decode ranks spread over them.
        uint32_t holder;
        if (s.tp_size <= heads) {
          holder = h / (heads / s.tp_size);
        } else {
          const uint32_t replicas = s.tp_size / heads;
          holder = h * replicas + dr % replicas;
        }
        KvLayout sl = s.with_rank(s.tp_size, holder);
        SliceCopy c{holder, dr, sl.head_offset(part, h), dl.head_offset(part, h), slice};
        if (!plan.empty()) {
          SliceCopy& last = plan.back();
          if (last.src_rank == c.src_rank && last.dst_rank == c.dst_rank &&
              last.src_offset + last.length == c.src_offset &&
              last.dst_offset + last.length == c.dst_offset) {
            last.length += c.length;
            continue;
          }
        }
        plan.push_back(c);
      }
    }
  }
  return plan;
}

std::vector<SliceCopy> slices_between(const std::vector<SliceCopy>& plan, uint32_t src_rank,
                                      uint32_t dst_rank) {
  std::vector<SliceCopy> out;
  for (const auto& c : plan) {
    if (c.src_rank == src_rank && c.dst_rank == dst_rank) out.push_back(c);
  }
  return out;
}

uint32_t slices_into(const std::vector<SliceCopy>& plan, uint32_t dst_rank) {
  return static_cast<uint32_t>(
      std::count_if(plan.begin(), plan.end(), [&](auto& c) { return c.dst_rank == dst_rank; }));
}

std::vector<uint32_t> sources_of(const std::vector<SliceCopy>& plan, uint32_t dst_rank) {
  std::vector<uint32_t> out;
  for (const auto& c : plan) {
    if (c.dst_rank == dst_rank) out.push_back(c.src_rank);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<uint32_t> targets_of(const std::vector<SliceCopy>& plan, uint32_t src_rank) {
  std::vector<uint32_t> out;
  for (const auto& c : plan) {
    if (c.src_rank == src_rank) out.push_back(c.dst_rank);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace fabric::kv
